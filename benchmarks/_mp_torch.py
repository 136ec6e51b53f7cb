"""PyTorch DDP side of benchmarks/multiprocess.py (run under torchrun).

python -m torch.distributed.run --nproc-per-node 2 benchmarks/_mp_torch.py --model mlp ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mlp")
parser.add_argument("--batch", type=int, default=64, help="examples per process per step")
parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
parser.add_argument(
    "--comm-hook",
    choices=("allreduce", "noop"),
    default="allreduce",
    help="noop: torch's debugging noop_hook, the same step without communication (headroom)",
)
parser.add_argument(
    "--ddp-default-cap",
    action="store_true",
    help="construct DDP without bucket_cap_mb (its default, 25 MiB): DDP then keeps a "
    "1 MiB first bucket, as fdp's default plan does; passing the cap drops it",
)
parser.add_argument(
    "--trace-steps",
    type=int,
    default=0,
    help="after the timed rounds, profile this many steps with torch.profiler and report "
    "each bucket's overlap with the backward pass (_overlap_trace.py)",
)
parser.add_argument("--out", required=True)
args = parser.parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _mp_models import (  # noqa: E402
    LR,
    cpu_seconds,
    init_params,
    make_batches,
    memory_mib,
    minor_faults,
    result_record,
    torch_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

dist.init_process_group("gloo")
rank, nproc = dist.get_rank(), dist.get_world_size()
params = init_params(args.model)
if args.ddp_default_cap and args.bucket_cap_mb != 25.0:
    parser.error(
        f"--ddp-default-cap is DDP's 25 MiB default; got --bucket-cap-mb {args.bucket_cap_mb}"
    )
cap_kwargs = {} if args.ddp_default_cap else {"bucket_cap_mb": args.bucket_cap_mb}
model = DDP(torch_module(args.model, params), **cap_kwargs)
if args.comm_hook == "noop":
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    model.register_comm_hook(None, noop_hook)
opt = torch.optim.SGD(model.parameters(), lr=LR)
batches = [
    {"x": torch.from_numpy(b["x"]), "y": torch.from_numpy(b["y"]).long()}
    for b in make_batches(args.model, args.batch, 4, 100 + rank)
]


def bucket_bytes() -> list[int]:
    """The sizes of the buckets DDP reduces now: after its first iteration it rebuilds
    them in the observed order, with a 1 MiB first bucket only when ``bucket_cap_mb``
    was not passed (torch 2.13's ``first_bucket_bytes_cap``)."""
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(x) for x in str(sizes).split(",") if x.strip()]


def train_step(batch):
    opt.zero_grad(set_to_none=True)
    logits = model(batch["x"])
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["y"].reshape(-1)
    )
    loss.backward()
    opt.step()
    return loss


losses = []
for i in range(args.warmup):
    loss = train_step(batches[i % len(batches)])
    # The all-reduced mean loss, to compare with fdp's metrics["loss"].
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(float(mean) / nproc)
rounds = []
faults = minor_faults()
cpu = cpu_seconds()
for _ in range(args.rounds):
    dist.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        train_step(batches[i % len(batches)])
    rounds.append((time.perf_counter() - start) / args.steps)
faults = (minor_faults() - faults) / (args.rounds * args.steps)
user_s, sys_s = (b - a for a, b in zip(cpu, cpu_seconds(), strict=True))
traced = None
if args.trace_steps:
    import tempfile

    import _overlap_trace
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(args.trace_steps):
            with record_function("bench_step"):
                train_step(batches[i % len(batches)])
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    runs = _overlap_trace.torch_intervals(events, "bench_step")
    colls = {f"bucket{i}": ("gloo:all_reduce", b) for i, b in enumerate(bucket_bytes())}
    traced = _overlap_trace.overlap(runs, colls)
if rank == 0:
    record = result_record("torch", args, nproc, params, rounds, losses)
    record["trace"] = traced
    record.update(
        faults_per_step=faults,
        cpu_user_ms_per_step=1e3 * user_s / (args.rounds * args.steps),
        cpu_sys_ms_per_step=1e3 * sys_s / (args.rounds * args.steps),
        **memory_mib(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        comm_hook=args.comm_hook,
        bucket_bytes=bucket_bytes(),
        ddp_default_cap=args.ddp_default_cap,
    )
    with open(args.out, "w") as f:
        json.dump(record, f)
dist.destroy_process_group()
