"""Step time of fdp's step against plain jit + NamedSharding, on the GPUs at hand.

Run on a machine with one or more GPUs (it refuses a CPU-only machine). For each model
of ``gpu_programs.py`` (an MLP, a VGG-style CNN and a GPT-style decoder of 104-138M
parameters, Adam, float32 parameters) and each accumulation setting, it builds:

  jit   plain ``jax.jit`` with the state replicated and the batch sharded over the
        mesh's ``'data'`` axis (``gpu_programs.plain_jit``: with accumulation, a
        ``lax.scan`` over the micro-batches)
  fdp   ``fdp.train_step`` with its defaults on that mesh

and, with ``--variants``, fdp's ZeRO stage 3 gathered per use (``zero3``: on GPU in
groups of ``bucket_cap_mb``, each prefetched one group ahead; ``zero3-no-prefetch``:
``fdp.Sharding(prefetch=False)``, each use gathered on its own). On one GPU nothing is
gathered or scattered, so those rows time what the per-use structure itself costs (the
ties and tokens that order the gathers, the compiler options that group them); and
a tiny 5-layer MLP (width 32) where the host's work per call dominates.

Each variant gets its own copy of the same initial state and the same batches
(random, not zeros). Timing is interleaved: every round times ``--steps`` steps of
each variant in rotating order (one wait at the end of each variant's run, so steps
queue as in training; the tiny model waits for every step, as ``host_overhead.py``
does); the table gives the median ms per step and the median of the per-round ratios
fdp / jit. Before timing, three steps of both from the same state on the same batches
are compared: the losses and the parameters' largest relative difference.

Memory is the compiled programs' ``memory_analysis()`` on this device (temp and peak =
arguments + outputs - aliased + temp), fdp / jit.

    python benchmarks/gpu_step_time.py --json benchmarks/results/gpu_step_time.json
    python benchmarks/gpu_step_time.py --models mlp,gpt --variants fdp zero3 zero3-no-prefetch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
import gpu_programs as gp

import fdp

MiB = 1024 * 1024


class Tiny(gp.nn.Module):
    @gp.nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = gp.nn.relu(gp.nn.Dense(32)(x))
        return gp.nn.Dense(10)(x)


def models():
    """name -> (model, example shape, input dtype, rows per device, classes)."""
    chosen = dict(gp.models(1))
    chosen["tiny"] = (Tiny(), (16,), jnp.float32, 16, 10)
    return chosen


def real_state(model, shape, dtype, mesh, tx=None):
    params = model.init(jax.random.key(0), jnp.zeros((1, *shape), dtype))["params"]
    tx = optax.adam(1e-4) if tx is None else tx
    state = fdp.TrainState.create(apply_fn=None, params=params, tx=tx)
    return fdp.replicate(state, mesh)


def real_batches(shape, dtype, rows, classes, mesh, tokens, count):
    rng = np.random.default_rng(0)
    data = NamedSharding(mesh, P("data"))
    out = []
    for _ in range(count):
        if tokens:
            x = rng.integers(0, classes, size=(rows, *shape)).astype(np.int32)
            y = rng.integers(0, classes, size=(rows, *shape)).astype(np.int32)
        else:
            x = rng.normal(size=(rows, *shape)).astype(np.dtype(dtype))
            y = rng.integers(0, classes, size=(rows,)).astype(np.int32)
        out.append(jax.device_put({"x": x, "y": y}, data))
    return out


def copy(tree):
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def memory(compiled):
    m = compiled.memory_analysis()
    if m is None:
        return None
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return {"temp_mib": m.temp_size_in_bytes / MiB, "peak_mib": peak / MiB}


#: fdp variant -> its ``fdp.Sharding`` (None: the default, stage 0).
VARIANTS = {
    "fdp": None,
    "zero3": fdp.Sharding(zero_stage=3),
    "zero3-no-prefetch": fdp.Sharding(zero_stage=3, prefetch=False),
}


def fdp_step(loss_fn, mesh, accumulate, variant):
    accumulation = fdp.Accumulation(steps=accumulate)
    return fdp.train_step(loss_fn, mesh=mesh, accumulation=accumulation, sharding=VARIANTS[variant])


class Runner:
    """One variant: a compiled step, its own state, and how to call it."""

    def __init__(self, name, compiled, state, loss_of):
        self.name, self.compiled, self.state, self.loss_of = name, compiled, state, loss_of

    def step(self, batch):
        self.state, out = self.compiled(self.state, batch)
        return out

    def time(self, batches, steps, wait_each):
        start = time.perf_counter()
        out = None
        for i in range(steps):
            out = self.step(batches[i % len(batches)])
            if wait_each:
                jax.block_until_ready(out)
        jax.block_until_ready((out, self.state))
        return (time.perf_counter() - start) / steps * 1e3


def params_rel_diff(a, b):
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return worst


def run_model(name, accumulate, mesh, args):
    model, shape, dtype, per_device, classes = models()[name]
    tokens = name == "gpt"
    rows = per_device * mesh.shape["data"]
    loss_fn = gp.loss_for(model, tokens)
    state = real_state(model, shape, dtype, mesh)
    batches = real_batches(shape, dtype, rows, classes, mesh, tokens, count=3)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))

    t0 = time.perf_counter()
    jit_compiled = gp.plain_jit(loss_fn, state, batches[0], mesh, accumulate)
    compile_s = {"jit": time.perf_counter() - t0}
    runners = [Runner("jit", jit_compiled, copy(state), lambda out: out)]
    mem = {"jit": memory(jit_compiled)}
    for variant in args.variants:
        t0 = time.perf_counter()
        step = fdp_step(loss_fn, mesh, accumulate, variant)
        mem[variant] = memory(step.lower(state, batches[0]).compile())
        compile_s[variant] = time.perf_counter() - t0
        runners.append(Runner(variant, step, copy(state), lambda out: out["loss"]))

    # Same state, same batches: three steps of each, then compare with plain jit.
    losses = {r.name: [] for r in runners}
    for b in batches:
        for r in runners:
            losses[r.name].append(float(r.loss_of(r.step(b))))
    diff = {r.name: params_rel_diff(r.state.params, runners[0].state.params) for r in runners[1:]}

    wait_each = name == "tiny"
    steps = args.steps * (10 if wait_each else 1)
    for r in runners:  # warm-up
        r.time(batches, 3, wait_each)
    rounds = {r.name: [] for r in runners}
    for i in range(args.rounds):
        shift = i % len(runners)
        for r in runners[shift:] + runners[:shift]:
            rounds[r.name].append(r.time(batches, steps, wait_each))
    ratios = {
        v: statistics.median(f / j for f, j in zip(rounds[v], rounds["jit"], strict=True))
        for v in args.variants
    }
    row = {
        "model": name,
        "parameters": n_params,
        "global_rows": rows,
        "accumulate_steps": accumulate,
        "devices": mesh.size,
        "ms_per_step": {k: statistics.median(v) for k, v in rounds.items()},
        "rounds_ms": rounds,
        "ratio_over_jit": ratios,
        "losses": losses,
        "params_max_rel_diff_after_3_steps": diff,
        "memory": mem,
        "compile_s": compile_s,
        "steps_per_round": steps,
    }
    if "fdp" in ratios:  # the name earlier JSONs used
        row["ratio_fdp_over_jit"] = ratios["fdp"]
    del runners, state
    return row


def tree_norm(tree):
    return float(
        np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
    )


def check_model(name, accumulate, mesh, variants=("fdp",), steps=3):
    """fdp against plain jit in float32 (matmul precision "highest"), SGD, same batches.

    Returns the difference of the parameters after ``steps`` steps relative to the
    size of the update (norm(fdp - jit) / norm(jit - start)), and the same for plain jit
    run twice (the device's run-to-run floor: GPU reductions by atomics, such as an
    embedding's scatter-add, need not repeat bit for bit).
    """
    model, shape, dtype, per_device, classes = models()[name]
    tokens = name == "gpt"
    loss_fn = gp.loss_for(model, tokens)
    state = real_state(model, shape, dtype, mesh, tx=optax.sgd(0.1))
    batches = real_batches(
        shape, dtype, per_device * mesh.shape["data"], classes, mesh, tokens, steps
    )
    start = jax.tree.map(np.asarray, state.params)
    with jax.default_matmul_precision("highest"):
        jit_compiled = gp.plain_jit(loss_fn, state, batches[0], mesh, accumulate)
        runs = {
            "jit": Runner("jit", jit_compiled, copy(state), float),
            "jit_again": Runner("jit", jit_compiled, copy(state), float),
        }
        for v in variants:
            step = fdp_step(loss_fn, mesh, accumulate, v)
            runs[v] = Runner(v, step, copy(state), lambda out: float(out["loss"]))
        losses = {k: [r.loss_of(r.step(b)) for b in batches] for k, r in runs.items()}
    ref = runs["jit"].state.params
    update = tree_norm(jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, ref, start))

    def rel(other):
        return (
            tree_norm(
                jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b), other, ref)
            )
            / update
        )

    return {
        "model": name,
        "accumulate_steps": accumulate,
        "losses": losses,
        **{f"{v}_vs_jit": rel(runs[v].state.params) for v in variants},
        "jit_vs_jit": rel(runs["jit_again"].state.params),
    }


def print_row(r):
    ms, mem = r["ms_per_step"], r["memory"]
    head = f"{r['model']:5} {r['parameters'] / 1e6:7.1f}M acc={r['accumulate_steps']}"
    print(f"{head} | jit {ms['jit']:9.3f} ms/step | loss3 {r['losses']['jit'][-1]:.6f}", flush=True)
    for v, ratio in r["ratio_over_jit"].items():
        temp = ""
        if mem["jit"] and mem[v]:
            tj, tf = mem["jit"]["temp_mib"], mem[v]["temp_mib"]
            pj, pf = mem["jit"]["peak_mib"], mem[v]["peak_mib"]
            temp = f"| temp MiB {tf:9.1f} / {tj:9.1f} | peak MiB {pf:9.1f} / {pj:9.1f}"
        print(
            f"{'':5} {v:>18} {ms[v]:9.3f} ms/step, / jit {ratio:.3f} "
            f"| loss3 {r['losses'][v][-1]:.6f} "
            f"| params rel diff {r['params_max_rel_diff_after_3_steps'][v]:.1e} {temp}",
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,mlp,cnn,gpt")
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["fdp"],
        choices=list(VARIANTS),
        help="fdp steps timed against plain jit (default: fdp)",
    )
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--check", action="store_true", help="only the float32 agreement check")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke-test on the CPU")
    args = parser.parse_args()
    devices = jax.devices()
    if devices[0].platform != "gpu" and not args.allow_cpu:
        sys.exit(f"gpu_step_time.py times GPUs; this machine's devices are {devices}")
    mesh = Mesh(np.array(devices), ("data",))
    info = {
        "device": devices[0].device_kind,
        "devices": len(devices),
        "jax": jax.__version__,
        "fdp": fdp.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(info), flush=True)
    rows, failures = [], []
    for name in args.models.split(","):
        for accumulate in args.accumulate if name != "tiny" else [1]:
            try:
                if args.check:
                    rows.append(check_model(name, accumulate, mesh, args.variants))
                    r = rows[-1]
                    vs = " ".join(f"| {v} vs jit {r[f'{v}_vs_jit']:.2e}" for v in args.variants)
                    print(
                        f"check {name:5} acc={accumulate} {vs} "
                        f"| jit vs jit {r['jit_vs_jit']:.2e} | losses {r['losses']}",
                        flush=True,
                    )
                else:
                    rows.append(run_model(name, accumulate, mesh, args))
                    print_row(rows[-1])
            except Exception:
                failures.append(
                    {"model": name, "accumulate_steps": accumulate, "error": traceback.format_exc()}
                )
                print(f"{name} acc={accumulate} FAILED:\n{failures[-1]['error']}", flush=True)
            if args.json:  # after every row: a run stopped at a time limit keeps its rows
                with open(args.json, "w") as f:
                    json.dump({**info, "rows": rows, "failures": failures}, f, indent=1)


if __name__ == "__main__":
    main()
