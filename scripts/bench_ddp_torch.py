#!/usr/bin/env python3
"""PyTorch's Python DDP over gloo on the model tdist-bench ddp trains: the anchor it compares to.
With --device cuda: over NCCL on GPU LOCAL rank (one GPU per rank), each step ending with a
device synchronize as in tdist-bench ddp.

MLP 784-1024-1024-1024-10 (ReLU), cross-entropy on synthetic data, SGD, `--batch` samples per
rank, one thread per rank by default. Prints one line that tdist-bench ddp parses:

    samples_per_s=<float> iter_ms=<median ms per iteration> world_size=<n>

Run alone: python3 scripts/bench_ddp_torch.py --world-size 2 --iters 200
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def make_model(hidden, layers):
    mods = [nn.Linear(784, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    mods.append(nn.Linear(hidden, 10))
    return nn.Sequential(*mods)


def worker(rank, args, port, queue):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    cuda = args.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world_size)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        make_model(args.hidden, args.layers).to(dev), device_ids=[rank] if cuda else None,
        bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(args.batch, 784, generator=gen).to(dev) for _ in range(4)]
    ys = [torch.randint(0, 10, (args.batch,), generator=gen).to(dev) for _ in range(4)]
    loss_fn = nn.CrossEntropyLoss()

    def step(i):
        opt.zero_grad()
        loss_fn(model(xs[i % 4]), ys[i % 4]).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    times = []
    start = time.perf_counter()
    for i in range(args.iters):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    total = time.perf_counter() - start
    if rank == 0:
        queue.put((args.world_size * args.batch * args.iters / total,
                   statistics.median(times) * 1e3))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="samples per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3, help="hidden layers")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args, args.port or free_port(), queue),
                       nprocs=args.world_size, join=True, start_method="spawn")
    samples, iter_ms = queue.get()
    print(f"samples_per_s={samples:.1f} iter_ms={iter_ms:.3f} world_size={args.world_size}",
          flush=True)


if __name__ == "__main__":
    main()
