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

5. ``--table``: issue 31's table, every row measured the same way in one run: fdp
   stages 0 and 1, stage 3 kept gathered and gathered per use, and plain-``jit``
   FSDP, each on the GPT with plain layers and with its blocks under ``nn.scan`` +
   ``nn.remat`` (scanned, plain-``jit`` FSDP also with its layer stacks split off
   the layer axis); compiled for 8 simulated CPU devices and, deviceless, for 8 x H100
   (``--platforms``). Per row: the peak and the collectives' bytes
   (``fdp.collective_stats``; a loop's collectives counted once) at ``--fsdp-dim``,
   then the largest width whose peak fits each of ``--table-budgets-gib`` (CPU;
   the GPU too with ``--gpu-budgets``), then the step time of stage 3 over stage 0
   on the CPU devices (interleaved rounds, median ratio). ``--rows`` and
   ``--layers`` pick some of the rows (each compile takes minutes on a loaded VM).

    python benchmarks/zero.py --json benchmarks/results/zero.json
    python benchmarks/zero.py --table --json benchmarks/results/zero_table.json
    python benchmarks/zero.py --table --layers scan --rows stage0 per-use jit-fsdp \\
        --platforms cpu --table-budgets-gib 1 --skip-timing
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

import flax.linen as nn
import jax

sys.path.insert(0, os.path.dirname(__file__))
from _models import Block, Transformer
from _progress import progress

STAGES = (0, 1, 2, 3)


def setup_devices(n: int) -> None:
    jax.config.update("jax_num_cpu_devices", n)


def bench_for(dim: int, depth: int, vocab: int, seq: int = 64, scanned: bool = False):
    """The GPT-style transformer of width ``dim``; ``scanned``: layers under nn.scan + nn.remat."""
    import optax
    from _models import Bench, _tokens

    cls = ScannedTransformer if scanned else Transformer
    model = cls(vocab=vocab, dim=dim, depth=depth, heads=max(1, dim // 64), seq=seq)
    return Bench(
        f"transformer d{dim} x{depth} v{vocab}" + (" scan+remat" if scanned else ""),
        model,
        _tokens(seq, vocab),
        lambda: optax.adam(1e-3),
    )


class _Layer(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x, _):
        return Block(self.dim, self.heads)(x), None


class ScannedTransformer(Transformer):
    """The benchmark transformer with its blocks under ``nn.scan`` of ``nn.remat``."""

    @nn.compact
    def __call__(self, tokens, train=True):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.dim))
        stack = nn.scan(
            nn.remat(_Layer),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
        )
        x, _ = stack(self.dim, self.heads)(x, None)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def abstract_state(bench, tx):
    import fdp

    def make():
        params = bench.init_params(0)
        return fdp.TrainState.create(apply_fn=None, params=params, tx=tx)

    return jax.eval_shape(make)


def first_divisible(shape, n: int):
    """The first dimension of ``shape`` that ``n`` divides, or None: plain jit FSDP's rule.

    The simplest FSDP layout to write by hand (a layer stack split along its layer
    axis). The plain jit rows use it, not fdp's rule, so that they stay the same
    baseline whatever layout fdp picks.
    """
    return next((d for d, size in enumerate(shape) if size % n == 0 and size >= n), None)


def simple_shardings(tree, mesh):
    """``tree``'s leaves' ``NamedSharding``s under :func:`first_divisible` over 'data'."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size

    def one(x):
        d = first_divisible(x.shape, n)
        return NamedSharding(mesh, P() if d is None else P(*([None] * d), "data"))

    return jax.tree.map(one, tree)


def with_shardings(state, stage, mesh, simple: bool = False):
    """Abstract state carrying the shardings fdp gives it at ``stage``.

    ``simple``: split by :func:`first_divisible` instead of fdp's rule (plain jit rows).
    """
    from fdp.step.layout import _zero

    def put(tree, sharded):
        rule = simple_shardings if simple else lambda t, m: _zero.shardings(t, m, "data")
        target = rule(tree, mesh) if sharded else _zero.replicated(tree, mesh)
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
    from fdp.step.layout import _zero

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
TABLE_MODES = (
    "stage 0",
    "stage 1",
    "stage 3, kept gathered",
    "stage 3, gathered per use",
    "stage 3, gathered per use, prefetch off",
    "plain jit FSDP",
    "plain jit FSDP, stacks split off the layer axis",
)
STAGE_OF = {"stage 0": 0, "stage 1": 1}
ROW_NAMES = dict(
    zip(
        (
            "stage0",
            "stage1",
            "kept",
            "per-use",
            "per-use-no-prefetch",
            "jit-fsdp",
            "jit-fsdp-off-layer",
        ),
        TABLE_MODES,
        strict=True,
    )
)
SCANNED_ONLY = ("plain jit FSDP, stacks split off the layer axis",)
LAYERS = {"plain": False, "scan": True}


def fdp_step(bench, mode: str, mesh=None, bucket_cap_mb: float | None = None):
    """fdp's step for ``mode``; "kept gathered" is ``reshard_after_forward=False``.

    "prefetch off" is ``prefetch=False``: on GPU each use gathered on its own (on CPU
    every per-use step gathers so). ``bucket_cap_mb``: the step's, where given (stage
    3 per use on GPU: the size of its gather groups).
    """
    import fdp

    sharding = fdp.Sharding(
        zero_stage=STAGE_OF.get(mode, 3),
        reshard_after_forward=mode != "stage 3, kept gathered",
        prefetch=mode != "stage 3, gathered per use, prefetch off",
    )
    reduction = (
        fdp.Reduction() if bucket_cap_mb is None else fdp.Reduction(bucket_cap_mb=bucket_cap_mb)
    )
    return fdp.train_step(bench.loss_fn, sharding=sharding, reduction=reduction, mesh=mesh)


def token_batch(mesh, rows: int, seq: int) -> dict:
    """Abstract token batch sharded over 'data' (nothing placed: works on a GPU mesh too)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tokens = jax.ShapeDtypeStruct(
        (rows, seq), jax.numpy.int32, sharding=NamedSharding(mesh, P("data"))
    )
    return {"x": tokens, "y": tokens}


