"""torch.distributed's collectives through the tdist backend, checked value by value.

  collectives_test.py --world-size N --init tcp|env --backend tdist|cpu:tdist|cpu:tdist,cuda:gloo

runs N ranks; each initialises the default group, runs every collective of the c10d table on
CPU tensors (sync and async_op=True), a subgroup made with new_group(backend="tdist"), the
coalescing manager, and the error paths (unsupported operations and bad arguments raise
RuntimeError naming the operation, and the group stays usable).
"""

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import check, check_close, check_equal, expect_raises  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--init", choices=["tcp", "env"], default="tcp")
    p.add_argument("--backend", default="tdist")
    p.add_argument("--functional", action="store_true",
                   help="also check the functional collectives (importing them takes seconds)")
    return p.parse_args()


def values(rank, numel, dtype):
    import torch
    return (torch.arange(numel) % 5 + rank + 1).to(dtype)


def check_allreduce(dist, torch, g, rank, n, ranks):
    """all_reduce with every ReduceOp and several dtypes; `ranks` are the group's global ranks."""
    for numel in (1, 7, 1000):
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16,
                      torch.bfloat16):
            inputs = [values(r, numel, dtype) for r in ranks]
            ops = [(dist.ReduceOp.SUM, lambda ts: sum(t.double() for t in ts)),
                   (dist.ReduceOp.PRODUCT, lambda ts: torch.stack([t.double() for t in ts]).prod(0)),
                   (dist.ReduceOp.MIN, lambda ts: torch.stack([t.double() for t in ts]).min(0).values),
                   (dist.ReduceOp.MAX, lambda ts: torch.stack([t.double() for t in ts]).max(0).values)]
            if dtype.is_floating_point:
                ops.append((dist.ReduceOp.AVG, lambda ts: sum(t.double() for t in ts) / len(ts)))
            for op, reference in ops:
                t = values(rank, numel, dtype)
                dist.all_reduce(t, op=op, group=g)
                check(t.dtype == dtype, "all_reduce changed the dtype")
                tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
                check_close(t, reference(inputs), "all_reduce %s %s numel %d" % (op, dtype, numel),
                            rtol=tol, atol=tol)
    for op, fn in ((dist.ReduceOp.BAND, lambda a, b: a & b), (dist.ReduceOp.BOR, lambda a, b: a | b),
                   (dist.ReduceOp.BXOR, lambda a, b: a ^ b)):
        inputs = [torch.tensor([r + 1, 3 * r + 5, 0xF0 >> r, -1], dtype=torch.int64) for r in ranks]
        expected = inputs[0]
        for x in inputs[1:]:
            expected = fn(expected, x)
        t = inputs[ranks.index(rank)].clone()
        dist.all_reduce(t, op=op, group=g)
        check_equal(t, expected, "all_reduce %s" % op)
    flags = [torch.tensor([r == 0, True, False, r % 2 == 1]) for r in ranks]
    for op, fn in ((dist.ReduceOp.BAND, torch.logical_and), (dist.ReduceOp.BOR, torch.logical_or)):
        expected = flags[0]
        for f in flags[1:]:
            expected = fn(expected, f)
        t = flags[ranks.index(rank)].clone()
        dist.all_reduce(t, op=op, group=g)
        check_equal(t, expected, "all_reduce %s on bool" % op)
    # A non-contiguous tensor is reduced in place like any other.
    base = values(rank, 12, torch.float32).reshape(3, 4)
    t = base.t()
    check(not t.is_contiguous(), "test setup: expected a non-contiguous view")
    dist.all_reduce(t, group=g)
    expected = sum(values(r, 12, torch.float32).reshape(3, 4) for r in ranks).t()
    check_equal(t, expected, "all_reduce of a transposed view")
    check_equal(base, expected.t(), "all_reduce of a view writes through to its base")


