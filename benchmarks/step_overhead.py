"""fdp's step against plain JAX data parallelism, on simulated CPU devices.

Three ways to run the same data-parallel training step, timed in paired rounds in
one process (each round runs every variant, in rotating order):

  fdp       fdp.train_step (buckets reduced in place inside shard_map)
  fdp-flat  fdp.train_step(layout="flat"): DDP's packed bucket buffers
  jit     plain jax.jit with NamedSharding: XLA inserts the gradient all-reduce
  pmean   shard_map with one pmean per gradient leaf

For each model it reports the median step time, fdp's time over jit's (median of
the per-round ratios), the all-reduces of the compiled program (count, bytes), and
the compiled temp memory (``memory_analysis``).

    python benchmarks/step_overhead.py --json benchmarks/results/step_overhead.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))


def setup_devices(n: int) -> None:
    jax.config.update("jax_num_cpu_devices", n)


def build(bench, mesh, global_batch, bucket_cap_mb):
    from flax.training.train_state import TrainState
    from jax.sharding import PartitionSpec as P

    import fdp

    params = bench.init_params(0)
    state = TrainState.create(apply_fn=None, params=params, tx=bench.tx())
    batch = fdp.shard_batch(bench.make_batch(global_batch, 1), mesh)

    fdp_step = fdp.train_step(bench.loss_fn, mesh=mesh, bucket_cap_mb=bucket_cap_mb)
    fdp_flat = fdp.train_step(bench.loss_fn, mesh=mesh, bucket_cap_mb=bucket_cap_mb, layout="flat")

    @functools.partial(jax.jit, donate_argnums=0)
    def jit_step(state, batch):
        loss, grads = jax.value_and_grad(bench.loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    def local_pmean(state, batch):
        params = jax.lax.pcast(state.params, "data", to="varying")
        loss, grads = jax.value_and_grad(bench.loss_fn)(params, batch)
        grads = jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)
        return state.apply_gradients(grads=grads), {"loss": jax.lax.pmean(loss, "data")}

    pmean_step = jax.jit(
        jax.shard_map(local_pmean, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())),
        donate_argnums=0,
    )
    variants = {"fdp": fdp_step, "fdp-flat": fdp_flat, "jit": jit_step, "pmean": pmean_step}
    states = {name: fdp.replicate(state, mesh) for name in variants}
    return variants, states, batch, params


def analyse(step, state, batch) -> dict:
    import fdp

    compiled = step.lower(state, batch).compile()
    stats = fdp.collective_stats(compiled)
    mem = compiled.memory_analysis()
    return {
        "all_reduce_count": stats.count("all-reduce"),
        "all_reduce_bytes": stats.nbytes("all-reduce"),
        "other_collectives": {k: v for k, v in stats.summary().items() if k != "all-reduce"},
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }


def run_model(name: str, args: argparse.Namespace) -> dict:
    from _models import BENCHES, param_count

    import fdp

    bench = BENCHES[name]
    mesh = fdp.data_mesh()
    n = mesh.shape["data"]
    global_batch = args.batch_per_device * n
    variants, states, batch, params = build(bench, mesh, global_batch, args.bucket_cap_mb)

    result = {
        "model": name,
        "params": param_count(params),
        "global_batch": global_batch,
        "variants": {},
    }
    for vname, step in variants.items():
        result["variants"][vname] = analyse(step, states[vname], batch)
        for _ in range(args.warmup):
            states[vname], _ = step(states[vname], batch)
        jax.block_until_ready(states[vname])

    times: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for vname in order:
            step = variants[vname]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                states[vname], _ = step(states[vname], batch)
            jax.block_until_ready(states[vname])
            times[vname].append((time.perf_counter() - t0) / args.steps)
    for vname in names:
        result["variants"][vname]["median_step_s"] = statistics.median(times[vname])
        result["variants"][vname]["step_s"] = times[vname]
        ratios = [a / b for a, b in zip(times[vname], times["jit"], strict=True)]
        result["variants"][vname]["ratio_to_jit"] = statistics.median(ratios)
    return result


def print_table(results: list[dict]) -> None:
    header = (
        f"{'model':<12}{'params':>11}{'variant':>10}{'step ms':>10}{'/ jit':>8}"
        f"{'all-reduces':>13}{'AR MiB':>9}{'temp MiB':>10}"
    )
    print(header)
    print("-" * len(header))
    for res in results:
        for vname, v in res["variants"].items():
            print(
                f"{res['model']:<12}{res['params']:>11,}{vname:>10}"
                f"{1e3 * v['median_step_s']:>10.2f}{v['ratio_to_jit']:>8.3f}"
                f"{v['all_reduce_count']:>13}{v['all_reduce_bytes'] / 2**20:>9.2f}"
                f"{v['temp_bytes'] / 2**20:>10.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-per-device", type=int, default=8)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    setup_devices(args.devices)

    results = [run_model(m, args) for m in args.models.split(",")]
    print(
        f"\n{jax.device_count()} x {jax.devices()[0].platform} devices, "
        f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; median of {args.rounds} paired rounds x {args.steps} steps"
    )
    print_table(results)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {
            "jax": jax.__version__,
            "devices": jax.device_count(),
            "platform": jax.devices()[0].platform,
            "cores": os.cpu_count(),
            "argv": sys.argv,
            "args": vars(args),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