def plain_fsdp_step(bench, donate: bool = True):
    """Plain ``jit``: parameters and Adam state sharded over 'data' (XLA SPMD), no fdp."""
    import optax

    tx = bench.tx()

    def step(params, opt_state, batch):
        grads = jax.grad(bench.loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def jitted(params, opt_state):
        shard = jax.tree.map(lambda x: x.sharding, (params, opt_state))
        return jax.jit(step, out_shardings=shard, donate_argnums=(0, 1) if donate else ())

    return jitted


def split_off_layer_axis(state, depth: int, mesh):
    """``state`` with each stacked leaf (leading dimension ``depth``) split along a later one.

    fdp's rule splits a leaf along its first dimension that the devices divide: a
    layer stack's layer axis. Under plain ``jit`` that leaves XLA to gather whole
    stacks for the loop; split along a later dimension (as MaxText shards a scanned
    model), each loop trip can gather its own layer.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size

    def split(x):
        if len(x.shape) < 2 or x.shape[0] != depth:
            return x
        d = first_divisible(x.shape[1:], n)
        spec = P() if d is None else P(*([None] * (d + 1)), "data")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return state.replace(
        params=jax.tree.map(split, state.params), opt_state=jax.tree.map(split, state.opt_state)
    )


def compile_mode(
    dim: int, mode: str, family: dict, mesh, scanned: bool = False, bucket_cap_mb=None
):
    """``(compiled step, parameter count)`` of ``mode`` on the family member of width ``dim``.

    Compile-only from abstract inputs carrying each mode's shardings, so the same
    code compiles for simulated CPU devices and for a deviceless GPU mesh.
    """
    from _models import param_count

    bench = bench_for(dim, family["depth"], family["vocab"], family["seq"], scanned)
    abstract = abstract_state(bench, bench.tx())
    batch = token_batch(mesh, family["per_device"] * mesh.devices.size, family["seq"])
    state = with_shardings(
        abstract, STAGE_OF.get(mode, 3), mesh, simple=mode.startswith("plain jit FSDP")
    )
    if mode in SCANNED_ONLY:
        state = split_off_layer_axis(state, family["depth"], mesh)
    if mode.startswith("plain jit FSDP"):
        jitted = plain_fsdp_step(bench)(state.params, state.opt_state)
        lowered = jitted.lower(state.params, state.opt_state, batch)
    else:
        lowered = fdp_step(bench, mode, mesh, bucket_cap_mb).lower(state, batch)
    return lowered.compile(), param_count(abstract.params)


def compiled_memory_of(lowered) -> dict[str, int]:
    """Compile-only memory per device; ``footprint`` = argument + output - alias + temp."""
    compiled = lowered.compile() if hasattr(lowered, "compile") else lowered
    mem = compiled.memory_analysis()
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


def fsdp_memory(
    dim: int, mode: str, family: dict, mesh=None, scanned: bool = False
) -> tuple[dict[str, int], int]:
    """(compiled memory, parameter count) of ``mode`` on the family member of width ``dim``."""
    import fdp

    compiled, params = compile_mode(dim, mode, family, mesh or fdp.data_mesh(), scanned)
    return compiled_memory_of(compiled), params


def largest_widths(
    measure, budgets: list[int], top: int = 64, known: dict | None = None
) -> list[dict]:
    """Per budget, the widest family member (width 64 k, k <= ``top``) whose peak fits.

    ``measure(k)`` -> ``(footprint, params)``, compiled once per k. The peak grows
    with the width, about quadratically (parameters ~ width squared); each probe
    is that quadratic's crossing of the budget fitted through the widths compiled
    so far, kept strictly inside the bracket (the widest that fits, the narrowest
    that does not), so each budget settles in a few compiles: every answer is a
    compiled fit and a compiled overflow one step wider.
    """
    import numpy as np

    seen: dict[int, tuple[int, int]] = dict(known or {})

    def at(k: int) -> int:
        if k not in seen:
            seen[k] = measure(k)
        return seen[k][0]

    out = []
    for budget in budgets:
        if not seen:
            at(8)
        while True:
            fits = [k for k in seen if seen[k][0] <= budget]
            over = [k for k in seen if seen[k][0] > budget]
            lo, hi = max(fits, default=0), min(over, default=top + 1)
            if hi - lo <= 1:
                break
            ks = sorted(seen)
            xs, ys = np.array(ks, float), np.array([seen[k][0] for k in ks], float)
            deg = min(2, len(ks) - 1)
            if deg == 0:  # one point: the peak taken as proportional to width squared
                guess = ks[0] * math.sqrt(budget / ys[0])
            else:
                roots = (np.poly1d(np.polyfit(xs, ys, deg)) - budget).roots
                real = [r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0]
                guess = max(real) if real else (lo + hi) / 2
            at(min(max(math.floor(guess), lo + 1), hi - 1))
        if lo == 0:
            out.append({"dim": 0, "params": 0, "footprint_bytes": seen[hi][0]})
        else:
            out.append({"dim": 64 * lo, "params": seen[lo][1], "footprint_bytes": seen[lo][0]})
    return out


def largest_width(mode: str, budget: int, family: dict) -> dict:
    def measure(k: int) -> tuple[int, int]:
        mem, params = fsdp_memory(64 * k, mode, family)
        return mem["footprint"], params

    best = largest_widths(measure, [budget], top=48)[0]
    assert best["dim"], f"nothing fits {budget} bytes: {mode}"
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
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    parser.add_argument("--table", action="store_true", help="issue 31's table only")
    parser.add_argument("--table-budgets-gib", type=float, nargs="*", default=[1.0, 2.0])
    parser.add_argument(
        "--platforms",
        nargs="+",
        default=["cpu", "gpu"],
        choices=["cpu", "gpu"],
        help="table: compile for simulated CPU devices, 8 x H100 (deviceless), or both",
    )
    parser.add_argument(
        "--gpu-budgets", action="store_true", help="table: search the budgets on GPU too (slow)"
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        default=list(ROW_NAMES),
        choices=list(ROW_NAMES),
        help="table: the approaches measured (jit-fsdp-off-layer: scanned only)",
    )
    parser.add_argument(
        "--layers",
        nargs="+",
        default=list(LAYERS),
        choices=list(LAYERS),
        help="table: plain layers, blocks under nn.scan + nn.remat, or both",
    )
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--timing-only", action="store_true", help="table: the step times only")
    parser.add_argument("--timing-dim", type=int, default=256, help="table: width timed")
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
    if args.table:

        def save(table: dict) -> None:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({**results, "table": table}, f, indent=1)

        if args.timing_only:
            save(
                {
                    "timing": time_modes(
                        args, {"depth": 8, "vocab": 8192, "seq": 256, "per_device": 2}
                    )
                }
            )
        else:
            table_part(args, save)
        return
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


# -- issue 31's table: every row measured the same way, CPU and GPU compile --------------


def table_part(args, save) -> dict:
    """Issue 31's table: peak at one width, largest model per budget, bytes, step time.

    In phases, each saved (``save(out)``) as it ends, since each compile takes
    minutes on a loaded machine: every row at ``--fsdp-dim`` on each platform;
    then each row's largest width per budget (CPU; GPU with ``--gpu-budgets``);
    then the step times.
    """
    import fdp

    family = {"depth": 8, "vocab": 8192, "seq": 256, "per_device": 2}
    budgets = [int(g * 2**30) for g in args.table_budgets_gib]
    platforms = {}
    if "cpu" in args.platforms:
        platforms["cpu"] = fdp.data_mesh()
    if "gpu" in args.platforms:
        from fdp.observe import gpu_mesh

        platforms["gpu"] = gpu_mesh("h100_sxm", args.devices)
    out: dict = {"family": family, "dim": args.fsdp_dim, "budgets": budgets, "rows": []}
    print(
        f"\nIssue 31's table: GPT x{family['depth']} v{family['vocab']} s{family['seq']}, "
        f"{family['per_device']} sequences per device, Adam, {args.devices} devices, "
        f"compile-only (peak = argument + output - alias + temp); width {args.fsdp_dim}"
    )
    for scanned in (LAYERS[name] for name in args.layers):
        for mode in (ROW_NAMES[name] for name in args.rows):
            if mode in SCANNED_ONLY and not scanned:
                continue
            row: dict = {"mode": mode, "model": "scan+remat" if scanned else "plain layers"}
            for name, mesh in platforms.items():
                start = time.perf_counter()
                compiled, params = compile_mode(args.fsdp_dim, mode, family, mesh, scanned)
                stats = fdp.collective_stats(compiled)
                row[name] = {
                    "params_at_dim": params,
                    "compiled": compiled_memory_of(compiled),
                    "sent_bytes": stats.sent_bytes(),
                    # those inside loops, counted once: a step runs them once per layer
                    "loop_sent_bytes": fdp.loop_collectives(compiled).sent_bytes(),
                    "collectives": {k: stats.count(k) for k in COLLECTIVE_KINDS},
                    "collective_bytes": {k: stats.nbytes(k) for k in COLLECTIVE_KINDS},
                    "seconds": time.perf_counter() - start,
                }
            out["rows"].append(row)
            print_table_row(row, platforms)
            save(out)
    if budgets:
        print(f"\nLargest width (steps of 64) whose peak fits {args.table_budgets_gib} GiB")
        for row in out["rows"]:
            for name, mesh in platforms.items():
                if name == "gpu" and not args.gpu_budgets:
                    continue
                probes = row[name].setdefault("probes", [])  # every width compiled

                def measure(
                    k,
                    mode=row["mode"],
                    mesh=mesh,
                    scanned=row["model"] != "plain layers",
                    probes=probes,
                ):
                    start = time.perf_counter()
                    c, p = compile_mode(64 * k, mode, family, mesh, scanned)
                    peak = compiled_memory_of(c)["footprint"]
                    seconds = time.perf_counter() - start
                    layers = "scan+remat" if scanned else "plain layers"
                    print(f"  {mode}, {layers}: width {64 * k}", end="", flush=True)
                    print(f" peak {mib(peak)} MiB ({seconds:.0f} s)", flush=True)
                    probes.append({"dim": 64 * k, "params": p, "footprint_bytes": peak})
                    return peak, p

                first = {
                    args.fsdp_dim // 64: (
                        row[name]["compiled"]["footprint"],
                        row[name]["params_at_dim"],
                    )
                }
                row[name]["largest"] = largest_widths(measure, budgets, known=first)
                print_table_row(row, {name: mesh})
                save(out)
    if not args.skip_timing:
        out["timing"] = time_modes(args, family)
        save(out)
    return out


COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def print_table_row(row: dict, platforms: dict) -> None:
    cells = [f"{row['mode']:<40}{row['model']:<13}"]
    for name in platforms:
        r = row[name]
        cells.append(f"{name} peak {mib(r['compiled']['footprint']):>8} MiB")
        for best in r.get("largest", []):
            cells.append(f"{best['params'] / 1e6:>7.1f}M")
        cells.append(f"sent {r['sent_bytes'] / 2**20:>7.1f} MiB")
    print("  ".join(cells), flush=True)


def time_modes(args, family: dict) -> dict:
    """Step time of stage 3 (both modes) over stage 0: interleaved rounds, median ratio."""
    import fdp

    modes = ("stage 0", "stage 3, gathered per use", "stage 3, kept gathered")
    bench = bench_for(args.timing_dim, family["depth"], family["vocab"], family["seq"])
    tx = bench.tx()
    batch = fdp.shard_batch(bench.make_batch(family["per_device"] * args.devices, 0))
    steps, states = {}, {}
    for mode in progress(modes, "compile modes"):
        steps[mode] = fdp_step(bench, mode)
        state = fdp.TrainState.create(apply_fn=None, params=bench.init_params(0), tx=tx)
        states[mode], _ = steps[mode](steps[mode].init(state), batch)  # compile
    jax.block_until_ready(states)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in progress(range(args.rounds), "rounds"):
        for mode in modes[r % 3 :] + modes[: r % 3]:
            start = time.perf_counter()
            for _ in range(args.steps):
                states[mode], metrics = steps[mode](states[mode], batch)
                jax.block_until_ready(metrics)
            times[mode].append((time.perf_counter() - start) / args.steps)
    out = {"dim": args.timing_dim, "rounds": args.rounds, "steps": args.steps, "modes": {}}
    print(f"\nstep time, GPT d{args.timing_dim}, {args.rounds} interleaved rounds x {args.steps}")
    for mode in modes:
        ratios = [t / t0 for t, t0 in zip(times[mode], times["stage 0"], strict=True)]
        out["modes"][mode] = {
            "median_s": statistics.median(times[mode]),
            "ratio_to_stage_0": statistics.median(ratios),
            "rounds_s": times[mode],
        }
        print(
            f"{mode:<27} {statistics.median(times[mode]) * 1e3:8.1f} ms  "
            f"x stage 0 {statistics.median(ratios):.3f}"
        )
    return out


if __name__ == "__main__":
    main()
