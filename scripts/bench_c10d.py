#!/usr/bin/env python3
"""Collectives through the tdist backend against Gloo, in the same run, from Python.

  python3 scripts/bench_c10d.py [--world-sizes 2 4] [--ops allreduce allgather broadcast
                                reduce_scatter] [--sizes 4K 1M 64M | --min-bytes 4K --max-bytes 64M]
                                [--seconds 1.0] [--rounds 3] [--build-dir build]

For each world size it starts that many processes on this machine (127.0.0.1). Each initialises
the default group with backend "tdist" and a second group over the same ranks with "gloo", then
for every op and size (float32; --sizes, or powers of 4 from --min-bytes to --max-bytes) times
it through each: dist.all_reduce, dist.all_gather_into_tensor, dist.broadcast (root 0) and
dist.reduce_scatter_tensor; the size is the larger buffer (allgather's output, reduce_scatter's
input), as in nccl-tests. Warm-up, then --rounds rounds that alternate the backends, each running
as many iterations as fit in its share of --seconds (at least 5). The time of a size is the median
iteration, the slowest rank's. busbw follows nccl-tests: algbw * 2(n-1)/n for allreduce,
algbw * (n-1)/n for allgather and reduce_scatter, algbw for broadcast. Alternating spreads a shared
machine's load changes over both backends; compare the ratio, not the absolute figures. One more
call on known values per op, size and backend is checked ("wrong" counts bad elements).
"""

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return "%g %s" % (n / size, unit)
    return "%d B" % n


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ops", nargs="+", default=list(OPS),
                   choices=list(OPS))
    p.add_argument("--sizes", nargs="+", default=["4K", "1M", "64M"],
                   help="sizes to run (default 4K 1M 64M); --min-bytes/--max-bytes instead give "
                        "powers of 4")
    p.add_argument("--min-bytes")
    p.add_argument("--max-bytes")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="time budget per size and backend (default 1.0)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternations between the backends per size (default 3)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--build-dir", default=os.path.join(REPO, "build"),
                   help="where tdist_c10d was built (its python/ folder goes on PYTHONPATH)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def sizes(args):
    if not args.min_bytes and not args.max_bytes:
        return [parse_bytes(x) for x in args.sizes]
    lo, hi = parse_bytes(args.min_bytes or "4K"), parse_bytes(args.max_bytes or "64M")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


class Op:
    """One collective: its buffers for a size, the call, the check and the busbw factor."""

    def __init__(self, name, busbw, make, call, expected):
        self.name, self.busbw, self.make, self.call, self.expected = (
            name, busbw, make, call, expected)


def _make_pair(torch, numel, rank, out_numel):
    return (torch.full((numel,), float(rank + 1)), torch.empty(out_numel))


