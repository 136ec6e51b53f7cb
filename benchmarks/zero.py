"""ZeRO stages 0-3 side by side: what each device holds, compiled memory, step time.

On 8 simulated CPU devices, for each ZeRO stage of ``fdp.train_step`` (Adam/AdamW):

1. Memory, per device: bytes of parameters and optimizer state between steps and of
   the reduced gradients (the step's output of the reduction), and the compiled
   temp memory (``memory_analysis``), each with its ratio to stage 0. For the
   benchmark transformer (~13M parameters) the state is built and trained, and the
   bytes are summed from device 0's addressable shards. For the large transformer
   (>= 100M parameters) nothing is allocated: the step is compiled for abstract
   arrays carrying each stage's shardings, and bytes come from each sharding's
   shard shape (the same figure; checked equal on the small model). Stage 0 of the
   large model would need ~15 GiB for 8 simulated replicas on this 24 GiB machine.
2. Step time of the small transformer: paired rounds, each running every stage in
   rotating order; the median step time and the median per-round ratio to stage 0.
3. The largest Adam transformer (width bisected, depth 4) whose compiled per-device
   footprint (arguments + outputs not aliased to them + temp) fits a budget
   (default 2 GiB), per stage.
4. Stage 3's two modes against stage 0 and plain-``jit`` FSDP on issue 31's
   GPT-style model (8 layers, vocabulary 8192, sequence 256, 2 sequences per
   device, Adam), compile-only: the per-device peak (argument + output - alias +
   temp) of each, all in the same run, and the largest width of the family that
   fits ``--fsdp-budget-gib`` (default 1 GiB) for each.

    python benchmarks/zero.py --json benchmarks/results/zero.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
from _progress import progress

STAGES = (0, 1, 2, 3)


def setup_devices(n: int) -> None:
    jax.config.update("jax_num_cpu_devices", n)


def bench_for(dim: int, depth: int, vocab: int, seq: int = 64):
    import optax
    from _models import Bench, Transformer, _tokens

    model = Transformer(vocab=vocab, dim=dim, depth=depth, heads=max(1, dim // 64), seq=seq)
    return Bench(
        f"transformer d{dim} x{depth} v{vocab}",
        model,
        _tokens(seq, vocab),
        lambda: optax.adam(1e-3),
    )


def abstract_state(bench, tx):
    import fdp

    def make():
        params = bench.init_params(0)
        return fdp.TrainState.create(apply_fn=None, params=params, tx=tx)

    return jax.eval_shape(make)


def with_shardings(state, stage, mesh):
    """Abstract state carrying the shardings fdp gives it at ``stage``."""
    from fdp.step import _zero

    def put(tree, sharded):
        target = _zero.shardings(tree, mesh, "data") if sharded else _zero.replicated(tree, mesh)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, target
        )

    return state.replace(
        step=put(state.step, False),
        params=put(state.params, stage >= 3),
        opt_state=put(state.opt_state, stage >= 1),
    )


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of arrays or structs carrying a sharding."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def addressable_bytes(tree) -> int:
    device = jax.devices()[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


def grad_bytes(params, stage: int, n: int) -> int:
    from fdp.step import _zero

    return _zero.held_bytes(params, n, sharded=stage >= 1).per_device  # scattered from 1


def compiled_memory(step, state, batch) -> dict[str, int]:
    return compiled_memory_of(step.lower(state, batch))


def memory_rows(bench, batch_rows: int, materialise: bool, n: int) -> dict[int, dict]:
    import fdp

    mesh = fdp.data_mesh()
    tx = bench.tx()
    abstract = abstract_state(bench, tx)
    batch = fdp.shard_batch(bench.make_batch(batch_rows, 0))
    rows = {}
    for stage in STAGES:
        step = fdp.train_step(bench.loss_fn, zero_stage=stage)
        if materialise:
            state = step.init(
                fdp.TrainState.create(apply_fn=None, params=bench.init_params(0), tx=tx)
            )
            state, _ = step(state, batch)
            jax.block_until_ready(state)
            params_b, opt_b = addressable_bytes(state.params), addressable_bytes(state.opt_state)
            assert (params_b, opt_b) == (
                shard_bytes(state.params),
                shard_bytes(state.opt_state),
            ), "addressable shards and shard shapes disagree"
            del state
        else:
            state = with_shardings(abstract, stage, mesh)
            params_b, opt_b = shard_bytes(state.params), shard_bytes(state.opt_state)
        mem = compiled_memory(step, with_shardings(abstract, stage, mesh), batch)
        rows[stage] = {
            "params_bytes": params_b,
            "grads_bytes": grad_bytes(abstract.params, stage, n),
            "opt_state_bytes": opt_b,
            "compiled": mem,
        }
    return rows


def time_stages(bench, batch_rows: int, rounds: int, steps: int) -> dict[int, dict]:
    import fdp

    tx = bench.tx()
    batch = fdp.shard_batch(bench.make_batch(batch_rows, 0))
    steps_fn, states = {}, {}
    for stage in progress(STAGES, "compile stages"):
        steps_fn[stage] = fdp.train_step(bench.loss_fn, zero_stage=stage)
        state = fdp.TrainState.create(apply_fn=None, params=bench.init_params(0), tx=tx)
        states[stage], _ = steps_fn[stage](steps_fn[stage].init(state), batch)  # compile
    jax.block_until_ready(states)
    times: dict[int, list[float]] = {s: [] for s in STAGES}
    for r in progress(range(rounds), "rounds"):
        order = STAGES[r % 4 :] + STAGES[: r % 4]
        for stage in order:
            start = time.perf_counter()
            for _ in range(steps):
                states[stage], metrics = steps_fn[stage](states[stage], batch)
                jax.block_until_ready(metrics)  # XLA:CPU aborts long queues of steps
            times[stage].append((time.perf_counter() - start) / steps)
    out = {}
    for stage in STAGES:
        ratios = [t / t0 for t, t0 in zip(times[stage], times[0], strict=True)]
        out[stage] = {
            "median_s": statistics.median(times[stage]),
            "ratio_to_stage_0": statistics.median(ratios),
            "rounds_s": times[stage],
        }
    return out


def footprint(dim: int, stage: int, budget_model: dict) -> tuple[int, int]:
    """(compiled per-device footprint, parameter count) of the family member of ``dim``."""
    from _models import param_count

    import fdp

    bench = bench_for(dim, budget_model["depth"], budget_model["vocab"])
    abstract = abstract_state(bench, bench.tx())
    step = fdp.train_step(bench.loss_fn, zero_stage=stage)
    batch = fdp.shard_batch(bench.make_batch(budget_model["batch"], 0))
    mem = compiled_memory(step, with_shardings(abstract, stage, fdp.data_mesh()), batch)
    return mem["footprint"], param_count(abstract.params)


def largest_in_budget(budget: int, budget_model: dict) -> dict[int, dict]:
    out = {}
    for stage in STAGES:
        lo, hi = 1, 64  # dim = 64 * k
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            used, params = footprint(64 * mid, stage, budget_model)
            if used <= budget:
                best, lo = (64 * mid, params, used), mid + 1
            else:
                hi = mid - 1
        assert best is not None, f"nothing fits {budget} bytes at stage {stage}"
        out[stage] = {"dim": best[0], "params": best[1], "footprint_bytes": best[2]}
    return out


# -- stage 3's modes against plain jit FSDP (issue 31) ------------------------------------

FSDP_MODES = ("stage 0", "stage 3, kept gathered", "stage 3, gathered per use", "plain jit FSDP")


def fdp_step(bench, mode: str):
    """fdp's step for ``mode``; "kept gathered" is ``reshard_after_forward=False``."""
    import fdp

    sharding = fdp.Sharding(
        zero_stage=0 if mode == "stage 0" else 3,
        reshard_after_forward=mode != "stage 3, kept gathered",
    )
    step = fdp.train_step(bench.loss_fn, sharding=sharding)
    return step


