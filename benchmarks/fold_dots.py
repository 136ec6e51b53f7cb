"""Dense products folded to 2-D on CPU (``fold_dots``): fdp's step with and without, and plain jit.

One process, one CPU device, the models of ``_mp_models.py`` (the same as
``multiprocess.py``), plain SGD. Three variants run in interleaved rounds: plain
``jax.jit`` of the same step (the baseline), ``fdp.train_step`` as it comes
(``fold_dots`` on, the CPU default) and with ``fold_dots=False``. ``--cores``
pins the process before JAX starts (XLA sizes its thread pool from it).

    python benchmarks/fold_dots.py --cores 1 --json benchmarks/results/fold_dots_1core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,mlp")
    parser.add_argument("--cores", type=int, default=0, help="pin to this many cores (0: all)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.cores:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.cores]))

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import optax
    from _mp_models import LR, init_params, jax_loss, make_batches
    from flax.training.train_state import TrainState

    import fdp

    batch_size = {"mlp": 64, "transformer": 16}
    results = []
    for model in args.models.split(","):
        loss_fn = jax_loss(model)
        params = jax.tree.map(jax.numpy.asarray, init_params(model))
        batch = jax.tree.map(jax.numpy.asarray, make_batches(model, batch_size[model], 1, 0)[0])

        @jax.jit
        def plain(state, batch, loss_fn=loss_fn):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
            return state.apply_gradients(grads=grads), loss

        runners = {"jit": (plain, batch)}
        for name, fold in (("fdp", None), ("fdp fold_dots=False", False)):
            step = fdp.train_step(loss_fn, fold_dots=fold)
            runners[name] = (step, fdp.shard_batch(batch))
        states = {}
        for name, (fn, b) in runners.items():
            state = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(LR))
            state = state if name == "jit" else fdp.replicate(state)
            states[name] = jax.block_until_ready(fn(state, b)[0])  # compile
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, (fn, b) in runners.items():
                state = states[name]
                start = time.perf_counter()
                for _ in range(args.steps):
                    state, _ = fn(state, b)
                    jax.block_until_ready(state)
                times[name].append((time.perf_counter() - start) / args.steps)
                states[name] = state
        base = statistics.median(times["jit"])
        for name, ts in times.items():
            ms = 1e3 * statistics.median(ts)
            paired = statistics.median(t / j for t, j in zip(ts, times["jit"], strict=True))
            results.append(
                {
                    "model": model,
                    "variant": name,
                    "step_ms": ms,
                    "ratio_to_jit": ms / 1e3 / base,
                    "paired_ratio_to_jit": paired,
                    "round_ms": [1e3 * t for t in ts],
                }
            )
    cores = len(os.sched_getaffinity(0))
    print(
        f"\n{platform.machine()}, {cores} core(s); median of {args.rounds} interleaved rounds "
        f"x {args.steps} steps, jax {jax.__version__}"
    )
    print(f"{'model':12} {'variant':22} {'ms/step':>9} {'/ jit':>7} {'paired':>7}")
    for r in results:
        print(
            f"{r['model']:12} {r['variant']:22} {r['step_ms']:9.1f} {r['ratio_to_jit']:7.3f} "
            f"{r['paired_ratio_to_jit']:7.3f}"
        )
    if args.json:
        meta = {
            "argv": sys.argv,
            "cores": cores,
            "machine": platform.machine(),
            "jax": jax.__version__,
            "load_average": os.getloadavg(),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
