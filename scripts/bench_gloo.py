#!/usr/bin/env python3
"""Compare tdist's collectives with libtorch's Gloo in one run, and print both tables and ratios.
With --device cuda, on CUDA tensors: against torch.distributed's NCCL (--torch-backend nccl,
tdist's default backend for CUDA tensors) or Gloo (tdist's ring staging them through host memory,
--group-backend ring; ranks then share the GPUs).

libtorch's c10d::ProcessGroupGloo cannot be driven from C++ with the pip wheel (no gloo headers),
so this script runs torch.distributed's Gloo backend from Python with the same sizes, the same
timing rule and the same result check as `tdist-bench collective`, and runs tdist-bench under
tdist-run right after it. Rounds alternate between the two backends; per size the best of the
rounds is kept for each backend, so slow spells on a shared machine hit both alike.

    python3 scripts/bench_gloo.py --build build --nproc 2 4 --ops allreduce broadcast \
        --min-bytes 4K --max-bytes 64M --rounds 3 --markdown perf.md
    python3 scripts/bench_gloo.py --device cuda --torch-backend gloo --group-backend ring ...
    python3 scripts/bench_gloo.py --device cuda --torch-backend nccl --nproc 1 ...

Timing rule (both backends): each rank times every iteration (issue + wait, and on CUDA tensors a
device synchronize), the per-iteration maximum over ranks is taken, the row shows the median over
iterations; busbw as in nccl-tests.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

OPS = ["allreduce", "broadcast", "reduce", "allgather", "gather", "scatter", "reduce_scatter",
       "alltoall", "barrier"]
PER_RANK_BLOCKS = {"allgather", "gather", "scatter", "reduce_scatter", "alltoall", "barrier"}


def parse_bytes(text):
    text = str(text).strip()
    mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(text[-1].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def sizes(min_b, max_b, factor, op):
    out, b = [], float(min_b)
    while b <= max_b * 1.0000001:
        out.append(int(b))
        if op == "barrier":
            break
        b *= factor
    return out


def bus_factor(op, n):
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Gloo worker (one process per rank)

def gloo_worker(args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group(args.torch_backend)
    n, r = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cpu")
    if args.device == "cuda":  # GPU rank % count: Gloo's ranks may share one, NCCL's may not
        dev = torch.device("cuda", r % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    empty = lambda numel: torch.empty(numel, device=dev)
    meta = dev if args.torch_backend == "nccl" else torch.device("cpu")  # NCCL: CUDA tensors only
    root = 0
    rows = []
    for nbytes in sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.step_factor, args.op):
        count = nbytes // 4
        if args.op in PER_RANK_BLOCKS:
            count = count // n * n
        block = count // n

        def inp(rank, numel):
            # Drawn per rank (as tdist-bench's apps/bench/check.h): each value depends on the rank
            # and the position, so a misplaced block counts as wrong; 1..5 keeps sums exact.
            gen = torch.Generator().manual_seed(0x7D15 + rank)
            return torch.randint(1, 6, (numel,), generator=gen).float().to(dev)

        a = b = None
        if args.op in ("allreduce", "broadcast", "reduce"):
            a = empty(count)
        elif args.op == "allgather":  # in place, as tdist-bench and the Open MPI anchor
            b = empty(block * n)
            a = b.narrow(0, r * block, block)
        elif args.op == "gather":
            a, b = empty(block), empty(block * n)
        elif args.op in ("reduce_scatter", "scatter"):
            a, b = empty(block * n), empty(block)
        elif args.op == "alltoall":
            a, b = empty(block * n), empty(block * n)

        def fill():
            if b is not None:  # first: an allgather's input is part of it
                b.zero_()
            if a is not None:
                a.copy_(inp(r, a.numel()))

        def run():
            op = args.op
            if op == "allreduce":
                dist.all_reduce(a)
            elif op == "broadcast":
                dist.broadcast(a, src=root)
            elif op == "reduce":
                dist.reduce(a, dst=root)
            elif op == "allgather":
                dist.all_gather_into_tensor(b, a)
            elif op == "gather":
                dist.gather(a, gather_list=list(b.chunk(n)) if r == root else None, dst=root)
            elif op == "scatter":
                dist.scatter(b, scatter_list=list(a.chunk(n)) if r == root else None, src=root)
            elif op == "reduce_scatter":
                dist.reduce_scatter_tensor(b, a)
            elif op == "alltoall":
                dist.all_to_all_single(b, a)
            else:
                dist.barrier()

        def wrong():
            op = args.op
            # c10d leaves a non-root rank's reduce buffer undefined (Gloo overwrites it).
            if op == "barrier" or (op in ("gather", "reduce") and r != root):
                return 0
            red = lambda numel: sum(inp(k, numel) for k in range(n))
            if op == "allreduce" or (op == "reduce" and r == root):
                got, want = a, red(a.numel())
            elif op in ("reduce", "broadcast"):
                got, want = a, inp(root if op == "broadcast" else r, a.numel())
            elif op in ("allgather", "gather"):
                got, want = b, torch.cat([inp(k, block) for k in range(n)])
            elif op == "scatter":
                got, want = b, inp(root, block * n)[r * block:(r + 1) * block]
            elif op == "reduce_scatter":
                got, want = b, red(block * n)[r * block:(r + 1) * block]
            else:
                got, want = b, torch.cat([inp(k, block * n)[r * block:(r + 1) * block] for k in range(n)])
            return int(((got - want).abs() > 1e-3 * (want.abs() + 1)).sum())

        fill()
        for _ in range(args.warmup):
            run()
        sync()
        times = torch.empty(args.iters, dtype=torch.float64)
        for i in range(args.iters):
            t0 = time.perf_counter()
            run()
            sync()
            times[i] = (time.perf_counter() - t0) * 1e6
        times = times.to(meta)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        med = float(times.median())
        fill()
        run()
        w = torch.tensor([wrong()], device=meta)
        dist.all_reduce(w)
        real = count * 4
        algbw = real / med / 1e3 if med > 0 else 0.0
        rows.append({"bytes": real, "time_us": med, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * bus_factor(args.op, n), "wrong": int(w)})
    if r == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"op": args.op, "backend": args.torch_backend, "world_size": n, "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Driver

def run_gloo(args, op, nproc, out_json):
    port = free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--op", op,
               "--device", args.device, "--torch-backend", args.torch_backend,
               "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes,
               "--step-factor", str(args.step_factor), "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--json", out_json]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    rc = [p.wait(timeout=args.timeout) for p in procs]
    if any(rc):
        raise SystemExit(f"{args.torch_backend} {op} with {nproc} ranks failed: exit codes {rc}")
    with open(out_json) as f:
        return json.load(f)


def run_tdist(args, op, nproc, out_json):
    cmd = [os.path.join(args.build, "apps", "tdist-run"), "--nproc-per-node", str(nproc),
           "--standalone", os.path.join(args.build, "apps", "bench", "tdist-bench"), "collective",
           "--op", op, "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes,
           "--step-factor", str(args.step_factor), "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--json", out_json]
    if args.device == "cuda":
        cmd += ["--device", "cuda", "--group-backend", args.group_backend]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=args.timeout)
    with open(out_json) as f:
        return json.load(f)


def best_of(results):
    """Per size, the row with the smallest time over the rounds."""
    best = {}
    for res in results:
        for row in res["rows"]:
            cur = best.get(row["bytes"])
            if cur is None or row["time_us"] < cur["time_us"]:
                best[row["bytes"]] = row
    return [best[k] for k in sorted(best)]


def fmt_bytes(b):
    for unit, div in (("G", 1024 ** 3), ("M", 1024 ** 2), ("K", 1024)):
        if b >= div and b % div == 0:
            return f"{b // div}{unit}"
    return str(b)


def verdict(args, op, nbytes, time_ratio, bus_ratio):
    """The issue's target for this row: (text, met)."""
    if args.device == "cuda" and args.torch_backend == "nccl":  # tdist's NCCL backend
        return "busbw >= 0.95x", bus_ratio >= 0.95
    if args.device == "cuda":  # tdist's ring staging CUDA tensors against Gloo on them
        return "busbw >= 2x", bus_ratio >= 2.0
    if op == "allreduce" and 1 << 20 <= nbytes <= 64 << 20:
        return "busbw >= 2x", bus_ratio >= 2.0
    if op == "allreduce" and nbytes <= 4096:
        return "time <= 1/4", time_ratio <= 0.25
    return "time <= 1x", time_ratio <= 1.0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--op", default="allreduce", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", help=argparse.SUPPRESS)
    p.add_argument("--build", default="build", help="tdist build directory")
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--step-factor", type=float, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="alternating runs per backend (best kept)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--markdown", default="", help="also write the tables as markdown to this file")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the tensors live")
    p.add_argument("--torch-backend", default="gloo", choices=["gloo", "nccl"],
                   help="torch.distributed's backend, the anchor (nccl: CUDA tensors only)")
    p.add_argument("--group-backend", default="auto",
                   help="tdist-bench's --group-backend with --device cuda (ring: ranks share GPUs)")
    args = p.parse_args()
    if args.torch_backend == "nccl" and args.device != "cuda":
        p.error("--torch-backend nccl needs --device cuda")
    if args.worker:
        gloo_worker(args)
        return

    md = []
    misses = []
    tmp_dir = tempfile.TemporaryDirectory(prefix="tdist-bench-")  # removed when main returns
    tmp = tmp_dir.name
    for nproc in args.nproc:
        for op in args.ops:
            g_runs, t_runs = [], []
            for rnd in range(args.rounds):
                g_runs.append(run_gloo(args, op, nproc, os.path.join(tmp, f"g-{op}-{nproc}-{rnd}.json")))
                t_runs.append(run_tdist(args, op, nproc, os.path.join(tmp, f"t-{op}-{nproc}-{rnd}.json")))
            g, t = best_of(g_runs), best_of(t_runs)
            a = args.torch_backend
            title = (f"{op}, world size {nproc}, float32, {args.device} tensors "
                     f"(best of {args.rounds} alternating rounds)")
            header = (f"{'size':>6} | {a + ' us':>10} | {'tdist us':>10} | {a + ' busbw':>10} | "
                      f"{'tdist busbw':>11} | {'time ratio':>10} | {'busbw ratio':>11} | wrong | target")
            print(f"\n## {title}\n{header}")
            md += [f"\n### {title}\n",
                   f"| size | {a} time (us) | tdist time (us) | {a} busbw (GB/s) | tdist busbw (GB/s) "
                   f"| tdist/{a} time | tdist/{a} busbw | #wrong ({a}/tdist) | target |",
                   "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for gr, tr in zip(g, t):
                time_ratio = tr["time_us"] / gr["time_us"] if gr["time_us"] > 0 else float("inf")
                # busbw ratio = inverse time ratio (same bytes); from the times, so world 1 has one
                bus_ratio = gr["time_us"] / tr["time_us"] if tr["time_us"] > 0 else float("nan")
                target, met = verdict(args, op, tr["bytes"], time_ratio, bus_ratio)
                mark = "met" if met else "MISSED"
                if not met:
                    misses.append(f"{op} n={nproc} {fmt_bytes(tr['bytes'])}: {target} "
                                  f"(time ratio {time_ratio:.2f}, busbw ratio {bus_ratio:.2f})")
                print(f"{fmt_bytes(tr['bytes']):>6} | {gr['time_us']:>10.1f} | {tr['time_us']:>10.1f} | "
                      f"{gr['busbw_gbs']:>10.3f} | {tr['busbw_gbs']:>11.3f} | {time_ratio:>10.2f} | "
                      f"{bus_ratio:>11.2f} | {gr['wrong']}/{tr['wrong']} | {target}: {mark}")
                md.append(f"| {fmt_bytes(tr['bytes'])} | {gr['time_us']:.1f} | {tr['time_us']:.1f} | "
                          f"{gr['busbw_gbs']:.3f} | {tr['busbw_gbs']:.3f} | {time_ratio:.2f} | "
                          f"{bus_ratio:.2f} | {gr['wrong']}/{tr['wrong']} | {target}: {mark} |")
            sys.stdout.flush()
    print("\nTargets missed:" if misses else "\nAll targets met.")
    for m in misses:
        print("  " + m)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(md) + "\n")
            f.write("\n**Targets missed:** " + ("; ".join(misses) if misses else "none") + "\n")


if __name__ == "__main__":
    main()