def check_rooted(dist, torch, g, rank, n, ranks):
    """broadcast, reduce, gather, scatter from every root."""
    me = ranks.index(rank)
    for root in range(n):
        src = ranks[root]
        t = values(rank, 9, torch.float32) if me == root else torch.full((9,), -7.0)
        dist.broadcast(t, src=src, group=g)
        check_equal(t, values(src, 9, torch.float32), "broadcast from %d" % src)

        t = values(rank, 9, torch.int64)
        dist.reduce(t, dst=src, op=dist.ReduceOp.SUM, group=g)
        if me == root:
            check_equal(t, sum(values(r, 9, torch.int64) for r in ranks), "reduce to %d" % src)

        t = values(rank, 9, torch.float64)
        dist.reduce(t, dst=src, op=dist.ReduceOp.MAX, group=g)
        if me == root:
            check_equal(t, values(max(ranks), 9, torch.float64), "reduce MAX to %d" % src)

        gathered = [torch.zeros(5) for _ in range(n)] if me == root else None
        dist.gather(values(rank, 5, torch.float32), gather_list=gathered, dst=src, group=g)
        if me == root:
            for i, r in enumerate(ranks):
                check_equal(gathered[i], values(r, 5, torch.float32), "gather slot %d" % i)

        out = torch.zeros(4, dtype=torch.int32)
        chunks = ([torch.full((4,), 10 * i + root, dtype=torch.int32) for i in range(n)]
                  if me == root else None)
        dist.scatter(out, scatter_list=chunks, src=src, group=g)
        check_equal(out, torch.full((4,), 10 * me + root, dtype=torch.int32), "scatter from %d" % src)


def check_gathers_and_scatters(dist, torch, g, rank, n, ranks):
    me = ranks.index(rank)
    outs = [torch.zeros(2, 3) for _ in range(n)]
    dist.all_gather(outs, values(rank, 6, torch.float32).reshape(2, 3), group=g)
    for i, r in enumerate(ranks):
        check_equal(outs[i], values(r, 6, torch.float32).reshape(2, 3), "all_gather slot %d" % i)

    flat = torch.zeros(n * 6, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, values(rank, 6, torch.float64), group=g)
    check_equal(flat, torch.cat([values(r, 6, torch.float64) for r in ranks]),
                "all_gather_into_tensor")

    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "payload": "x" * (rank * 37)}, group=g)
    check(objs == [{"rank": r, "payload": "x" * (r * 37)} for r in ranks], "all_gather_object", objs)
    root = ranks[-1]
    objs = [("from", rank)] if rank == root else [None]
    dist.broadcast_object_list(objs, src=root, group=g)
    check(objs == [("from", root)], "broadcast_object_list", objs)
    got = [None] * n if rank == root else None
    dist.gather_object({"r": rank}, got, dst=root, group=g)
    if rank == root:
        check(got == [{"r": r} for r in ranks], "gather_object", got)
    got = [None]
    dist.scatter_object_list(got, [[i] * i for i in range(n)] if rank == root else None, src=root,
                             group=g)
    check(got == [[me] * me], "scatter_object_list", got)

    # reduce_scatter (list): rank r contributes chunk i = values(r) + i; member i gets the sum.
    inputs = [values(rank, 5, torch.float32) + i for i in range(n)]
    out = torch.zeros(5)
    dist.reduce_scatter(out, inputs, group=g)
    check_equal(out, sum(values(r, 5, torch.float32) for r in ranks) + n * me, "reduce_scatter")

    big = torch.cat([values(rank, 4, torch.int64) * (i + 1) for i in range(n)])
    out = torch.zeros(4, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, big, group=g)
    check_equal(out, sum(values(r, 4, torch.int64) for r in ranks) * (me + 1),
                "reduce_scatter_tensor")

    out = torch.zeros(4, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, big, op=dist.ReduceOp.MAX, group=g)
    check_equal(out, values(max(ranks), 4, torch.int64) * (me + 1), "reduce_scatter_tensor MAX")


