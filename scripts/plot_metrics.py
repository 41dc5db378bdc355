#!/usr/bin/env python3
"""Draws a tdist-train run from its metrics file (`tdist-train --metrics FILE`, JSON lines).

    scripts/plot_metrics.py build/main-job-metrics.jsonl -o build/main-job.png

Three panels against the training step: the training loss; the training accuracy (the mean over
each report's window) with the test accuracy of every evaluation; and the throughput (samples per
second over all ranks). Lines of other events are ignored, so a file that several runs appended
to can be drawn with --last-run (the lines after the last time the step went backwards).

Exit codes: 0 drawn; 2 bad input (missing or unreadable file, a line that is not a JSON object,
no training reports), with the reason on stderr; 3 matplotlib is missing.
"""
import argparse
import json
import sys


class BadInput(Exception):
    pass


def read_metrics(path):
    """Returns the list of JSON objects in `path`, one per non-empty line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise BadInput(f"{path}:{number}: not a JSON object")
        records.append(record)
    return records


def last_run(records):
    """The records after the last point where the training step went backwards."""
    start, previous = 0, None
    for i, r in enumerate(records):
        if r.get("event") != "train":
            continue
        step = r.get("step")
        if previous is not None and isinstance(step, (int, float)) and step <= previous:
            start = i
        previous = step
    return records[start:]


def series(records, event, key):
    """(steps, values) of `key` over the records of `event` that have both numbers."""
    steps, values = [], []
    for r in records:
        if r.get("event") != event:
            continue
        step, value = r.get("step"), r.get(key)
        if isinstance(step, (int, float)) and isinstance(value, (int, float)):
            steps.append(step)
            values.append(value)
    return steps, values


def draw(records, out, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_metrics: matplotlib is missing (scripts/setup.sh installs it)", file=sys.stderr)
        sys.exit(3)

    loss = series(records, "train", "loss")
    if not loss[0]:
        raise BadInput("no training reports (lines with \"event\": \"train\") to draw")
    train_acc = series(records, "train", "train_accuracy")
    eval_acc = series(records, "eval", "accuracy")
    speed = series(records, "train", "samples_per_sec")

    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(13, 3.8))
    ax_loss.plot(*loss, color="tab:red")
    ax_loss.set_title("training loss")
    ax_acc.plot(train_acc[0], [100 * v for v in train_acc[1]], label="train (window)",
                color="tab:blue", alpha=0.6)
    if eval_acc[0]:
        ax_acc.plot(eval_acc[0], [100 * v for v in eval_acc[1]], "o-", label="test",
                    color="tab:green")
    ax_acc.set_title("accuracy (%)")
    ax_acc.legend(loc="lower right")
    ax_speed.plot(*speed, color="tab:purple")
    ax_speed.set_title("samples/s (all ranks)")
    ax_speed.set_ylim(bottom=0)
    for ax in (ax_loss, ax_acc, ax_speed):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="JSON lines written by tdist-train --metrics")
    parser.add_argument("-o", "--output", required=True, help="image to write (.png, .svg, .pdf)")
    parser.add_argument("--title", default="", help="title above the panels")
    parser.add_argument("--last-run", action="store_true",
                        help="draw only the last run of a file several runs appended to")
    args = parser.parse_args(argv)
    try:
        records = read_metrics(args.metrics)
        if args.last_run:
            records = last_run(records)
        draw(records, args.output, args.title)
    except BadInput as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    print(f"plot_metrics: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
