"""A ~500M-parameter GPT initialised sharded and trained at ZeRO stage 3 on 8 simulated devices.

Replicated, 8 devices would hold 8 copies of the parameters and the Adam state
(~6 GB each for 505M float32 parameters: ~48 GB in one process). At stage 3 each
device holds 1/8 of both, and the state is built straight into that layout
(``step.init_sharded``: the initialiser runs under ``jit`` with each leaf's
``out_shardings``), so the whole model never exists in one place. Parameters are
gathered per use (one leaf at a time, freed after) in the forward and backward
passes.

Prints the loss of each step (the same batch every step, so it falls), the wall
time of each phase and the process's peak resident memory
(``resource.getrusage``). Too heavy for the test suite; run it alone:

    python benchmarks/zero_500m.py --json benchmarks/results/zero_500m.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=9)
    parser.add_argument("--vocab", type=int, default=12288)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--per-device", type=int, default=1, help="sequences per device")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--need-gib", type=float, default=16.0, help="refuse with less free")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if available_gib() < args.need_gib:
        raise SystemExit(
            f"only {available_gib():.1f} GiB available, --need-gib={args.need_gib}: "
            "this machine is busy; run it later (or lower --need-gib knowingly)."
        )
    jax.config.update("jax_num_cpu_devices", args.devices)

    import optax
    from _models import Transformer, _tokens, param_count

    import fdp

    model = Transformer(
        vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.dim // 128, seq=args.seq
    )
    make_batch = _tokens(args.seq, args.vocab)
    tx = optax.adam(1e-4)

    def loss_fn(params, batch):
        logits = jax.numpy.asarray(model.apply({"params": params}, batch["x"]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def make_state(key):
        params = model.init(key, jax.numpy.zeros((1, args.seq), jax.numpy.int32))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=tx)

    step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=3))
    abstract = step.abstract_init(make_state, jax.random.key(0))
    params = param_count(abstract.params)
    print(
        f"GPT d{args.dim} x{args.depth} v{args.vocab} s{args.seq}: {params / 1e6:.1f}M "
        f"parameters, Adam, ZeRO stage 3 (gathered per use), {args.devices} simulated devices",
        flush=True,
    )
    out: dict = {
        "jax": jax.__version__,
        "fdp": fdp.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.devices} simulated "
        "CPU devices",
        "model": {k: getattr(args, k) for k in ("dim", "depth", "vocab", "seq", "per_device")},
        "params": params,
        "available_gib_at_start": available_gib(),
    }

    start = time.perf_counter()
    state = step.init_sharded(make_state, jax.random.key(0))
    jax.block_until_ready(state)
    out["init_s"] = time.perf_counter() - start
    out["rss_after_init_gib"] = peak_rss_gib()
    print(f"init_sharded {out['init_s']:.1f} s, peak RSS {out['rss_after_init_gib']:.2f} GiB")

    batch = fdp.shard_batch(make_batch(args.per_device * args.devices, 0))
    losses, seconds = [], []
    for i in range(args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        print(
            f"step {i}: loss {loss:.4f}  {seconds[-1]:.1f} s"
            + (" (compile included)" if i == 0 else "")
            + f"  peak RSS {peak_rss_gib():.2f} GiB",
            flush=True,
        )
    out.update(losses=losses, step_s=seconds, peak_rss_gib=peak_rss_gib())
    print(f"peak RSS {out['peak_rss_gib']:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