def check_alltoall(dist, torch, g, rank, n, ranks):
    me = ranks.index(rank)
    # Equal splits: row block j goes to member j.
    inp = torch.cat([torch.full((2, 3), 100.0 * me + j) for j in range(n)])
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=g)
    check_equal(out, torch.cat([torch.full((2, 3), 100.0 * i + me) for i in range(n)]),
                "all_to_all_single (equal splits)")

    # Uneven splits: member i sends i + j + 1 rows of value 100 i + j to member j.
    in_splits = [me + j + 1 for j in range(n)]
    out_splits = [i + me + 1 for i in range(n)]
    inp = torch.cat([torch.full((me + j + 1, 2), 100 * me + j, dtype=torch.int64)
                     for j in range(n)])
    out = torch.full((sum(out_splits), 2), -1, dtype=torch.int64)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=g)
    expected = torch.cat([torch.full((i + me + 1, 2), 100 * i + me, dtype=torch.int64)
                          for i in range(n)])
    check_equal(out, expected, "all_to_all_single (split sizes)")

    inputs = [torch.full((j + 1,), float(10 * me + j)) for j in range(n)]
    outputs = [torch.zeros(me + 1) for _ in range(n)]
    dist.all_to_all(outputs, inputs, group=g)
    for i in range(n):
        check_equal(outputs[i], torch.full((me + 1,), float(10 * i + me)), "all_to_all from %d" % i)


def check_point_to_point(dist, torch, g, rank, n, ranks):
    me = ranks.index(rank)
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    # A ring of blocking send/recv: even members send first.
    got = torch.zeros(6)
    if me % 2 == 0:
        dist.send(values(rank, 6, torch.float32), dst=nxt, group=g)
        dist.recv(got, src=prv, group=g)
    else:
        dist.recv(got, src=prv, group=g)
        dist.send(values(rank, 6, torch.float32), dst=nxt, group=g)
    check_equal(got, values(prv, 6, torch.float32), "send/recv ring")

    # isend / irecv with tags.
    got = torch.zeros(3, dtype=torch.int64)
    reqs = [dist.isend(torch.full((3,), rank, dtype=torch.int64), dst=nxt, group=g, tag=7),
            dist.irecv(got, src=prv, group=g, tag=7)]
    for r in reqs:
        r.wait()
    check_equal(got, torch.full((3,), prv, dtype=torch.int64), "isend/irecv")

    # batch_isend_irecv.
    got = torch.zeros(2)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(rank)), nxt, g),
                                   dist.P2POp(dist.irecv, got, prv, g)])
    for r in reqs:
        r.wait()
    check_equal(got, torch.full((2,), float(prv)), "batch_isend_irecv")

    # recv from any source: member 0 receives one message from every other member.
    if me == 0:
        senders = set()
        for _ in range(n - 1):
            t = torch.zeros(1, dtype=torch.int64)
            src = dist.recv(t, group=g)  # src=None: recv_anysource
            check(src == int(t.item()), "recv_anysource reported source", src, "but got", t)
            senders.add(src)
        check(senders == set(ranks[1:]), "recv_anysource senders", senders)
    else:
        dist.send(torch.tensor([rank], dtype=torch.int64), dst=ranks[0], group=g)


