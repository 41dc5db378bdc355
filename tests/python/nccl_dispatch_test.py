"""init_process_group("cpu:tdist,cuda:nccl"): CPU tensors go through tdist, CUDA tensors through
NCCL, in one group (the tutorial's last step). Needs a GPU: without one it prints why and exits
77, which ctest reports as skipped.

  nccl_dispatch_test.py    runs min(2, number of GPUs) ranks, one GPU each
"""

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import check, check_equal  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    return p.parse_args()


def child(rank, world_size):
    import torch
    import torch.distributed as dist
    import tdist_c10d
    torch.set_num_threads(1)
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:tdist,cuda:nccl", init_method="env://",
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.group.WORLD
    cpu_backend = pg._get_backend(torch.device("cpu"))
    cuda_backend = pg._get_backend(torch.device("cuda"))
    check(isinstance(cpu_backend, tdist_c10d.TdistBackend), "CPU backend", type(cpu_backend))
    check(isinstance(cuda_backend, dist.ProcessGroupNCCL), "CUDA backend", type(cuda_backend))
    total = sum(range(1, world_size + 1))

    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)  # tdist
    check_equal(x, torch.full((1000,), float(total)), "CPU all_reduce through tdist")

    y = torch.full((1000,), float(rank + 1), device="cuda")
    dist.all_reduce(y)  # NCCL
    check_equal(y.cpu(), torch.full((1000,), float(total)), "CUDA all_reduce through NCCL")

    outs = [torch.zeros(3, device="cuda") for _ in range(world_size)]
    dist.all_gather(outs, torch.full((3,), float(rank), device="cuda"))
    outs_cpu = [torch.zeros(3) for _ in range(world_size)]
    dist.all_gather(outs_cpu, torch.full((3,), float(rank)))
    for r in range(world_size):
        check_equal(outs[r].cpu(), torch.full((3,), float(r)), "CUDA all_gather slot %d" % r)
        check_equal(outs_cpu[r], torch.full((3,), float(r)), "CPU all_gather slot %d" % r)
    dist.barrier()
    dist.destroy_process_group()
    print("rank %d: CPU through tdist and CUDA through NCCL checked (world size %d)" % (
        rank, world_size))


def main():
    args = parse()
    if args.child:
        harness.child_main(child)
    harness.skip_without_gpus(1, "the cpu:tdist,cuda:nccl case")
    import torch
    world_size = min(2, torch.cuda.device_count())
    harness.run_ranks(os.path.abspath(__file__), world_size, [], timeout=120,
                      what="cpu:tdist,cuda:nccl on %d rank(s)" % world_size)


if __name__ == "__main__":
    main()
