"""What a gloo user does, unchanged with "tdist".

  usage_test.py --scenario init|debug|monitored|checkpoint|torchrun [--world-size N]

init        init_process_group with file:// and with an explicit TCPStore; new_group,
            new_subgroups, batch_isend_irecv, every object collective
            (all_gather_object, broadcast_object_list, scatter_object_list, gather_object);
            destroy_process_group and a second init_process_group in the same process.
debug       TORCH_DISTRIBUTED_DEBUG=DETAIL: PyTorch's wrapper checks each collective across
            ranks; matching calls work, a shape mismatch is reported as such.
monitored   the group's monitored_barrier: everybody passes, with and without wait_all_ranks;
            when only rank 0 comes, wait_all_ranks names every other rank.
checkpoint  torch.distributed.checkpoint saves a model whose parameters are DTensors sharded over
            the ranks, and loads it into a fresh model with the same values.
torchrun    torchrun (torch.distributed.run, torch.distributed.elastic) starts the workers, which
            use env:// with "tdist".
Each rank is a real process; exit 0 when every rank passes.
"""

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import check, check_equal, expect_raises  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--scenario", required=True,
                   choices=sorted(SCENARIOS))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dir", help="(internal) a directory every rank shares")
    return p.parse_args()


def collectives(torch, dist, rank, world_size, what):
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)
    check_equal(x, torch.full((5,), float(world_size * (world_size + 1) // 2)), what + " all_reduce")


def scenario_init(torch, dist, rank, world_size, shared):
    # file://, twice in one process (destroy, then init again with another file).
    for round_ in range(2):
        dist.init_process_group("tdist", init_method="file://%s/init%d" % (shared, round_),
                                rank=rank, world_size=world_size, timeout=TIMEOUT)
        collectives(torch, dist, rank, world_size, "file:// round %d" % round_)
        dist.destroy_process_group()
    # An explicit store.
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world_size, rank == 0,
                          timeout=TIMEOUT)
    dist.init_process_group("tdist", store=store, rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    collectives(torch, dist, rank, world_size, "store=")
    check(dist.get_backend() == "tdist", "backend is", dist.get_backend())

    # new_group and new_subgroups.
    sub = dist.new_group(ranks=list(range(0, world_size, 2)))
    if rank % 2 == 0:
        y = torch.ones(3)
        dist.all_reduce(y, group=sub)
        check_equal(y, torch.full((3,), float((world_size + 1) // 2)), "new_group all_reduce")
    mine, _ = dist.new_subgroups(group_size=1)
    z = torch.full((2,), float(rank))
    dist.all_reduce(z, group=mine)
    check_equal(z, torch.full((2,), float(rank)), "new_subgroups (size 1) all_reduce")

    # batch_isend_irecv around the ring.
    send = torch.full((4,), float(rank))
    recv = torch.empty(4)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world_size),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world_size)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check_equal(recv, torch.full((4,), float((rank - 1) % world_size)), "batch_isend_irecv")

    # Object collectives.
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {"rank": rank, "text": "r%d" % rank})
    check(gathered == [{"rank": r, "text": "r%d" % r} for r in range(world_size)],
          "all_gather_object:", gathered)
    objs = [("from", rank), [1, 2, 3]] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    check(objs == [("from", 0), [1, 2, 3]], "broadcast_object_list:", objs)
    out = [None]
    dist.scatter_object_list(out, ["to %d" % r for r in range(world_size)] if rank == 0 else None,
                             src=0)
    check(out == ["to %d" % rank], "scatter_object_list:", out)
    got = [None] * world_size if rank == world_size - 1 else None
    dist.gather_object({"r": rank}, got, dst=world_size - 1)
    if rank == world_size - 1:
        check(got == [{"r": r} for r in range(world_size)], "gather_object:", got)
    dist.destroy_process_group()


def scenario_debug(torch, dist, rank, world_size, shared):
    check(dist.get_debug_level() == dist.DebugLevel.DETAIL, "TORCH_DISTRIBUTED_DEBUG not DETAIL")
    dist.init_process_group("tdist", init_method="env://", timeout=TIMEOUT)
    collectives(torch, dist, rank, world_size, "DETAIL")
    bad = torch.ones(4 + rank)  # every rank a different shape
    expect_raises(lambda: dist.all_reduce(bad), RuntimeError, "Detected mismatch")
    dist.destroy_process_group()


def scenario_monitored(torch, dist, rank, world_size, shared):
    dist.init_process_group("tdist", init_method="env://", timeout=TIMEOUT)
    pg = dist.group.WORLD
    pg.monitored_barrier(datetime.timedelta(seconds=20))                      # all arrive
    pg.monitored_barrier(datetime.timedelta(seconds=20), wait_all_ranks=True)
    # Only rank 0 comes: it names every other rank, in order.
    if rank == 0:
        late = ", ".join(str(r) for r in range(1, world_size))
        expect_raises(lambda: pg.monitored_barrier(datetime.timedelta(seconds=1),
                                                   wait_all_ranks=True),
                      RuntimeError, "Ranks %s failed to pass monitoredBarrier" % late)
    dist.destroy_process_group()


def scenario_checkpoint(torch, dist, rank, world_size, shared):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("tdist", init_method="env://", timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (world_size,))

    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
        return {k: distribute_tensor(v.detach(), mesh, [Shard(0)])
                for k, v in m.state_dict().items()}

    saved = model(1)
    for v in saved.values():
        check(v.to_local().shape[0] < v.shape[0], "not sharded:", v.shape, v.to_local().shape)
    dcp.save(saved, checkpoint_id=os.path.join(shared, "ckpt"))
    loaded = model(2)
    check(any(not torch.equal(loaded[k].full_tensor(), saved[k].full_tensor()) for k in saved),
          "the fresh model should start different")
    dcp.load(loaded, checkpoint_id=os.path.join(shared, "ckpt"))
    for k in saved:
        check_equal(loaded[k].to_local(), saved[k].to_local(), "loaded shard of " + k)
        check_equal(loaded[k].full_tensor(), saved[k].full_tensor(), "loaded " + k)
    dist.destroy_process_group()


def scenario_torchrun_worker(torch, dist, rank, world_size, shared):
    check("TORCHELASTIC_RUN_ID" in os.environ, "not started by torchrun")
    dist.init_process_group("tdist", timeout=TIMEOUT)  # env:// by default
    collectives(torch, dist, rank, world_size, "torchrun")
    print("rank %d of %d: torchrun worker passed" % (rank, world_size))
    dist.destroy_process_group()


SCENARIOS = {"init": scenario_init, "debug": scenario_debug, "monitored": scenario_monitored,
             "checkpoint": scenario_checkpoint,
             "torchrun": scenario_torchrun_worker}


def child(args):
    def body(rank, world_size):
        import torch
        import torch.distributed as dist
        import tdist_c10d  # noqa: F401 - registers "tdist"
        torch.set_num_threads(1)
        SCENARIOS[args.scenario](torch, dist, rank, world_size, args.dir)
    harness.child_main(body)


def run_torchrun(args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(args.world_size), os.path.abspath(__file__),
           "--child", "--scenario", "torchrun"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=150)
    # Workers share torchrun's stdout, so their lines may run together.
    passed = re.findall(r"rank \d+ of \d+: torchrun worker passed", out.stdout)
    if out.returncode != 0 or len(passed) != args.world_size:
        raise SystemExit("FAILED: torchrun exited %d, %d of %d workers passed\n%s" % (
            out.returncode, len(passed), args.world_size, out.stdout))
    print("\n".join(passed))
    print("PASSED: torchrun with %d workers" % args.world_size)


def main():
    args = parse()
    if args.child:
        child(args)
    if args.scenario == "torchrun":
        run_torchrun(args)
        return
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if args.scenario == "debug" else {}
    with tempfile.TemporaryDirectory(prefix="tdist-usage.") as shared:
        harness.run_ranks(os.path.abspath(__file__), args.world_size,
                          ["--scenario", args.scenario, "--dir", shared], env=env, timeout=150)


if __name__ == "__main__":
    main()