def check_async(dist, torch, g, rank, n, ranks):
    """async_op=True: several operations in flight, then wait, futures, then()."""
    ts = [values(rank, 100, torch.float32) * (k + 1) for k in range(4)]
    works = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
    flat = torch.zeros(n * 3)
    works.append(dist.all_gather_into_tensor(flat, torch.full((3,), float(rank)), group=g,
                                             async_op=True))
    works.append(dist.barrier(group=g, async_op=True))
    for w in works:
        check(w.wait(), "wait() returned False")
        check(w.is_completed(), "is_completed() after wait()")
        check(w.is_success(), "is_success() after wait()")
    total = sum(values(r, 100, torch.float32) for r in ranks)
    for k, t in enumerate(ts):
        check_equal(t, total * (k + 1), "async all_reduce %d" % k)
    check_equal(flat, torch.cat([torch.full((3,), float(r)) for r in ranks]), "async all_gather")

    # get_future(): completes with the output tensors; then() chains on it.
    t = values(rank, 8, torch.float64)
    fut = dist.all_reduce(t, group=g, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    check_equal(fut.wait()[0], sum(values(r, 8, torch.float64) for r in ranks),
                "get_future() value")
    check_equal(doubled.wait(), sum(values(r, 8, torch.float64) for r in ranks) * 2,
                "get_future().then()")

    t = torch.full((2,), float(rank))
    w = dist.all_reduce(t, group=g, async_op=True)
    w.wait()
    check(len(w.result()) == 1 and w.result()[0] is not None, "result()", w.result())
    check_equal(w.result()[0], torch.full((2,), float(sum(ranks))), "result() value")

    # wait(timeout) on an operation that completes well within it.
    w = dist.all_reduce(torch.ones(3), group=g, async_op=True)
    check(w.wait(timeout=datetime.timedelta(seconds=30)), "wait(timeout)")

    # The coalescing manager, with and without a device (start/endCoalescing).
    a, b = torch.full((4,), float(rank)), torch.full((2,), float(rank + 1))
    with dist._coalescing_manager(group=g, async_ops=True) as cm:
        dist.all_reduce(a, group=g)
        dist.all_reduce(b, group=g)
    cm.wait()
    check_equal(a, torch.full((4,), float(sum(ranks))), "coalesced all_reduce a")
    check_equal(b, torch.full((2,), float(sum(ranks) + n)), "coalesced all_reduce b")
    outs = [torch.zeros(n * 2), torch.zeros(n)]
    with dist._coalescing_manager(group=g, device=torch.device("cpu")):
        dist.all_gather_into_tensor(outs[0], torch.full((2,), float(rank)), group=g)
        dist.all_gather_into_tensor(outs[1], torch.full((1,), float(-rank)), group=g)
    check_equal(outs[0], torch.cat([torch.full((2,), float(r)) for r in ranks]),
                "coalesced all_gather_into_tensor 0")
    check_equal(outs[1], torch.tensor([float(-r) for r in ranks]),
                "coalesced all_gather_into_tensor 1")
    ts = [torch.full((3,), float(rank)), torch.full((5,), 2.0)]
    dist.all_reduce_coalesced(ts, group=g)
    check_equal(ts[0], torch.full((3,), float(sum(ranks))), "all_reduce_coalesced 0")
    check_equal(ts[1], torch.full((5,), 2.0 * n), "all_reduce_coalesced 1")


def check_functional(dist, torch, g, rank, n, ranks):
    """torch.distributed._functional_collectives (what torch.compile traces) over tdist."""
    import torch.distributed._functional_collectives as fc
    group = g if g is not None else dist.group.WORLD
    y = fc.all_reduce(values(rank, 6, torch.float32), "sum", group)
    check_equal(y, sum(values(r, 6, torch.float32) for r in ranks), "functional all_reduce")
    z = fc.all_gather_tensor(torch.full((2,), float(rank)), 0, group)
    check_equal(z, torch.cat([torch.full((2,), float(r)) for r in ranks]),
                "functional all_gather_tensor")


def check_errors(dist, torch, g, rank, n, ranks):
    """Refused calls raise RuntimeError naming the operation, change nothing, and leave the group
    usable (a sparse all_reduce with SUM, which is served, is checked beside its refused MAX). Every member makes the same calls, so the members stay in step."""
    x = values(rank, 4, torch.float32)
    before = x.clone()
    expect_raises(lambda: dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0), group=g),
                  RuntimeError, "allreduce", "PREMUL_SUM")
    check_equal(x, before, "tensor after a refused all_reduce")
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    expect_raises(lambda: dist.all_reduce(sparse, op=dist.ReduceOp.MAX, group=g), RuntimeError,
                  "allreduce", "SUM")
    check_equal(sparse.to_dense(), torch.tensor([1.0, 0.0, 2.0, 0.0]),
                "sparse tensor after a refused all_reduce")
    # Sparse COO SUM works as on gloo: the members hold different indices, some shared.
    mine = torch.sparse_coo_tensor([[rank % 3]], [float(rank + 1)], (4,))
    dist.all_reduce(mine, group=g)
    expected = torch.zeros(4)
    for r in ranks:
        expected[r % 3] += r + 1
    check_equal(mine.to_dense(), expected, "sparse all_reduce (SUM)")
    # A root outside the group, straight to the backend (the Python API refuses it earlier).
    opts = dist.BroadcastOptions()
    opts.rootRank = n
    pg = g if g is not None else dist.group.WORLD
    expect_raises(lambda: pg.broadcast([x], opts), RuntimeError, "broadcast")
    check_equal(x, before, "tensor after a refused broadcast")
    # The wrong number of outputs.
    expect_raises(lambda: dist.all_gather([torch.zeros(4) for _ in range(n + 1)], x, group=g),
                  RuntimeError, "allgather")
    # Still usable.
    dist.all_reduce(x, group=g)
    check_equal(x, sum(values(r, 4, torch.float32) for r in ranks), "all_reduce after errors")


