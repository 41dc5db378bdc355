#!/usr/bin/env python3
"""PyTorch's side of `tdist-bench fsdp`: the byte-level GPT of tdist-train (--model gpt) trained
with PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard, each block a unit, then the root) or
PyTorch's DDP, over gloo or over tdist's c10d backend (the tdist_c10d module), on CPU.

The model is tdist-train's (apps/train/models.h), as bench_gpt_torch.py writes it. The text
is tdist-train's --dataset text: the *.py files under --data-dir (default the newest
/usr/lib/python3.N), sorted, every 20th held out; each step every rank takes --batch windows of
--context bytes at offsets drawn from one generator seeded with --seed (all ranks draw the same
world x batch offsets and take their own rows). Adam, cross-entropy per byte.

Memory is measured as tdist-train measures its own: tdist_c10d.track_cpu_memory() wraps
libtorch's CPU allocator with tdist's counting one (core/cpu_memory.h) before anything else, so
`peak_allocated_bytes` is the most bytes of CPU tensors held at once from the model's
construction on, less what was held just before. `state_bytes` are the parameters (FSDP2: the
local shards of the DTensors), gradients and Adam state after the last step (each storage once).
`peak_rss_bytes` is the process's peak resident set (the interpreter included).
`activation_bytes` is the most bytes one step's forward and loss added (the count when its
backward begins less the count before its forward), as tdist-train reports it.

Each rank is a process of this script (--child); the parent prints one line that
tdist-bench fsdp parses:

    result {"samples_per_s": ..., "loss": ..., "ranks": [{...}, ...], ...}

Run alone (tdist_c10d on PYTHONPATH, e.g. build/python):
    PYTHONPATH=build/python python3 scripts/bench_fsdp_torch.py --strategy fsdp --backend tdist
"""
import argparse
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=["fsdp", "ddp"], default="fsdp")
    p.add_argument("--backend", choices=["gloo", "tdist"], default="gloo")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    p.add_argument("--steps", type=int, default=60, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--loss-window", type=int, default=10,
                   help="the reported loss: the mean over the last this many steps and the ranks")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--data-dir", default="")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.world_size < 1 or args.steps < 1 or args.warmup < 0 or args.loss_window < 1:
        p.error("--world-size and --steps must be >= 1, --warmup >= 0, --loss-window >= 1")
    if args.width % args.heads != 0:
        p.error("--width must be a multiple of --heads")
    return args


def default_text_dir():
    best, best_minor = "", -1
    for name in os.listdir("/usr/lib"):
        m = re.fullmatch(r"python3\.(\d+)", name)
        if m and os.path.isdir(os.path.join("/usr/lib", name)) and int(m.group(1)) > best_minor:
            best, best_minor = os.path.join("/usr/lib", name), int(m.group(1))
    return best


def read_train_text(directory):
    files = []
    for root, _, names in os.walk(directory):
        for n in names:
            path = os.path.join(root, n)
            if n.endswith(".py") and os.path.isfile(path) and not os.path.islink(path):
                files.append(os.path.relpath(path, directory))
    files.sort()
    if len(files) < 2:
        raise SystemExit("bench_fsdp_torch.py: %s holds fewer than 2 .py files" % directory)
    parts = []
    for k, f in enumerate(files):
        held = k + 1 == len(files) if len(files) < 20 else k % 20 == 19
        if not held:
            with open(os.path.join(directory, f), "rb") as fh:
                parts.append(fh.read())
    return b"".join(parts)


def child(args):
    import torch
    import tdist_c10d  # registers the "tdist" backend; the counting allocator

    tdist_c10d.track_cpu_memory()
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from bench_gpt_torch import GPT  # beside this script

    rank, world = int(os.environ["RANK"]), args.world_size
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, init_method="tcp://127.0.0.1:" + os.environ["BENCH_PORT"],
                            rank=rank, world_size=world)
    text = read_train_text(args.data_dir or default_text_dir())
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    windows = (data.numel() - 1) // args.context
    gen = torch.Generator().manual_seed(args.seed)

    def batch():
        starts = torch.randint(0, windows, (world * args.batch,), generator=gen)
        starts = starts[rank * args.batch:(rank + 1) * args.batch] * args.context
        rows = torch.stack([data[s:s + args.context + 1] for s in starts.tolist()]).long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    base = tdist_c10d.cpu_memory_stats()["allocated_bytes"]
    tdist_c10d.reset_peak_cpu_memory()
    torch.manual_seed(args.seed)
    model = GPT(args.width, args.heads, args.layers, args.context)
    if args.strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    activations = [0]

    def step():
        x, y = batch()
        opt.zero_grad()
        before = tdist_c10d.cpu_memory_stats()["allocated_bytes"]
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, 256), y.reshape(-1))
        del out
        activations[0] = max(activations[0],
                             tdist_c10d.cpu_memory_stats()["allocated_bytes"] - before)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - start
    stats = tdist_c10d.cpu_memory_stats()

    seen, state = set(), 0

    def count(t):
        nonlocal state
        if t is None:
            return
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            state += s.nbytes()

    for p in model.parameters():
        count(p)
        count(p.grad)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                count(v)
    window = losses[-args.loss_window:]
    mine = torch.tensor([sum(window) / len(window)], dtype=torch.float64)
    dist.all_reduce(mine)
    result = {
        "rank": rank,
        "seconds": seconds,
        "loss": mine.item() / world,
        "state_bytes": state,
        "peak_allocated_bytes": stats["peak_bytes"] - base,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "activation_bytes": activations[0],
        "params": sum(p.numel() for p in model.parameters()) if args.strategy == "ddp" else None,
    }
    print("rank_result " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parent(args):
    env = dict(os.environ, BENCH_PORT=str(free_port()), OMP_NUM_THREADS=str(args.threads))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"] + sys.argv[1:],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(args.world_size)]
    deadline = time.time() + args.timeout
    outputs, failed = [], []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            failed.append("rank %d timed out after %gs" % (r, args.timeout))
        if p.returncode != 0 and not failed:
            failed.append("rank %d exited with %s" % (r, p.returncode))
            for q in procs:
                if q.poll() is None:
                    q.kill()
        outputs.append(out)
    ranks = []
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("rank_result "):
                ranks.append(json.loads(line[len("rank_result "):]))
    if failed or len(ranks) != args.world_size:
        sys.stderr.write("bench_fsdp_torch.py: %s\n%s" % ("; ".join(failed) or "missing results",
                                                          "\n".join(outputs)))
        return 1
    ranks.sort(key=lambda r: r["rank"])
    slowest = max(r["seconds"] for r in ranks)
    print("result " + json.dumps({
        "strategy": args.strategy, "backend": args.backend, "world_size": args.world_size,
        "samples_per_s": args.world_size * args.batch * args.steps / slowest,
        "loss": ranks[0]["loss"], "ranks": ranks}), flush=True)
    return 0


if __name__ == "__main__":
    a = parse()
    if a.child:
        child(a)
    else:
        sys.exit(parent(a))
