"""init_process_group("tdist") on CUDA tensors, both ways tdist serves them: through tdist's NCCL
backend (the default where a GPU is visible; one rank per GPU) and staged through host memory
(TDIST_CUDA_BACKEND=ring; two ranks sharing GPU 0, which NCCL refuses). Collectives against the
CPU result, and PyTorch's DDP on a CUDA model over "tdist" against the same model trained on one
process; and init_process_group("tdist", device_id=...) (the group bound to the rank's GPU, a
subgroup and a barrier on it). Needs a GPU: without one it prints why and exits 77, which ctest
reports as skipped.

  cuda_staging_test.py
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


def make_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def child(rank, world_size):
    import torch
    import torch.distributed as dist
    import tdist_c10d
    torch.set_num_threads(1)
    if os.environ.get("TDIST_CUDA_BACKEND") != "ring":
        torch.cuda.set_device(rank)  # NCCL: one GPU per rank
    bind = os.environ.get("TDIST_TEST_DEVICE_ID") == "1"
    dist.init_process_group("tdist", init_method="env://", timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", rank) if bind else None)
    if bind:
        bound = dist.group.WORLD.bound_device_id
        check(bound == torch.device("cuda", rank), "bound device", bound)
        sub = dist.new_group(list(range(world_size)))
        z = torch.full((64,), float(rank + 1), device="cuda")
        dist.all_reduce(z, group=sub)
        check_equal(z.cpu(), torch.full((64,), float(sum(range(1, world_size + 1)))),
                    "all_reduce on a subgroup of a bound group")
        dist.barrier()  # on the bound device
        dist.destroy_process_group()
        print("rank %d: device_id=cuda:%d bound, subgroup and barrier checked (world size %d)" % (
            rank, rank, world_size))
        return
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    check(isinstance(backend, tdist_c10d.TdistBackend), "CUDA backend", type(backend))
    total = sum(range(1, world_size + 1))

    y = torch.full((1000,), float(rank + 1), device="cuda")
    dist.all_reduce(y)
    check(y.is_cuda, "all_reduce result left the GPU")
    check_equal(y.cpu(), torch.full((1000,), float(total)), "CUDA all_reduce through tdist")
    outs = [torch.zeros(3, device="cuda") for _ in range(world_size)]
    dist.all_gather(outs, torch.full((3,), float(rank), device="cuda"))
    for r in range(world_size):
        check_equal(outs[r].cpu(), torch.full((3,), float(r)), "CUDA all_gather slot %d" % r)
    b = torch.full((5,), float(rank), device="cuda")
    dist.broadcast(b, src=world_size - 1)
    check_equal(b.cpu(), torch.full((5,), float(world_size - 1)), "CUDA broadcast")
    fut = dist.all_reduce(torch.ones(4, device="cuda"), async_op=True).get_future()
    got = fut.then(lambda f: f.value()[0] * 2).wait()
    check_equal(got.cpu(), torch.full((4,), 2.0 * world_size), "get_future().then() on CUDA")

    # PyTorch's DDP on a CUDA model over tdist, against one process training on every rank's data.
    model = torch.nn.parallel.DistributedDataParallel(make_model(torch).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))
            for _ in range(world_size * 3)]
    for step in range(3):
        x, t = data[step * world_size + rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.cuda()), t.cuda()).backward()
        opt.step()
    ref = make_model(torch)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        ref_opt.zero_grad()
        xs = torch.cat([data[step * world_size + r][0] for r in range(world_size)])
        ts = torch.cat([data[step * world_size + r][1] for r in range(world_size)])
        torch.nn.functional.mse_loss(ref(xs), ts).backward()
        ref_opt.step()
    for p, q in zip(model.module.parameters(), ref.parameters()):
        check(torch.allclose(p.detach().cpu(), q.detach(), atol=1e-5), "DDP on CUDA over tdist "
              "differs from one process", (p.detach().cpu() - q.detach()).abs().max())
    dist.barrier()
    dist.destroy_process_group()
    print("rank %d: CUDA collectives and DDP through tdist checked (world size %d)" % (
        rank, world_size))


def main():
    args = parse()
    if args.child:
        harness.child_main(child)
    harness.skip_without_gpus(1, "CUDA tensors through the tdist backend")
    import torch
    nccl = min(2, torch.cuda.device_count())
    harness.run_ranks(os.path.abspath(__file__), nccl, [], timeout=120,
                      what="tdist on CUDA tensors through its NCCL backend, %d rank(s)" % nccl)
    harness.run_ranks(os.path.abspath(__file__), nccl, [], env={"TDIST_TEST_DEVICE_ID": "1"},
                      timeout=120, what="init_process_group(device_id=...), %d rank(s)" % nccl)
    harness.run_ranks(os.path.abspath(__file__), 2, [], env={"TDIST_CUDA_BACKEND": "ring"},
                      timeout=120, what="tdist on CUDA tensors staged, 2 ranks on one GPU")


if __name__ == "__main__":
    main()
