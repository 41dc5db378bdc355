#!/usr/bin/env python3
"""Draws what a tdist-bench subcommand wrote with --json: its figure against its anchor and its
bound, as measured in the same run. tdist-bench calls it for --plot FILE.png.

    scripts/plot_bench.py collective out.json -o allreduce.png   # tdist-bench collective --json
    scripts/plot_bench.py ddp out.json -o ddp.png                # tdist-bench ddp --json
    scripts/plot_bench.py rpc out.json -o rpc.png                # tdist-bench rpc --json

collective: busbw against the size (log-log) for tdist, the bound and the anchor (when the run
had one), and below it busbw as a fraction of the bound and of the anchor. ddp: samples/s per
world size, bars for the bound, tdist and PyTorch's DDP, labelled with tdist's fraction of the
bound. rpc: the round trip (us) and the tensor echo (GB/s) of tdist, torch.distributed.rpc and
their bounds.

Exit codes: 0 drawn; 2 bad input (unreadable file, not the subcommand's JSON), with the reason on
stderr; 3 matplotlib is missing.
"""
import argparse
import json
import sys


class BadInput(Exception):
    pass


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not JSON ({e.msg})") from None


def need(obj, keys, what):
    if not isinstance(obj, dict) or any(k not in obj for k in keys):
        raise BadInput(f"{what}: expected the keys {', '.join(keys)}")


def fmt_bytes(b):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= div:
            return f"{b / div:g}{unit}"
    return str(b)


def plot_collective(plt, data, title):
    need(data, ["op", "world_size", "bound", "rows"], "collective JSON")
    rows = data["rows"]
    if not rows:
        raise BadInput("collective JSON: no rows")
    for r in rows:
        need(r, ["bytes", "busbw_gbs", "bound_gbs", "busbw_over_bound"], "collective row")
    anchor = data.get("anchor", "none")
    x = [r["bytes"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    top.plot(x, [r["busbw_gbs"] for r in rows], "o-", label="tdist busbw")
    top.plot(x, [r["bound_gbs"] for r in rows], "k--", label=f"bound: {data['bound']}")
    xcore = all("xcore_gbs" in r for r in rows)  # the cross-core copy, on one host
    if xcore:
        top.plot(x, [r["xcore_gbs"] for r in rows], "k:", label="cross-core copy")
    if anchor != "none":
        top.plot(x, [r["anchor_busbw_gbs"] for r in rows], "s-", label=f"{anchor} busbw")
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    top.set_ylabel("GB/s")
    top.legend(fontsize=8)
    top.grid(True, which="both", alpha=0.3)
    top.set_title(title or f"{data['op']}, world size {data['world_size']}")
    bottom.plot(x, [r["busbw_over_bound"] for r in rows], "o-", label="tdist busbw / bound")
    if xcore:
        bottom.plot(x, [r["busbw_over_xcore"] for r in rows], "^-", label="tdist busbw / cross-core copy")
    if anchor != "none":
        bottom.plot(x, [r["busbw_over_anchor"] for r in rows], "s-", label=f"tdist busbw / {anchor}'s")
    bottom.axhline(1.0, color="k", lw=0.8)
    bottom.set_yscale("log")
    bottom.set_ylabel("ratio")
    bottom.set_xlabel("bytes")
    bottom.set_xticks(x)
    bottom.set_xticklabels([fmt_bytes(b) for b in x], rotation=45, fontsize=8)
    bottom.legend(fontsize=8)
    bottom.grid(True, which="both", alpha=0.3)
    return fig


def plot_ddp(plt, data, title):
    need(data, ["worlds", "batch", "hidden", "layers"], "ddp JSON")
    worlds = data["worlds"]
    if not worlds:
        raise BadInput("ddp JSON: no world sizes")
    for w in worlds:
        need(w, ["world", "bound", "tdist", "tdist_over_bound"], "ddp world")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.27
    labelled = set()
    for i, w in enumerate(worlds):
        bars = [("bound (independent libtorch)", w["bound"], "0.6"), ("tdist DDP", w["tdist"], "C0")]
        if "torch" in w:
            bars.append(("PyTorch DDP (gloo)", w["torch"], "C1"))
        for j, (label, res, color) in enumerate(bars):
            ax.bar(i + (j - 1) * width, res["samples_per_s"], width, color=color,
                   label=None if label in labelled else label)
            labelled.add(label)
        ax.annotate(f"{w['tdist_over_bound']:.2f} of bound", (i, w["tdist"]["samples_per_s"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(worlds)))
    ax.set_xticklabels([f"world {w['world']}" for w in worlds])
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(title or f"DDP, MLP 784-{data['hidden']}x{data['layers']}-10, "
                          f"batch {data['batch']} per rank")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def plot_rpc(plt, data, title):
    need(data, ["tdist"], "rpc JSON")
    ours = data["tdist"]
    need(ours, ["rtt_us", "echo_gbps", "pingpong_us", "memcpy_gbps", "echo_tcp_gbps"], "rpc tdist")
    theirs = data.get("torch")
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    labels = ["tdist", f"TCP ping-pong\n{ours.get('pingpong_bytes', '?')} B (bound)"]
    values = [ours["rtt_us"], ours["pingpong_us"]]
    colors = ["C0", "0.6"]
    if "ring_pingpong_us" in ours:  # JSON written before the frame streams has no ring bound
        labels.append("shm ring\nping-pong (bound)")
        values.append(ours["ring_pingpong_us"])
        colors.append("0.8")
    if theirs:
        labels.append("torch.distributed\n.rpc")
        values.append(theirs["rtt_us"])
        colors.append("C1")
    left.bar(labels, values, color=colors)
    left.set_ylabel("us (lower is better)")
    left.set_title("rpc_sync round trip")
    labels = ["tdist", "memcpy\n(bound)", "TCP\nping-pong"]
    values = [ours["echo_gbps"], ours["memcpy_gbps"], ours["echo_tcp_gbps"]]
    if theirs:
        labels.append("torch.distributed\n.rpc")
        values.append(theirs["echo_gbps"])
    right.bar(labels, values, color=["C0", "0.6", "0.8", "C1"][:len(values)])
    right.set_ylabel("GB/s, both ways (higher is better)")
    right.set_title(f"tensor echo, {ours.get('echo_bytes', 0) / (1 << 20):g} MiB")
    right.tick_params(axis="x", labelsize=8)
    left.tick_params(axis="x", labelsize=8)
    if title:
        fig.suptitle(title)
    return fig


PLOTS = {"collective": plot_collective, "ddp": plot_ddp, "rpc": plot_rpc}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(PLOTS))
    p.add_argument("json", help="what the subcommand wrote with --json")
    p.add_argument("-o", "--output", required=True, help="PNG to write")
    p.add_argument("--title", default="")
    args = p.parse_args()
    try:
        data = load(args.json)
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("plot_bench.py: matplotlib is not installed", file=sys.stderr)
            return 3
        fig = PLOTS[args.kind](plt, data, args.title)
    except BadInput as e:
        print(f"plot_bench.py: {e}", file=sys.stderr)
        return 2
    fig.tight_layout()
    fig.savefig(args.output, dpi=80)
    return 0


if __name__ == "__main__":
    sys.exit(main())
