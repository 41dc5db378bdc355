#!/usr/bin/env python3
"""PyTorch's torch.distributed.pipelining over gloo on the model tdist-bench pipeline trains: the
anchor it compares to (same model, cut, schedule, microbatches and batch; CPU; one process per
stage, `--threads` intra-op threads each).

Models: `--model mlp`, `--layers` blocks of Linear(width, width) + Tanh, MSE loss against random
targets; `--model gpt`, tdist-train's byte-level GPT (bench_gpt_torch.py) as the Sequential it cuts
(embedding, `--layers` transformer blocks, head), cross-entropy against random bytes. SGD for both.
The cut is given by tdist-bench as layer bounds (`--bounds 0,8,16`: stage s holds layers
[b_s, b_{s+1}) of the Sequential); with `--schedule interleaved` there are two stages per rank
(stage s on rank s mod p), as in tdist. Timing: wall time of the measured steps on rank 0 after
a barrier; prints one line that tdist-bench pipeline parses:

    samples_per_s=<float> step_ms=<mean ms per step> stages=<p>

Run alone: python3 scripts/bench_pipeline_torch.py --stages 2 --schedule 1f1b --bounds 0,8,16
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

from bench_gpt_torch import GPT  # beside this script


def make_model(args):
    if args.model == "gpt":
        return GPT(args.width, args.heads, args.layers, args.context).layers()
    mods = []
    for _ in range(args.layers):
        mods += [nn.Linear(args.width, args.width), nn.Tanh()]
    return nn.Sequential(*mods)


def stage_shapes(args, micro, first, last):
    """Example input and output of a stage (first/last: whether it holds the first/last layer)."""
    if args.model == "gpt":
        act = torch.empty(micro, args.context, args.width)
        return (torch.empty(micro, args.context, dtype=torch.long) if first else act,
                torch.empty(micro, args.context, 256) if last else act)
    return torch.empty(micro, args.width), torch.empty(micro, args.width)


def worker(rank, args, port, queue):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    torch.manual_seed(0)
    model = make_model(args)
    bounds = [int(b) for b in args.bounds.split(",")]
    num_stages = len(bounds) - 1
    dev = torch.device("cpu")
    micro = args.micro_batch_size
    stages = []
    for s in range(rank, num_stages, args.stages):
        part = nn.Sequential(*[model[i] for i in range(bounds[s], bounds[s + 1])])
        example_in, example_out = stage_shapes(args, micro, s == 0, s == num_stages - 1)
        stages.append(PipelineStage(part, s, num_stages, dev, input_args=example_in,
                                    output_args=example_out))
    if args.model == "gpt":
        def loss_fn(out, y):
            return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
    else:
        loss_fn = nn.MSELoss()
    m = args.microbatches
    if args.schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    elif args.schedule == "1f1b":
        sched = Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.001)
    gen = torch.Generator().manual_seed(1)
    batch = micro * m
    if args.model == "gpt":
        x = torch.randint(0, 256, (batch, args.context), generator=gen)
        y = torch.randint(0, 256, (batch, args.context), generator=gen)
    else:
        x = torch.randn(batch, args.width, generator=gen)
        y = torch.randn(batch, args.width, generator=gen)
    first = 0 in [st.stage_index for st in stages]
    last = num_stages - 1 in [st.stage_index for st in stages]

    def step():
        opt.zero_grad()
        call_args = (x,) if first else ()
        if last:
            sched.step(*call_args, target=y, losses=[])
        else:
            sched.step(*call_args)
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    total = time.perf_counter() - start
    if rank == 0:
        queue.put((batch * args.steps / total, total / args.steps * 1e3))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2, help="processes (pipeline ranks)")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4, help="gpt only")
    ap.add_argument("--context", type=int, default=128, help="gpt only")
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--bounds", required=True, help="layer bounds of the stages, comma-separated")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    mp.start_processes(worker, args=(args, port, queue), nprocs=args.stages, join=True,
                       start_method="spawn")
    samples_per_s, step_ms = queue.get()
    print(f"samples_per_s={samples_per_s:.3f} step_ms={step_ms:.3f} stages={args.stages}",
          flush=True)


if __name__ == "__main__":
    main()
