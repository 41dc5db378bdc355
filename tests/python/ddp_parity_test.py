"""PyTorch's own DistributedDataParallel over the tdist backend matches the same run over Gloo.

  ddp_parity_test.py --world-size N

Each rank trains the same MLP twice for 20 steps with SGD + momentum on rank-specific data: once
through DDP over the default group (tdist), once over a Gloo group of the same ranks. Parameters
start different on every rank (DDP must broadcast rank 0's), buckets are small so that several
allreduces overlap backward, and the result must match Gloo's to within 1e-5 and be identical on
every rank.
"""

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import check  # noqa: E402

STEPS = 20
TOLERANCE = 1e-5


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--world-size", type=int, default=2)
    return p.parse_args()


def train(torch, dist, group, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(1234 + rank)  # different on every rank: DDP broadcasts rank 0's
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 4))
    initial = [p.detach().clone() for p in model.parameters()]
    # 16 KiB buckets: the 64x64 layer's gradient fills one alone, so there are several buckets.
    ddp = DDP(model, process_group=group, bucket_cap_mb=1.0 / 64)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
    return initial, [p.detach().clone() for p in model.parameters()]


def child(rank, world_size):
    import torch
    import torch.distributed as dist
    import tdist_c10d  # noqa: F401 - registers "tdist"
    torch.set_num_threads(1)
    dist.init_process_group("tdist", init_method="env://",
                            timeout=datetime.timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")

    initial, over_tdist = train(torch, dist, None, rank)
    _, over_gloo = train(torch, dist, gloo, rank)

    worst = 0.0
    for i, (a, b) in enumerate(zip(over_tdist, over_gloo)):
        diff = (a - b).abs().max().item()
        worst = max(worst, diff)
        check(diff <= TOLERANCE, "parameter %d: tdist and gloo differ by %g" % (i, diff))
    print("rank %d: largest difference tdist vs gloo after %d steps: %.3g" % (rank, STEPS, worst))

    # Training happened, and every rank holds the same parameters (gathered over gloo).
    moved = max((a - b).abs().max().item() for a, b in zip(over_tdist, initial))
    if rank == 0:
        check(moved > 1e-3, "the parameters did not move in training (%g)" % moved)
    flat = torch.cat([p.reshape(-1) for p in over_tdist])
    everyone = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat, group=gloo)
    for r, other in enumerate(everyone):
        check(torch.equal(other, flat), "rank %d's parameters differ from rank %d's" % (r, rank))
    dist.destroy_process_group()


def main():
    args = parse()
    if args.child:
        harness.child_main(child)
    harness.run_ranks(os.path.abspath(__file__), args.world_size,
                      ["--world-size", args.world_size], timeout=150)


if __name__ == "__main__":
    main()
