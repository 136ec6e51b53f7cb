"""fdp's step against plain JAX data parallelism, on simulated CPU devices.

Three ways to run the same data-parallel training step, timed in paired rounds in
one process (each round runs every variant, in rotating order):

  fdp       fdp.train_step (buckets reduced in place inside shard_map)
  fdp-flat  fdp.train_step(layout="flat"): DDP's packed bucket buffers
  jit     plain jax.jit with NamedSharding: XLA inserts the gradient all-reduce
  pmean   shard_map with one pmean per gradient leaf

For a model with BatchNorm (``cnn_bn``) all four compute the statistics of the global
batch (SyncBatchNorm, which is what GSPMD makes of a BatchNorm on a sharded batch; in
fdp ``nn.BatchNorm(axis_name='data')`` with ``buffers='mean'``), and a fifth variant,
``fdp-ddp-bn``, shows DDP's own BatchNorm: per-device statistics, buffers broadcast.

With ``--accumulate K`` (default 4) it adds gradient accumulation over K
micro-batches: ``fdp.train_step(accumulate_steps=K)`` against plain jit scanning over
stacked micro-batches (where GSPMD keeps an all-reduce inside the loop).

``nnx_mnist`` is Flax's official NNX MNIST example (``_nnx_mnist.py``: CNN with
BatchNorm and dropout, SGD with momentum, batch 128): ``fdp.nnx_train_step`` against
``nnx.jit`` with the batch sharded, and ``fdp-syncbn`` (global-batch statistics, as
GSPMD computes them for jit). Besides wall time it reports the process CPU time per
step (all threads), which other jobs on a shared machine disturb less.

For each model it reports the median step time, the time over the baseline's (jit,
or jit with accumulation; median of the per-round ratios), the all-reduces of the
compiled program (count, how many sit inside a loop, bytes), and the compiled temp
memory (``memory_analysis``) with its ratio to the baseline's.

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
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _progress import progress


def setup_devices(n: int) -> None:
    jax.config.update("jax_num_cpu_devices", n)


def build(bench, mesh, global_batch, bucket_cap_mb, accumulate):
    """name -> (step, batch, baseline name) for every variant."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import fdp

    variables = bench.init_variables(0)
    params = variables["params"]
    state = fdp.TrainState.create(
        apply_fn=None, params=params, tx=bench.tx(), batch_stats=variables.get("batch_stats")
    )
    batch = fdp.shard_batch(bench.make_batch(global_batch, 1), mesh)
    # With BatchNorm, every variant computes the same thing: statistics of the global
    # batch (SyncBatchNorm; GSPMD's reading of a BatchNorm on a sharded batch).
    spmd_loss, jit_loss = bench.loss_for(spmd=True), bench.loss_for(spmd=False)

    def grads_of(loss_fn, params, batch, stats):
        if stats is None:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            return loss, grads, None
        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, stats)
        return loss, grads, new_stats

    fdp_step = fdp.train_step(spmd_loss, mesh=mesh, bucket_cap_mb=bucket_cap_mb, buffers="mean")
    fdp_flat = fdp.train_step(
        spmd_loss, mesh=mesh, bucket_cap_mb=bucket_cap_mb, layout="flat", buffers="mean"
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def jit_step(state, batch):
        loss, grads, stats = grads_of(jit_loss, state.params, batch, state.batch_stats)
        return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss}

    def local_pmean(state, batch):
        params = jax.lax.pcast(state.params, "data", to="varying")
        loss, grads, stats = grads_of(spmd_loss, params, batch, state.batch_stats)
        grads = jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)
        stats = jax.tree.map(lambda s: jax.lax.pmean(s, "data"), stats)
        new = state.apply_gradients(grads=grads, batch_stats=stats)
        return new, {"loss": jax.lax.pmean(loss, "data")}

    pmean_step = jax.jit(
        jax.shard_map(local_pmean, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())),
        donate_argnums=0,
    )
    variants = {
        "fdp": (fdp_step, batch, "jit"),
        "fdp-flat": (fdp_flat, batch, "jit"),
        "jit": (jit_step, batch, "jit"),
        "pmean": (pmean_step, batch, "jit"),
    }
    if bench.has_stats:
        # DDP's own BatchNorm: per-device statistics, buffers broadcast from rank 0.
        variants["fdp-ddp-bn"] = (
            fdp.train_step(jit_loss, mesh=mesh, bucket_cap_mb=bucket_cap_mb),
            batch,
            "jit",
        )
    if accumulate > 1:
        k = accumulate
        big = bench.make_batch(global_batch * k, 1)
        fdp_acc = fdp.train_step(
            spmd_loss,
            mesh=mesh,
            bucket_cap_mb=bucket_cap_mb,
            accumulate_steps=k,
            buffers="mean",
        )

        # The plain-JAX way: micro-batches stacked on a leading axis, a scan that
        # sums gradients (and carries the statistics), GSPMD placing the all-reduce.
        @functools.partial(jax.jit, donate_argnums=0)
        def jit_acc(state, micro):
            def body(carry, mb):
                acc, loss_sum, stats = carry
                loss, g, stats = grads_of(jit_loss, state.params, mb, stats)
                return (jax.tree.map(jnp.add, acc, g), loss_sum + loss, stats), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (acc, loss, stats), _ = jax.lax.scan(body, (zeros, 0.0, state.batch_stats), micro)
            grads = jax.tree.map(lambda a: a / k, acc)
            return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss / k}

        micro = jax.tree.map(
            lambda x: jax.device_put(
                x.reshape(k, global_batch, *x.shape[1:]), NamedSharding(mesh, P(None, "data"))
            ),
            big,
        )
        variants[f"fdp K={k}"] = (fdp_acc, fdp.shard_batch(big, mesh), f"jit K={k}")
        variants[f"jit K={k}"] = (jit_acc, micro, f"jit K={k}")
    return variants, state, params


