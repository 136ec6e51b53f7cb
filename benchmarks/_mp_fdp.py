"""fdp side of benchmarks/multiprocess.py: one process per device (run under fdp launch).

python benchmarks/_mp_fdp.py --model mlp --batch 64 --steps 20 --out result.json
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
parser.add_argument("--bucket-cap-mb", default="25.0", help='MiB, or "auto" (fdp.tune)')
parser.add_argument("--layout", default="auto")
parser.add_argument(
    "--comm-hook",
    default="default",
    help="default (fdp's: shared memory on one host), allreduce (XLA's all-reduce), "
    "noop (the same step without gradient communication: headroom), ...",
)
parser.add_argument(
    "--trivial-loss",
    action="store_true",
    help="a loss with (almost) no compute: the step's reduction and update alone",
)
parser.add_argument(
    "--fold-dots",
    choices=("default", "on", "off"),
    default="default",
    help="fold_dots of the step (default: fdp's, on for CPU)",
)
parser.add_argument(
    "--sweep-rounds",
    type=int,
    default=0,
    help="instead of training: time every candidate of fdp.tune (--sweep-caps x its "
    "layouts) in this one run, interleaved for this many rounds of --steps steps, "
    "and report each one's median step time",
)
parser.add_argument("--sweep-caps", default="0.5,1,2.5,5,10,25,50")
parser.add_argument(
    "--trace-steps",
    type=int,
    default=0,
    help="after the timed rounds, profile this many steps with jax.profiler and report "
    "each bucket's overlap with compute from XLA:CPU's thunk events (_overlap_trace.py)",
)
parser.add_argument("--out", required=True)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)

import optax  # noqa: E402
from _mp_models import (  # noqa: E402
    LR,
    cpu_seconds,
    init_params,
    jax_loss,
    make_batches,
    memory_mib,
    minor_faults,
    result_record,
)
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402

fdp.init(initialization_timeout=120)
rank, nproc = fdp.process_index(), fdp.process_count()
params = init_params(args.model)
state = fdp.replicate(TrainState.create(apply_fn=None, params=params, tx=optax.sgd(LR)))
cap = args.bucket_cap_mb if args.bucket_cap_mb == "auto" else float(args.bucket_cap_mb)


def trivial_loss(params, batch):
    """Gradients cos(i) * 1e-30: cheap, yet not a broadcast constant that XLA could
    reduce as one scalar (all-reduce of a broadcast)."""
    del batch
    import jax.numpy as jnp

    return 1e-30 * sum(
        jnp.sum(x * jnp.cos(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape)))
        for x in jax.tree.leaves(params)
    )


hook = None if args.comm_hook == "default" else args.comm_hook
step = fdp.train_step(
    trivial_loss if args.trivial_loss else jax_loss(args.model),
    bucket_cap_mb=cap,
    layout=args.layout,
    comm_hook=hook,
    fold_dots={"default": None, "on": True, "off": False}[args.fold_dots],
)
batches = [fdp.shard_batch(b) for b in make_batches(args.model, args.batch, 4, 100 + rank)]

if args.sweep_rounds:
    # The full sweep in one run: fdp.tune's screening, long, with no race and no margin,
    # so that every distinct program is timed in the same interleaved rounds.
    swept = fdp.tune(
        trivial_loss if args.trivial_loss else jax_loss(args.model),
        state,
        batches[0],
        caps=[float(c) for c in args.sweep_caps.split(",")],
        steps=args.steps,
        rounds=args.sweep_rounds,
        warmup=args.warmup,
        margin=0.0,
        finalists=1,
        comm_hook=hook,
    )
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "nproc": nproc,
                    "sweep_rounds": args.sweep_rounds,
                    "steps": args.steps,
                    "step_s": {f"{c}/{lay}": s for (c, lay), s in swept.step_s.items()},
                    "same_program": {
                        f"{c}/{lay}": f"{c2}/{lay2}"
                        for (c, lay), (c2, lay2) in swept.same_program.items()
                    },
                },
                f,
            )
    sys.exit(0)

losses = []
tune_start = time.perf_counter()
for i in range(args.warmup):
    state, metrics = step(state, batches[i % len(batches)])
    if i == 0:
        # With "auto", the first call tunes (and compiles every candidate).
        first_call_s = time.perf_counter() - tune_start
    losses.append(float(metrics["loss"]))
rounds = []
faults = minor_faults()
cpu = cpu_seconds()
for _ in range(args.rounds):
    start = time.perf_counter()
    for i in range(args.steps):
        state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    rounds.append((time.perf_counter() - start) / args.steps)
faults = (minor_faults() - faults) / (args.rounds * args.steps)
user_s, sys_s = (b - a for a, b in zip(cpu, cpu_seconds(), strict=True))
traced = None
if args.trace_steps:
    import tempfile

    import _overlap_trace

    compiled = step.lower(state, batches[0]).compile()
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for i in range(args.trace_steps):
            state, metrics = step(state, batches[i % len(batches)])
            jax.block_until_ready(state)
        jax.profiler.stop_trace()
        events = _overlap_trace.load_events(trace_dir)
    module = next(e["args"]["hlo_module"] for e in events if "hlo_op" in e.get("args", {}))
    runs = _overlap_trace.thunk_intervals(events, module)
    traced = _overlap_trace.overlap(runs, _overlap_trace.collectives(compiled.as_text()))
    traced["module"] = module
    traced["op_ms"] = _overlap_trace.op_times(runs)
if rank == 0:
    record = result_record("fdp", args, nproc, params, rounds, losses)
    record["trace"] = traced
    record.update(
        faults_per_step=faults,
        cpu_user_ms_per_step=1e3 * user_s / (args.rounds * args.steps),
        cpu_sys_ms_per_step=1e3 * sys_s / (args.rounds * args.steps),
        **memory_mib(),
        layout=args.layout,
        resolved_layout=step.config.layout,
        chosen_bucket_cap_mb=step.config.bucket_cap_mb,
        chosen_layout=step.tuned.layout if cap == "auto" else args.layout,
        first_call_s=first_call_s,
        tuned_step_s=(
            {f"{c}/{lay}": s for (c, lay), s in step.tuned.step_s.items()}
            if cap == "auto"
            else None
        ),
        tuned_race_s=(
            {f"{c}/{lay}": s for (c, lay), s in step.tuned.race_s.items()}
            if cap == "auto"
            else None
        ),
        comm_hook=args.comm_hook,
        # How the compiled step sums: fdp's shared-memory calls (0: XLA's collectives).
        shm_sums=step.lower(state, batches[0])
        .compile()
        .as_text()
        .count('custom_call_target="fdp_shm_sum"'),
        trivial_loss=args.trivial_loss,
        fold_dots=step.config.fold_dots,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        threads=os.environ.get("OMP_NUM_THREADS", ""),
    )
    with open(args.out, "w") as f:
        json.dump(record, f)