def plain_fsdp_memory(bench, abstract, batch_rows: int, mesh) -> dict[str, int]:
    """Plain ``jit``: parameters and Adam state sharded over 'data' (XLA SPMD), no fdp."""
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tx = bench.tx()
    sharded = with_shardings(abstract, 3, mesh)
    params, opt_state = sharded.params, sharded.opt_state
    rows = jax.ShapeDtypeStruct(
        (batch_rows, bench.make_batch(1, 0)["x"].shape[1]),
        jax.numpy.int32,
        sharding=NamedSharding(mesh, P("data")),
    )
    batch = {"x": rows, "y": rows}
    shard = jax.tree.map(lambda x: x.sharding, (params, opt_state))

    def step(params, opt_state, batch):
        grads = jax.grad(bench.loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(step, out_shardings=shard, donate_argnums=(0, 1))
    return compiled_memory_of(jitted.lower(params, opt_state, batch))


def compiled_memory_of(lowered) -> dict[str, int]:
    mem = lowered.compile().memory_analysis()
    return {
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
        "footprint": int(
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        ),
    }


def fsdp_memory(dim: int, mode: str, family: dict) -> tuple[dict[str, int], int]:
    """(compiled memory, parameter count) of ``mode`` on the family member of width ``dim``."""
    from _models import param_count

    import fdp

    bench = bench_for(dim, family["depth"], family["vocab"], family["seq"])
    abstract = abstract_state(bench, bench.tx())
    mesh = fdp.data_mesh()
    rows = family["per_device"] * len(mesh.devices.flat)
    if mode == "plain jit FSDP":
        return plain_fsdp_memory(bench, abstract, rows, mesh), param_count(abstract.params)
    stage = 0 if mode == "stage 0" else 3
    batch = fdp.shard_batch(bench.make_batch(rows, 0))
    step = fdp_step(bench, mode)
    mem = compiled_memory_of(step.lower(with_shardings(abstract, stage, mesh), batch))
    return mem, param_count(abstract.params)


def largest_width(mode: str, budget: int, family: dict) -> dict:
    lo, hi, best = 1, 48, None  # width = 64 * k
    while lo <= hi:
        mid = (lo + hi) // 2
        mem, params = fsdp_memory(64 * mid, mode, family)
        if mem["footprint"] <= budget:
            best, lo = (
                {"dim": 64 * mid, "params": params, "footprint_bytes": mem["footprint"]},
                mid + 1,
            )
        else:
            hi = mid - 1
    assert best is not None, f"nothing fits {budget} bytes: {mode}"
    return best


def mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def print_memory(name: str, params: int, rows: dict[int, dict]) -> None:
    base = rows[0]
    print(f"\n{name}: {params / 1e6:.1f}M parameters, Adam, 8 devices; MiB per device (ratio)")
    head = f"{'stage':>5}  {'params':>16}  {'grads':>16}  {'opt state':>16}  {'temp':>16}"
    print(head)
    print("-" * len(head))
    for stage, r in rows.items():
        cells = [
            (r["params_bytes"], base["params_bytes"]),
            (r["grads_bytes"], base["grads_bytes"]),
            (r["opt_state_bytes"], base["opt_state_bytes"]),
            (r["compiled"]["temp"], base["compiled"]["temp"]),
        ]
        text = "  ".join(f"{mib(v):>9} ({v / b:.3f})" for v, b in cells)
        print(f"{stage:>5}  {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences of 64)")
    parser.add_argument("--large-dim", type=int, default=1024)
    parser.add_argument("--large-depth", type=int, default=6)
    parser.add_argument("--large-vocab", type=int, default=16384)
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--skip-budget", action="store_true")
    parser.add_argument("--fsdp-dim", type=int, default=512, help="width of the GPT of part 4")
    parser.add_argument("--fsdp-budget-gib", type=float, default=1.0)
    parser.add_argument("--only-fsdp", action="store_true", help="run part 4 only")
    parser.add_argument("--skip-fsdp-budget", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    setup_devices(args.devices)

    from _models import BENCHES, param_count

    import fdp

    n = args.devices
    small = BENCHES["transformer"]
    large = bench_for(args.large_dim, args.large_depth, args.large_vocab)
    results: dict = {
        "jax": jax.__version__,
        "fdp": fdp.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {n} simulated CPU devices",
    }
    results["fsdp"] = fsdp_part(args)
    if args.only_fsdp:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    for key, bench, materialise in (("transformer", small, True), ("large", large, False)):
        params = param_count(jax.eval_shape(lambda b=bench: b.init_params(0)))
        rows = memory_rows(bench, args.batch, materialise, n)
        results[key] = {"name": bench.name, "params": params, "stages": rows}
        print_memory(bench.name, params, rows)

    timing = time_stages(small, args.batch, args.rounds, args.steps)
    results["transformer"]["timing"] = timing
    print(f"\n{small.name} step time, {args.rounds} rounds x {args.steps} steps")
    print(f"{'stage':>5}  {'median ms':>10}  {'x stage 0':>9}")
    for stage, t in timing.items():
        print(f"{stage:>5}  {t['median_s'] * 1e3:10.1f}  {t['ratio_to_stage_0']:9.3f}")

    if not args.skip_budget:
        budget = int(args.budget_gib * 2**30)
        family = {"depth": 4, "vocab": 8192, "batch": args.batch}
        fits = largest_in_budget(budget, family)
        results["budget"] = {"bytes": budget, "family": family, "stages": fits}
        print(
            f"\nLargest Adam transformer (depth 4, vocab 8192, width in steps of 64) whose "
            f"compiled per-device footprint fits {args.budget_gib:g} GiB, 8 devices"
        )
        head = ("stage", "width", "parameters", "footprint MiB", "x stage 0")
        print("  ".join(f"{h:>{w}}" for h, w in zip(head, (5, 6, 11, 13, 9), strict=True)))
        for stage, f in fits.items():
            ratio = f["params"] / fits[0]["params"]
            print(
                f"{stage:>5}  {f['dim']:>6}  {f['params'] / 1e6:>10.1f}M  "
                f"{mib(f['footprint_bytes']):>13}  {ratio:9.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def fsdp_part(args) -> dict:
    family = {"depth": 8, "vocab": 8192, "seq": 256, "per_device": 2}
    out: dict = {"family": family, "dim": args.fsdp_dim, "modes": {}}
    print(
        f"\nGPT d{args.fsdp_dim} x{family['depth']} v{family['vocab']} s{family['seq']}, "
        f"{family['per_device']} sequences per device, Adam, {args.devices} devices, "
        "compile-only; MiB per device"
    )
    head = ("mode", "params", "argument", "output", "alias", "temp", "peak")
    print(f"{head[0]:<27}" + "".join(f"{h:>10}" for h in head[1:]))
    for mode in progress(FSDP_MODES, "modes"):
        mem, params = fsdp_memory(args.fsdp_dim, mode, family)
        out["modes"][mode] = {"params": params, "compiled": mem}
        cells = [mem[k] for k in ("argument", "output", "alias", "temp", "footprint")]
        print(f"{mode:<27}{params / 1e6:>9.1f}M" + "".join(f"{mib(c):>10}" for c in cells))
    if not args.skip_fsdp_budget:
        budget = int(args.fsdp_budget_gib * 2**30)
        out["budget"] = {"bytes": budget, "modes": {}}
        print(f"\nLargest width (steps of 64) whose peak fits {args.fsdp_budget_gib:g} GiB/device")
        for mode in progress(FSDP_MODES, "budget"):
            best = largest_width(mode, budget, family)
            out["budget"]["modes"][mode] = best
            print(
                f"{mode:<27} width {best['dim']:>5}  {best['params'] / 1e6:>7.1f}M parameters  "
                f"peak {mib(best['footprint_bytes'])} MiB"
            )
    return out


if __name__ == "__main__":
    main()
