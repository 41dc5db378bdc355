#!/usr/bin/env python3
"""torch.distributed.rpc (TensorPipe) side of tdist's RPC benchmark.

Two worker processes on this machine; worker 0 measures, worker 1 serves:
  rtt_us         median round trip of a small rpc_sync (two ints in, one int out)
  async_calls_s  small rpc_async calls per second with --outstanding calls in flight
  echo_gbps      16 MiB float32 tensor echoed through rpc_sync, GB/s counting both directions

Prints one JSON object on stdout (and writes it to --json FILE when given). tdist-bench rpc runs
this script beside its own measurement and prints the ratios (see docs/perf.md).
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def add(a, b):
    return a + b


def echo(t):
    return t


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args):
    peer = "worker1"
    # Round trip.
    for _ in range(args.warmup):
        rpc.rpc_sync(peer, add, args=(1, 2))
    samples = []
    for _ in range(args.rtt_iters):
        t0 = time.perf_counter()
        rpc.rpc_sync(peer, add, args=(1, 2))
        samples.append(time.perf_counter() - t0)
    rtt_us = statistics.median(samples) * 1e6

    # Async rate: keep `outstanding` calls in flight.
    def async_round(n):
        t0 = time.perf_counter()
        done = 0
        while done < n:
            batch = min(args.outstanding, n - done)
            futs = [rpc.rpc_async(peer, add, args=(i, 1)) for i in range(batch)]
            for f in futs:
                f.wait()
            done += batch
        return n / (time.perf_counter() - t0)

    async_round(min(args.async_calls, 2000))
    rates = [async_round(args.async_calls) for _ in range(args.repeats)]
    async_rate = statistics.median(rates)

    # 16 MiB echo.
    t = torch.rand(args.echo_bytes // 4)
    for _ in range(3):
        rpc.rpc_sync(peer, echo, args=(t,))
    samples = []
    for _ in range(args.echo_iters):
        t0 = time.perf_counter()
        r = rpc.rpc_sync(peer, echo, args=(t,))
        samples.append(time.perf_counter() - t0)
    assert r.numel() == t.numel()
    echo_gbps = 2 * args.echo_bytes / statistics.median(samples) / 1e9
    return {"backend": "torch.distributed.rpc (TensorPipe)", "torch": torch.__version__,
            "rtt_us": rtt_us, "async_calls_s": async_rate, "outstanding": args.outstanding,
            "echo_bytes": args.echo_bytes, "echo_gbps": echo_gbps}


def worker(rank, args, port, queue):
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=args.threads, rpc_timeout=120)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        queue.put(measure(args))
    rpc.shutdown()


def run_pair(worker, args):
    """Runs worker(rank, args, port, queue) as 2 spawned processes, prints the JSON result the
    workers put on the queue (and writes it to args.json when given); exits 1 if one fails."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(2)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(600)
        if pr.exitcode != 0:
            print(f"worker exited with {pr.exitcode}", file=sys.stderr)
            sys.exit(1)
    result = queue.get()
    text = json.dumps(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rtt-iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--async-calls", type=int, default=20000)
    p.add_argument("--outstanding", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--echo-bytes", type=int, default=16 << 20)
    p.add_argument("--echo-iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=4, help="num_worker_threads per worker")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()
    run_pair(worker, args)


if __name__ == "__main__":
    main()
