#!/usr/bin/env python3
"""torch.distributed.autograd + DistributedOptimizer side of `tdist-bench rpc --autograd`.

Two worker processes on this machine (TensorPipe RPC); worker0 trains, worker1 holds the remote
part. Per-iteration time (median, ms) of:
  seed_ms   demo 1's shape: nn.Linear(2, 1, bias=False) on worker1, 8 samples on worker0,
            MSE loss, DistributedOptimizer(SGD, lr=0.05)
  split_ms  an MLP 784-1024-1024-1024-10 split in two: 784->1024->1024 (ReLU) on worker1,
            1024->1024->10 on worker0, batch 64, cross entropy, DistributedOptimizer(SGD, lr=0.01)
Each iteration: a dist_autograd context, forward over RPC, loss, dist_autograd.backward,
opt.step. Prints one JSON object on stdout (and writes it to --json FILE when given).
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rpc_torch import run_pair  # noqa: E402  (same spawn-two-workers driver)


class SeedNet(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(2, 1, bias=False)

    def forward(self, x):
        return self.fc(x)


class FrontMlp(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.seq = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU())

    def forward(self, x):
        return self.seq(x)


def parameter_rrefs(module_rref):
    return [RRef(p) for p in module_rref.local_value().parameters()]


def time_iterations(warmup, iters, step):
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def measure(args):
    result = {"backend": "torch.distributed.autograd (TensorPipe)", "torch": torch.__version__}

    net = rpc.remote("worker1", SeedNet, args=(1,))
    opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("worker1", parameter_rrefs, args=(net,)),
                               lr=0.05)
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    last = {}

    def seed_step():
        with dist_autograd.context() as cid:
            loss = F.mse_loss(net.rpc_sync().forward(x), y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
            last["seed"] = loss.item()

    result["seed_ms"] = time_iterations(args.warmup, args.iters, seed_step)
    result["seed_final_loss"] = last["seed"]

    front = rpc.remote("worker1", FrontMlp, args=(2,))
    torch.manual_seed(3)
    back = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    params = rpc.rpc_sync("worker1", parameter_rrefs, args=(front,))
    params += [RRef(p) for p in back.parameters()]
    opt2 = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    xs, ys = torch.randn(64, 784), torch.randint(10, (64,))

    def split_step():
        with dist_autograd.context() as cid:
            h = front.rpc_sync().forward(xs)
            loss = F.cross_entropy(back(h), ys)
            dist_autograd.backward(cid, [loss])
            opt2.step(cid)
            last["split"] = loss.item()

    result["split_ms"] = time_iterations(args.split_warmup, args.split_iters, split_step)
    result["split_final_loss"] = last["split"]
    return result


def worker(rank, args, port, queue):
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=args.threads, rpc_timeout=120)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        queue.put(measure(args))
    rpc.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--split-iters", type=int, default=50)
    p.add_argument("--split-warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=4, help="num_worker_threads per worker")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()
    run_pair(worker, args)


if __name__ == "__main__":
    main()