def analyse(step, state, batch) -> dict:
    import fdp

    compiled = step.lower(state, batch).compile()
    stats = fdp.collective_stats(compiled)
    mem = compiled.memory_analysis()
    return {
        "all_reduce_count": stats.count("all-reduce"),
        "all_reduce_bytes": stats.nbytes("all-reduce"),
        "loop_all_reduces": fdp.loop_collectives(compiled).count("all-reduce"),
        "other_collectives": {k: v for k, v in stats.summary().items() if k != "all-reduce"},
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }


def run_nnx_mnist(args: argparse.Namespace) -> dict:
    """The official NNX MNIST example: fdp's NNX step against nnx.jit + NamedSharding."""
    import _nnx_mnist

    import fdp

    mesh = fdp.data_mesh()
    variants = _nnx_mnist.build(mesh, args.nnx_dropout)
    result: dict = {
        "model": "nnx_mnist",
        "params": 0,
        "global_batch": _nnx_mnist.BATCH,
        "dropout": args.nnx_dropout,
        "variants": {},
    }
    for vname, (call, lower, state) in variants.items():
        compiled = lower().compile()
        stats = fdp.collective_stats(compiled)
        result["variants"][vname] = {
            "all_reduce_count": stats.count("all-reduce"),
            "all_reduce_bytes": stats.nbytes("all-reduce"),
            "loop_all_reduces": fdp.loop_collectives(compiled).count("all-reduce"),
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "ops": hlo_op_counts(compiled.as_text()),
        }
        result["params"] = result["params"] or sum(
            int(np.prod(x.shape)) for x in jax.tree.leaves(state()) if hasattr(x, "shape")
        )
        for _ in range(args.warmup):
            call()
        jax.block_until_ready(state())
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    for r in range(args.rounds):
        for vname in names[r % len(names) :] + names[: r % len(names)]:
            call, _, state = variants[vname]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                call()
            jax.block_until_ready(state())
            times[vname].append((time.perf_counter() - t0) / args.steps)
            cpu[vname].append((time.process_time() - c0) / args.steps)
    for vname, v in result["variants"].items():
        v["median_step_s"] = statistics.median(times[vname])
        v["step_s"] = times[vname]
        v["cpu_s"] = cpu[vname]
        v["baseline"] = "jit"
        v["ratio_to_baseline"] = statistics.median(
            a / b for a, b in zip(times[vname], times["jit"], strict=True)
        )
        v["cpu_ratio_to_baseline"] = statistics.median(
            a / b for a, b in zip(cpu[vname], cpu["jit"], strict=True)
        )
        v["temp_vs_baseline"] = v["temp_bytes"] / max(result["variants"]["jit"]["temp_bytes"], 1)
    return result