def run_all(dist, torch, g, rank, n, ranks, functional=False):
    check_allreduce(dist, torch, g, rank, n, ranks)
    check_rooted(dist, torch, g, rank, n, ranks)
    check_gathers_and_scatters(dist, torch, g, rank, n, ranks)
    check_alltoall(dist, torch, g, rank, n, ranks)
    if n > 1:  # c10d refuses to send to oneself
        check_point_to_point(dist, torch, g, rank, n, ranks)
    check_async(dist, torch, g, rank, n, ranks)
    if functional:
        check_functional(dist, torch, g, rank, n, ranks)
    check_errors(dist, torch, g, rank, n, ranks)
    dist.barrier(group=g)


def child(rank, world_size):
    args = parse()
    import torch
    import torch.distributed as dist
    import tdist_c10d
    torch.set_num_threads(1)

    if args.init == "tcp":
        port = os.environ.pop("MASTER_PORT")
        for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
            os.environ.pop(var)
        dist.init_process_group(args.backend, init_method="tcp://127.0.0.1:%s" % port, rank=rank,
                                world_size=world_size, timeout=TIMEOUT)
    else:
        dist.init_process_group(args.backend, init_method="env://", timeout=TIMEOUT)
    check(dist.get_backend() == args.backend, "get_backend()", dist.get_backend())
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    check(isinstance(backend, tdist_c10d.TdistBackend), "the CPU backend is", type(backend))
    check(backend.group_timeout == TIMEOUT, "group timeout", backend.group_timeout)
    check(dist.get_rank() == rank and dist.get_world_size() == world_size, "rank/size")
    longer = TIMEOUT + datetime.timedelta(seconds=1)
    backend.set_timeout(longer)
    check(backend.group_timeout == longer, "group timeout after set_timeout",
          backend.group_timeout)
    expect_raises(lambda: backend.set_timeout(datetime.timedelta(0)), RuntimeError,
                  "positive timeout")

    everyone = list(range(world_size))
    run_all(dist, torch, None, rank, world_size, everyone, args.functional)

    # Subgroups over tdist: all ranks in reverse order, and the odd ranks alone.
    sub = dist.new_group(ranks=everyone[::-1], backend="tdist")
    check(isinstance(sub._get_backend(torch.device("cpu")), tdist_c10d.TdistBackend),
          "subgroup backend")
    run_all(dist, torch, sub, rank, world_size, everyone, args.functional)
    odd = [r for r in everyone if r % 2 == 1]
    odd_group = dist.new_group(ranks=odd, backend="tdist", timeout=TIMEOUT) if odd else None
    if rank in odd:
        check(dist.get_rank(odd_group) == odd.index(rank), "rank in the odd group")
        run_all(dist, torch, odd_group, rank, len(odd), odd)
    # wait(timeout) gives up on an operation that cannot finish in time, and says so; the
    # receive stays posted until destroy_process_group aborts it.
    if world_size > 1 and rank == 0:
        pending = dist.irecv(torch.zeros(1), src=1, tag=999)
        start = time.monotonic()
        e = expect_raises(lambda: pending.wait(timeout=datetime.timedelta(milliseconds=500)),
                          RuntimeError, "tdist")
        print("rank 0: wait(500 ms) on a receive nobody sends raised after %.2f s: %s" % (
            time.monotonic() - start, str(e).splitlines()[0]))
        check(not pending.is_completed(), "the receive completed without a sender")

    # The backend takes no options object: a clear error, on every rank alike.
    expect_raises(lambda: dist.new_group(backend="tdist", pg_options=object()), ValueError,
                  "takes no backend options")
    dist.barrier()
    dist.destroy_process_group()
    print("rank %d: all collectives checked" % rank)


def main():
    args = parse()
    if args.child:
        harness.child_main(child)
    harness.run_ranks(os.path.abspath(__file__), args.world_size,
                      ["--world-size", args.world_size, "--init", args.init,
                       "--backend", args.backend] + (["--functional"] if args.functional else []),
                      timeout=150)


if __name__ == "__main__":
    main()
