"""Host time per call of a tiny fdp step, Linen and NNX, where Python overhead dominates.

A 5-layer MLP of width 32 on 8 simulated CPU devices: the device work is small, so
the time per call is mostly fdp's and JAX's host work. Each step is waited for
(hundreds of queued tiny steps on simulated devices can exhaust XLA:CPU's collective
rendezvous on 2 cores). Run it on two trees to compare:

    python benchmarks/host_overhead.py --json benchmarks/results/host_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _progress import progress  # noqa: E402
from flax import nnx  # noqa: E402

import fdp  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.List([nnx.Linear(16 if i == 0 else 32, 32, rngs=rngs) for i in range(4)])
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.out(x)


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def time_calls(call, steps):
    for _ in range(20):
        jax.block_until_ready(call())
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(call())
    return (time.perf_counter() - start) / steps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    batch = fdp.shard_batch({"x": np.ones((16, 16), np.float32), "y": np.zeros(16, np.int32)})

    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    tx = optax.sgd(0.1)
    box = {"state": fdp.replicate(fdp.TrainState.create(apply_fn=None, params=params, tx=tx))}
    step = fdp.train_step(lambda p, b: xent(model.apply({"params": p}, b["x"]), b["y"]))

    def linen_call():
        box["state"], metrics = step(box["state"], batch)
        return metrics

    net = NNXMLP(nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.sgd(0.1), wrt=nnx.Param)
    nnx_step = fdp.nnx_train_step(lambda m, b: xent(m(b["x"]), b["y"]))

    rounds = {"linen": [], "nnx": []}
    for _ in progress(range(args.rounds), "rounds"):
        rounds["linen"].append(time_calls(linen_call, args.steps))
        rounds["nnx"].append(time_calls(lambda: nnx_step(net, opt, batch), args.steps))
    result = {k: {"median_ms": statistics.median(v), "rounds_ms": v} for k, v in rounds.items()}
    print(f"{'front end':10s} {'ms per call (median)':>22s}  rounds")
    for k, v in result.items():
        print(f"{k:10s} {v['median_ms']:22.3f}  {', '.join(f'{x:.3f}' for x in v['rounds_ms'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "fdp": fdp.__version__, "results": result}, f)


if __name__ == "__main__":
    main()