def hlo_op_counts(text: str) -> dict[str, int]:
    """How many instructions of each opcode a compiled HLO module has."""
    import collections
    import re

    ops = re.findall(r"^\s*(?:ROOT )?%\S+ = (?:\([^=]*?\)|\S+) ([a-z][\w\-]*)\(", text, re.M)
    return dict(collections.Counter(ops))


def run_model(name: str, args: argparse.Namespace) -> dict:
    from _models import BENCHES, param_count

    import fdp

    if name == "nnx_mnist":
        return run_nnx_mnist(args)

    bench = BENCHES[name]
    mesh = fdp.data_mesh()
    n = mesh.shape["data"]
    global_batch = args.batch_per_device * n
    variants, state, params = build(bench, mesh, global_batch, args.bucket_cap_mb, args.accumulate)
    states = {v: fdp.replicate(state, mesh) for v in variants}

    result = {
        "model": name,
        "params": param_count(params),
        "global_batch": global_batch,
        "variants": {},
    }
    for vname, (step, batch, _) in progress(variants.items(), f"{name}: compile"):
        result["variants"][vname] = analyse(step, states[vname], batch)
        for _ in range(args.warmup):
            states[vname], _ = step(states[vname], batch)
        jax.block_until_ready(states[vname])

    times: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    for r in progress(range(args.rounds), f"{name}: rounds"):
        order = names[r % len(names) :] + names[: r % len(names)]
        for vname in order:
            step, batch, _ = variants[vname]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                states[vname], _ = step(states[vname], batch)
            jax.block_until_ready(states[vname])
            times[vname].append((time.perf_counter() - t0) / args.steps)
    for vname, (_, _, base) in variants.items():
        v = result["variants"][vname]
        v["median_step_s"] = statistics.median(times[vname])
        v["step_s"] = times[vname]
        v["baseline"] = base
        ratios = [a / b for a, b in zip(times[vname], times[base], strict=True)]
        v["ratio_to_baseline"] = statistics.median(ratios)
        v["temp_vs_baseline"] = v["temp_bytes"] / max(result["variants"][base]["temp_bytes"], 1)
    return result


def print_table(results: list[dict]) -> None:
    header = (
        f"{'model':<12}{'params':>11}{'variant':>11}{'step ms':>10}{'/ base':>8}"
        f"{'all-reduces':>13}{'in loop':>9}{'AR MiB':>9}{'temp MiB':>10}{'temp/base':>11}"
    )
    print(header)
    print("-" * len(header))
    for res in results:
        for vname, v in res["variants"].items():
            print(
                f"{res['model']:<12}{res['params']:>11,}{vname:>11}"
                f"{1e3 * v['median_step_s']:>10.2f}{v['ratio_to_baseline']:>8.3f}"
                f"{v['all_reduce_count']:>13}{v['loop_all_reduces']:>9}"
                f"{v['all_reduce_bytes'] / 2**20:>9.2f}{v['temp_bytes'] / 2**20:>10.2f}"
                f"{v['temp_vs_baseline']:>11.3f}"
                + (
                    f"  cpu/base {v['cpu_ratio_to_baseline']:.3f}"
                    if "cpu_ratio_to_baseline" in v
                    else ""
                )
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn_bn,transformer")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-per-device", type=int, default=8)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--accumulate",
        type=int,
        default=4,
        help="also compare gradient accumulation over this many micro-batches (1: skip)",
    )
    parser.add_argument(
        "--nnx-dropout", type=float, default=0.025, help="nnx_mnist's dropout rate (0: off)"
    )
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
