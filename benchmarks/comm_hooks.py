"""Bytes on the wire (and step time) of every comm hook, on the benchmark models.

Bytes are read from the *lowered* program (StableHLO), which holds the collectives
fdp emitted with their real dtypes: XLA:CPU later promotes bfloat16 all-reduces to
float32, so the compiled CPU program would overstate what a GPU sends. "payload" is
the per-device size of each collective's result; "sent" estimates what one device
transmits with ring algorithms (all-reduce 2(g-1)/g x payload, all-gather (g-1)/g x
gathered size, g = devices in the group).

PowerSGD is measured in its compressed steady state (start_powersgd_iter=0; error
feedback and warm start do not change what is sent). Post-local SGD is measured after
its start: subgroup all-reduces only (the periodic parameter averaging adds one
all-reduce of the parameters every ``period`` steps).

    python benchmarks/comm_hooks.py --json benchmarks/results/comm_hooks.json

With ``--reductions``, the reductions beyond DDP instead (benchmarks/_reductions.py):
flat, hierarchical, compressed and DiLoCo on 2 simulated hosts x 4 devices, with
bytes by link, step time against flat and held-out accuracy on the digits:

    python benchmarks/comm_hooks.py --reductions --json benchmarks/results/reductions.json \
        --plot docs/img/reductions.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
from _progress import progress


def hooks_to_measure(n_devices: int) -> dict:
    from fdp import hooks

    steady = {"use_error_feedback": False, "warm_start": False, "start_powersgd_iter": 0}
    return {
        "allreduce": hooks.allreduce(),
        "fp16_compress": hooks.fp16_compress(),
        "bf16_compress": hooks.bf16_compress(),
        "quantize_per_tensor": hooks.quantize_per_tensor(),
        "quantize_per_channel": hooks.quantize_per_channel(),
        "powersgd r=1": hooks.powersgd(matrix_approximation_rank=1, **steady),
        "powersgd r=4": hooks.powersgd(matrix_approximation_rank=4, **steady),
        "batched_powersgd r=4": hooks.batched_powersgd(matrix_approximation_rank=4, **steady),
        "post_local_sgd (groups of 2)": hooks.post_local_sgd(0, subgroup_size=2),
        "noop": hooks.noop(),
    }


def measure(name: str, args: argparse.Namespace) -> list[dict]:
    from _models import BENCHES, param_count

    import fdp

    bench = BENCHES[name]
    mesh = fdp.data_mesh()
    n = mesh.shape["data"]
    params = bench.init_params(0)
    batch = fdp.shard_batch(bench.make_batch(args.batch_per_device * n, 1), mesh)
    rows = []
    for hook_name, hook in progress(hooks_to_measure(n).items(), f"{name}: hooks"):
        state = fdp.replicate(
            fdp.TrainState.create(apply_fn=None, params=params, tx=bench.tx()), mesh
        )
        step = fdp.train_step(bench.loss_fn, mesh=mesh, comm_hook=hook)
        stats = fdp.collective_stats(step.lower(state, batch))
        ops = stats.ops
        if hook_name.startswith("post_local_sgd"):
            ops = [op for op in ops if op.group_size < n] + [
                op for op in ops if op.kind == "all-reduce" and op.shapes == ((),)
            ]
        row = {
            "model": name,
            "params": param_count(params),
            "hook": hook_name,
            "collectives": {},
            "payload_bytes": sum(op.nbytes for op in ops),
            "sent_bytes": sum(op.sent_bytes for op in ops),
            "dtypes": sorted({d for op in ops for d in op.dtypes}),
        }
        for op in ops:
            row["collectives"][op.kind] = row["collectives"].get(op.kind, 0) + 1
        if name in args.time_models.split(","):
            state = step.init(state)
            for _ in range(2):
                state, _ = step(state, batch)
            jax.block_until_ready(state)
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    state, _ = step(state, batch)
                jax.block_until_ready(state)
                times.append((time.perf_counter() - t0) / args.steps)
            row["median_step_s"] = statistics.median(times)
        rows.append(row)
    base = next(r for r in rows if r["hook"] == "allreduce")
    for row in rows:
        row["sent_vs_allreduce"] = (
            row["sent_bytes"] / base["sent_bytes"] if base["sent_bytes"] else 0
        )
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'model':<12}{'hook':<30}{'collectives':<28}{'dtypes':<14}{'payload MiB':>12}"
        f"{'sent MiB':>10}{'/ allreduce':>12}{'step ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        coll = ", ".join(f"{v} {k}" for k, v in r["collectives"].items()) or "none"
        ms = f"{1e3 * r['median_step_s']:.1f}" if "median_step_s" in r else "-"
        print(
            f"{r['model']:<12}{r['hook']:<30}{coll:<28}{','.join(r['dtypes']):<14}"
            f"{r['payload_bytes'] / 2**20:>12.3f}{r['sent_bytes'] / 2**20:>10.3f}"
            f"{r['sent_vs_allreduce']:>12.3f}{ms:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-per-device", type=int, default=8)
    parser.add_argument(
        "--time-models",
        default="mlp,cnn",
        help="models whose step time is also measured (comma-separated)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--reductions", action="store_true", help="hierarchical/compressed/DiLoCo")
    parser.add_argument("--train-steps", type=int, default=240, help="with --reductions")
    parser.add_argument("--plot", help="with --reductions: accuracy against bytes, PNG")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)

    if args.reductions:
        import _reductions

        rows = [
            row
            for m in _reductions.MODELS
            for row in _reductions.measure(m, args.train_steps, 128, args.rounds)
        ]
        print(
            f"\n{jax.device_count()} x {jax.devices()[0].platform} devices as 2 hosts x 4, "
            f"jax {jax.__version__}, {os.cpu_count()} cores; bytes per device per step from "
            "the lowered program"
        )
        _reductions.print_table(rows)
        if args.plot:
            _reductions.plot(rows, args.plot)
        return _write(args, rows)
    rows = [row for m in args.models.split(",") for row in measure(m, args)]
    print(
        f"\n{jax.device_count()} x {jax.devices()[0].platform} devices, jax {jax.__version__}, "
        f"{os.cpu_count()} cores, {platform.machine()}; bytes per device per step from the "
        "lowered program"
    )
    print_table(rows)
    return _write(args, rows)


def _write(args: argparse.Namespace, rows: list[dict]) -> int:
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {
            "jax": jax.__version__,
            "devices": jax.device_count(),
            "argv": sys.argv,
            "cores": os.cpu_count(),
            "args": vars(args),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
