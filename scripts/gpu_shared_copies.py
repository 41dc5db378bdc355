#!/usr/bin/env python3
"""Two processes on one GPU: the time of one host-to-device copy from pinned memory when both
processes copy at the same moment (after a barrier) against one process copying alone.

Why the ring's small allreduces on CUDA tensors are slow when ranks share a GPU (docs/perf.md,
"On a GPU"): every rank copies its result back at the same moment, and small copies of two
processes' CUDA contexts wait for each other on the GPU.

    python3 scripts/gpu_shared_copies.py [--sizes 4096 65536] [--iters 300]

Needs a GPU; prints the median microseconds per copy for each size, alone and together.
"""
import argparse
import time

import torch
import torch.multiprocessing as mp


def worker(rank, barrier, queue, nbytes, together, iters):
    torch.cuda.set_device(0)
    dev = torch.ones(nbytes // 4, device="cuda")
    host = torch.empty(nbytes // 4, pin_memory=True)
    for _ in range(20):
        dev.copy_(host)
    times = []
    for _ in range(iters):
        barrier.wait()
        if rank == 0 or together:
            t0 = time.perf_counter()
            dev.copy_(host)  # blocking: returns when the copy is done
            times.append(time.perf_counter() - t0)
    if rank == 0:
        times.sort()
        queue.put(times[len(times) // 2] * 1e6)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536], help="bytes per copy")
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no GPU visible")
    ctx = mp.get_context("spawn")
    for nbytes in args.sizes:
        for together in (False, True):
            barrier, queue = ctx.Barrier(2), ctx.SimpleQueue()
            procs = [ctx.Process(target=worker, args=(r, barrier, queue, nbytes, together, args.iters))
                     for r in range(2)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            print(f"{nbytes} bytes host-to-device, {'both processes' if together else 'one process'}: "
                  f"median {queue.get():.1f} us", flush=True)


if __name__ == "__main__":
    main()