OPS = {
    # make(torch, numel, n, rank) -> buffers; call(dist, buffers, group);
    # expected(torch, buffers, n) -> tensor the result must equal.
    "allreduce": Op("allreduce", lambda n: 2.0 * (n - 1) / n,
                    lambda torch, numel, n, rank: (torch.full((numel,), float(rank + 1)),),
                    lambda dist, b, g: dist.all_reduce(b[0], group=g),
                    lambda torch, b, n: (b[0], torch.full_like(b[0], n * (n + 1) // 2))),
    "allgather": Op("allgather", lambda n: (n - 1) / n,
                    lambda torch, numel, n, rank: _make_pair(torch, numel // n, rank,
                                                             numel // n * n),
                    lambda dist, b, g: dist.all_gather_into_tensor(b[1], b[0], group=g),
                    lambda torch, b, n: (b[1], torch.arange(1, n + 1, dtype=torch.float32)
                                         .repeat_interleave(b[0].numel()))),
    "broadcast": Op("broadcast", lambda n: 1.0,
                    lambda torch, numel, n, rank: (torch.full((numel,), float(rank + 1)),),
                    lambda dist, b, g: dist.broadcast(b[0], src=0, group=g),
                    lambda torch, b, n: (b[0], torch.ones_like(b[0]))),
    "reduce_scatter": Op("reduce_scatter", lambda n: (n - 1) / n,
                         lambda torch, numel, n, rank: _make_pair(torch, numel // n * n, rank,
                                                                  numel // n),
                         lambda dist, b, g: dist.reduce_scatter_tensor(b[1], b[0], group=g),
                         lambda torch, b, n: (b[1], torch.full_like(b[1], n * (n + 1) // 2))),
}


def time_op(dist, torch, op, buffers, group, seconds):
    """Times `op` for about `seconds` (at least 5 iterations); returns the times."""
    times = []
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        op.call(dist, buffers, group)
        times.append(time.perf_counter() - start)
        if len(times) >= 5:
            # Untimed: the ranks stop together, when the first of them runs out of time.
            go_on = torch.tensor([int(time.perf_counter() < deadline and len(times) < 1000)])
            dist.all_reduce(go_on, op=dist.ReduceOp.MIN, group=group)
            if go_on.item() == 0:
                return times


def child(args):
    import torch
    import torch.distributed as dist
    import tdist_c10d  # noqa: F401 - registers "tdist"
    torch.set_num_threads(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("tdist", init_method="env://", timeout=datetime.timedelta(minutes=5))
    gloo = dist.new_group(backend="gloo")
    groups = {"tdist": None, "gloo": gloo}
    rows = []
    for op in (OPS[name] for name in args.ops):
        for nbytes in sizes(args):
            numel = nbytes // 4
            buffers = {name: op.make(torch, numel, n, rank) for name in groups}
            times = {name: [] for name in groups}
            for name, group in groups.items():
                for _ in range(args.warmup):
                    op.call(dist, buffers[name], group)
            # Alternate the backends in rounds, so that load changes on a shared machine hit both.
            for _ in range(args.rounds):
                for name, group in groups.items():
                    times[name] += time_op(dist, torch, op, buffers[name], group,
                                           args.seconds / args.rounds)
            row = {"op": op.name, "bytes": nbytes}
            for name, group in groups.items():
                b = op.make(torch, numel, n, rank)  # one more call on known values, checked
                op.call(dist, b, group)
                got, want = op.expected(torch, b, n)
                wrong = int((got != want).sum().item())
                stats = torch.tensor([statistics.median(times[name]), float(wrong),
                                      float(len(times[name]))], dtype=torch.float64)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=gloo)
                row[name] = (stats[0].item(), int(stats[1].item()), int(stats[2].item()))
            rows.append(row)
    if rank == 0:
        for row in rows:
            print("ROW %s %d %s %s" % (row["op"], row["bytes"], " ".join(map(repr, row["tdist"])),
                                       " ".join(map(repr, row["gloo"]))))
    dist.destroy_process_group()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(args, n):
    env = dict(os.environ)
    pypath = os.path.join(args.build_dir, "python")
    env["PYTHONPATH"] = pypath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1"})
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--seconds", str(args.seconds),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--ops"] + args.ops
    argv += ["--sizes"] + [str(b) for b in sizes(args)]
    procs = []
    for r in range(n):
        procs.append(subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        if p.returncode != 0:
            sys.exit("bench_c10d: rank %d of %d failed (exit %d):\n%s" % (
                r, n, p.returncode, outputs[r]))
    rows = []
    for line in outputs[0].splitlines():
        if line.startswith("ROW "):
            f = line.split()
            rows.append((f[1], int(f[2]), float(f[3]), int(f[4]), int(f[5]),
                         float(f[6]), int(f[7]), int(f[8])))
    return rows


def main():
    args = parse()
    if args.child:
        child(args)
        return
    import torch
    print("# tdist vs gloo in the same run, float32 (SUM); torch %s, %d CPUs" % (
        torch.__version__, os.cpu_count()))
    print("# time: median iteration of the slowest rank; busbw as nccl-tests")
    header = ("| ranks | op | size | tdist time (us) | tdist busbw (GB/s) | gloo time (us) "
              "| gloo busbw (GB/s) | tdist / gloo busbw | wrong |")
    print(header)
    print("|" + "---|" * 9)
    for n in args.world_sizes:
        for (op, nbytes, t_time, t_wrong, _, g_time, g_wrong, _) in run_world(args, n):
            factor = OPS[op].busbw(n)
            t_bw = nbytes / t_time * factor / 1e9
            g_bw = nbytes / g_time * factor / 1e9
            ratio = "%.2fx" % (t_bw / g_bw) if g_bw > 0 else "-"
            print("| %d | %s | %s | %.1f | %.3f | %.1f | %.3f | %s | %d/%d |" % (
                n, op, human(nbytes), t_time * 1e6, t_bw, g_time * 1e6, g_bw, ratio,
                t_wrong, g_wrong), flush=True)


if __name__ == "__main__":
    main()
