"""Peak memory of a scanned GPT (``nn.scan`` + ``nn.remat``) under fdp and plain ``jit``.

Issue 31 (items 1 and 6), compile-only on simulated CPU devices: the per-device peak
(argument + output - alias + temp, ``memory_analysis()``) of one Adam step of a
GPT-style transformer whose blocks are one ``nn.scan(nn.remat(Block))`` stack, for

- fdp stage 0, and plain ``jit`` data parallelism (parameters and Adam state
  replicated, the batch sharded over ``'data'``; XLA's SPMD partitioner);
- fdp stage 2 (each layer's gradient reduce-scattered in the backward loop);
- fdp stage 3 (per-use gathers, a layer per loop iteration), and plain ``jit`` FSDP
  (parameters and Adam state sharded over ``'data'``, each leaf along its first
  dimension the devices divide: :func:`zero.first_divisible`).

    python benchmarks/scanned_memory.py --json benchmarks/results/scanned_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))

MODES = ("fdp stage 0", "plain jit DP", "fdp stage 2", "fdp stage 3", "plain jit FSDP")


def scanned_bench(dim: int, depth: int, vocab: int, seq: int):
    import flax.linen as nn
    import optax
    from _models import Bench, Block, _tokens

    class Layer(nn.Module):
        dim: int
        heads: int

        @nn.compact
        def __call__(self, x, _):
            return Block(self.dim, self.heads)(x), None

    class ScannedGPT(nn.Module):
        @nn.compact
        def __call__(self, tokens, train=True):
            x = nn.Embed(vocab, dim)(tokens)
            x = x + self.param("pos", nn.initializers.normal(0.02), (seq, dim))
            stack = nn.scan(
                nn.remat(Layer),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=depth,
            )
            x, _ = stack(dim, max(1, dim // 64))(x, None)
            return nn.Dense(vocab)(nn.LayerNorm()(x))

    return Bench(
        f"scanned GPT d{dim} x{depth} v{vocab} s{seq}",
        ScannedGPT(),
        _tokens(seq, vocab),
        lambda: optax.adam(1e-3),
    )


def peak(bench, mode: str, rows: int) -> tuple[dict[str, int], int]:
    """(compiled memory, parameter count) of one step of ``mode``, compile-only."""
    import optax
    from _models import param_count
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from zero import abstract_state, compiled_memory_of, with_shardings

    import fdp

    mesh = fdp.data_mesh()
    abstract = abstract_state(bench, bench.tx())
    count = param_count(abstract.params)
    if mode.startswith("fdp"):
        stage = int(mode[-1])
        step = fdp.train_step(bench.loss_fn, sharding=fdp.Sharding(zero_stage=stage))
        batch = fdp.shard_batch(bench.make_batch(rows, 0))
        return compiled_memory_of(step.lower(with_shardings(abstract, stage, mesh), batch)), count
    state = with_shardings(abstract, 3 if mode == "plain jit FSDP" else 0, mesh, simple=True)
    tokens = jax.ShapeDtypeStruct(
        bench.make_batch(rows, 0)["x"].shape,
        jax.numpy.int32,
        sharding=NamedSharding(mesh, P("data")),
    )
    tx = bench.tx()

    def step(params, opt_state, batch):
        grads = jax.grad(bench.loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
    jitted = jax.jit(step, out_shardings=shardings, donate_argnums=(0, 1))
    lowered = jitted.lower(state.params, state.opt_state, {"x": tokens, "y": tokens})
    return compiled_memory_of(lowered), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--per-device", type=int, default=2, help="sequences per device")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.devices)

    import fdp

    bench = scanned_bench(args.dim, args.depth, args.vocab, args.seq)
    rows = args.per_device * args.devices
    results: dict = {
        "jax": jax.__version__,
        "fdp": fdp.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{args.devices} simulated CPU devices, compile-only",
        "model": bench.name,
        "modes": {},
    }
    print(f"{bench.name}, {args.per_device} sequences per device, Adam; MiB per device")
    head = ("mode", "params", "argument", "output", "alias", "temp", "peak")
    print(f"{head[0]:<16}" + "".join(f"{h:>10}" for h in head[1:]))
    for mode in args.modes:
        mem, count = peak(bench, mode, rows)
        results["modes"][mode] = {"params": count, "compiled": mem}
        cells = [mem[k] / 2**20 for k in ("argument", "output", "alias", "temp", "footprint")]
        print(f"{mode:<16}{count / 1e6:>9.1f}M" + "".join(f"{c:>10.1f}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
