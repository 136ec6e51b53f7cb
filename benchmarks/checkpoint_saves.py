"""The cost of checkpointing during training: step time while saving, against not saving.

For each model, three ways to run the same data-parallel training loop are timed
in interleaved rounds in one process (each round runs every variant for one
saving period, in rotating order, so that load from other processes on the
machine falls on all of them alike):

  none   no checkpoints
  sync   fdp.CheckpointManager(async_save=False).save every N steps
  async  fdp.CheckpointManager() (background writes, the default).save every N steps

It reports the mean time per step over all steps (saving steps included), its
ratio to ``none`` (median of the per-round ratios), and the median time of the
steps that save (the blocking part of a save: for ``async`` the copy to host
memory and the wait for the previous save). A save includes fdp's checksums.

    python benchmarks/checkpoint_saves.py --json benchmarks/results/checkpoint_saves.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))

VARIANTS = ("none", "sync", "async")


def run_model(name: str, args: argparse.Namespace) -> dict:
    from _models import BENCHES, param_count
    from flax.training.train_state import TrainState

    import fdp

    bench = BENCHES[name]
    params = bench.init_params()
    state0 = TrainState.create(apply_fn=bench.module.apply, params=params, tx=bench.tx())
    step = fdp.train_step(bench.loss_fn)
    batch = fdp.shard_batch(bench.make_batch(args.global_batch, 0))
    root = tempfile.mkdtemp(prefix="fdp-ckpt-bench-")
    states, managers, counters = {}, {}, {}
    for v in VARIANTS:
        states[v] = fdp.replicate(state0)
        states[v], _ = step(states[v], batch)  # compile, and warm up
        counters[v] = 0
        if v != "none":
            managers[v] = fdp.CheckpointManager(
                os.path.join(root, v), max_to_keep=2, async_save=(v == "async")
            )
    jax.block_until_ready(states)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    save_times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    per_round: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for v in order:
            began = time.perf_counter()
            for _ in range(args.every):
                t = time.perf_counter()
                states[v], metrics = step(states[v], batch)
                counters[v] += 1
                if v != "none" and counters[v] % args.every == 0:
                    managers[v].save(counters[v], states[v])
                    jax.block_until_ready(metrics)
                    save_times[v].append(time.perf_counter() - t)
                else:
                    jax.block_until_ready(metrics)
                times[v].append(time.perf_counter() - t)
            per_round[v].append((time.perf_counter() - began) / args.every)
    for m in managers.values():
        m.close()
    size = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(os.path.join(root, "sync"))
        for f in fs
    ) / len(os.listdir(os.path.join(root, "sync")))
    shutil.rmtree(root, ignore_errors=True)
    rows = {}
    for v in VARIANTS:
        ratios = [a / b for a, b in zip(per_round[v], per_round["none"], strict=True)]
        rows[v] = {
            "mean_step_ms": 1e3 * statistics.mean(times[v]),
            "ratio_to_none": statistics.median(ratios),
            "saving_step_ms": 1e3 * statistics.median(save_times[v]) if save_times[v] else None,
        }
    return {
        "model": name,
        "params": param_count(params),
        "checkpoint_mb": size / 2**20,
        "every": args.every,
        "rounds": args.rounds,
        "variants": rows,
    }


def print_table(results: list[dict], *, header: bool = True) -> None:
    if header:
        print(
            f"{'model':<12} {'params':>9} {'ckpt MB':>8} {'every':>5} {'variant':<6} "
            f"{'ms/step':>8} {'x none':>7} {'saving step ms':>15}"
        )
    for res in results:
        for v, row in res["variants"].items():
            saving = "-" if row["saving_step_ms"] is None else f"{row['saving_step_ms']:.1f}"
            print(
                f"{res['model']:<12} {res['params']:>9} {res['checkpoint_mb']:>8.1f} "
                f"{res['every']:>5} {v:<6} {row['mean_step_ms']:>8.2f} "
                f"{row['ratio_to_none']:>7.2f} {saving:>15}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--every", default="10,50", help="save every N steps (a list)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)
    results = []
    for name in args.models.split(","):
        for every in map(int, args.every.split(",")):
            results.append(run_model(name, argparse.Namespace(**{**vars(args), "every": every})))
            print_table(results[-1:], header=len(results) == 1)
            sys.stdout.flush()
    if args.json:
        meta = {
            "command": "python benchmarks/checkpoint_saves.py " + " ".join(argv or sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "jax": jax.__version__,
            "devices": args.devices,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
