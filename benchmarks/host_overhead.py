"""Host time per call of a host-bound step: fdp against plain JAX doing the same, side by side.

A step the host has to keep fed (a tiny MLP, 8 -> 16 -> 4, SGD, a global batch of 32)
costs what its Python costs. Each row times fdp's step and its plain-JAX twin in
interleaved rounds (fdp first in even rounds, the baseline first in odd ones) and
reports the median per-call time of each and the median of the per-round ratios:

- ``linen``: ``fdp.train_step`` against ``jax.jit(step, donate_argnums=0)`` on a
  ``TrainState`` placed as fdp places it (replicated at stage 0; split over the data
  axis at stage 3, as XLA's FSDP), with the same micro-batches (a loop) where
  ``accumulation`` is 4.
- ``nnx``: ``fdp.nnx_train_step`` called in place against ``nnx.jit`` over the same
  model and optimizer (both split and update the objects in Python every call).
- ``nnx-split``: ``step.apply`` on ``step.split`` state against ``jax.jit`` over
  ``nnx.split`` state (the fast way to run NNX).
- ``ddp``: ``@fdp.ddp`` around a hand-written SGD step against ``jax.jit`` of it.

On 1 CPU device the calls are queued back to back (host-bound); on 8 simulated CPU
devices each call is waited for (XLA:CPU's collectives under a long queue of
steps abort on jax 0.10), so the 8-device rows include the devices' work. The rows
marked ``launch`` run inside ``fdp launch`` (a worker with its heartbeat watched).

    python3 benchmarks/host_overhead.py --json benchmarks/results/host_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fdp  # noqa: E402

ROWS_PER_BATCH = 32
LR = 0.1


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def mse(pred, y):
    return jnp.mean((pred - y) ** 2)


def batch_on(mesh):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS_PER_BATCH, 8)).astype(np.float32)
    y = rng.normal(size=(ROWS_PER_BATCH, 4)).astype(np.float32)
    return fdp.shard_batch({"x": x, "y": y}, mesh)


def micro_batches(batch, accum):
    """``accum`` micro-batches, each device's rows kept on it (as fdp splits them)."""
    return jax.tree.map(
        lambda x: jnp.moveaxis(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 1, 0), batch
    )


def mean_grads(grad_fn, params, batch, accum):
    """The mean of ``grad_fn(params, micro)`` over ``accum`` micro-batches (a loop)."""
    if accum == 1:
        return grad_fn(params, batch)
    micro = micro_batches(batch, accum)

    def body(total, one):
        return jax.tree.map(jnp.add, total, grad_fn(params, one)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, _ = jax.lax.scan(body, zeros, micro)
    return jax.tree.map(lambda g: g / accum, total)


def fsdp(tree, mesh, stage):
    """``tree`` on ``mesh``: replicated (stage 0) or split over 'data' on dim 0 (stage 3)."""
    n = mesh.shape["data"]

    def put(x):
        x = jnp.array(x, copy=True)  # its own buffers: the other side donates its own
        split = stage and x.ndim and x.shape[0] % n == 0
        return jax.device_put(x, NamedSharding(mesh, P("data") if split else P()))

    return jax.tree.map(put, tree)


def shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


# -- the rows: (fdp call, plain call), each a function of no arguments ---------------------


def carried(fdp_step, fdp_state, plain_step, plain_state):
    """Calls that carry their state from one call to the next (it is donated)."""
    box = {"fdp": fdp_state, "plain": plain_state}

    def fdp_call():
        box["fdp"], out = fdp_step(box["fdp"])
        return out

    def plain_call():
        box["plain"], out = plain_step(box["plain"])
        return out

    return fdp_call, plain_call


def linen_pair(mesh, stage, accum):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    tx = optax.sgd(LR)

    def loss_fn(p, b):
        return mse(model.apply({"params": p}, b["x"]), b["y"])

    batch = batch_on(mesh)
    step = fdp.train_step(
        loss_fn,
        mesh=mesh,
        sharding=fdp.Sharding(zero_stage=stage),
        accumulation=fdp.Accumulation(steps=accum),
    )
    ours = step.init(fdp.TrainState.create(apply_fn=None, params=params, tx=tx))

    def plain_step(state, b):
        grads = mean_grads(jax.grad(loss_fn), state.params, b, accum)
        return state.apply_gradients(grads=grads), {"loss": loss_fn(state.params, b)}

    state = fsdp(fdp.TrainState.create(apply_fn=None, params=params, tx=tx), mesh, stage)
    plain = jax.jit(plain_step, donate_argnums=0, out_shardings=(shardings(state), None))
    return carried(lambda s: step(s, batch), ours, lambda s: plain(s, batch), state)


def _nnx_objects(mesh, stage):
    model = NNXMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    nnx.update((model, optimizer), fsdp(nnx.state((model, optimizer)), mesh, stage))
    return model, optimizer


def _nnx_loss(model, b):
    return mse(model(b["x"]), b["y"])


def _nnx_grads(graphdef, rest, params, b):
    return jax.grad(lambda p: _nnx_loss(nnx.merge(graphdef, p, rest), b))(params)


def _nnx_step(mesh, stage, accum):
    return fdp.nnx_train_step(
        _nnx_loss,
        mesh=mesh,
        sharding=fdp.Sharding(zero_stage=stage),
        accumulation=fdp.Accumulation(steps=accum),
    )


def nnx_pair(mesh, stage, accum):
    batch = batch_on(mesh)
    model, optimizer = _nnx_objects(mesh, stage)
    step = _nnx_step(mesh, stage, accum)
    step.init(model, optimizer)
    plain_model, plain_optimizer = _nnx_objects(mesh, stage)

    @nnx.jit
    def plain(model, optimizer, b):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        grads = mean_grads(lambda p, m: _nnx_grads(graphdef, rest, p, m), params, b, accum)
        optimizer.update(model, grads)
        return {"loss": _nnx_loss(model, b)}

    return (
        lambda: step(model, optimizer, batch),
        lambda: plain(plain_model, plain_optimizer, batch),
    )


def nnx_split_pair(mesh, stage, accum):
    batch = batch_on(mesh)
    model, optimizer = _nnx_objects(mesh, stage)
    step = _nnx_step(mesh, stage, accum)
    graphdef, state = step.split(model, optimizer)
    plain_graphdef, plain_state = nnx.split(_nnx_objects(mesh, stage))

    def plain_step(state, b):
        model, optimizer = nnx.merge(plain_graphdef, state)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        grads = mean_grads(lambda p, m: _nnx_grads(graphdef, rest, p, m), params, b, accum)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": _nnx_loss(model, b)}

    plain = jax.jit(plain_step, donate_argnums=0, out_shardings=(shardings(plain_state), None))
    return carried(
        lambda s: step.apply(graphdef, s, batch), state, lambda s: plain(s, batch), plain_state
    )


def ddp_pair(mesh, stage, accum):
    del stage, accum  # fdp.ddp is DDP: one row
    model = MLP()
    params = fdp.replicate(model.init(jax.random.key(0), jnp.ones((1, 8)))["params"], mesh)
    batch = batch_on(mesh)

    def loss_fn(p, b):
        return mse(model.apply({"params": p}, b["x"]), b["y"])

    def sgd(p, b, reduce):
        loss, grads = jax.value_and_grad(loss_fn)(p, b)
        grads = reduce(grads)
        return jax.tree.map(lambda w, g: w - LR * g, p, grads), loss

    step = fdp.ddp(
        lambda p, b: sgd(p, b, fdp.reduce_gradients), mesh=mesh, batch_argnums=1, donate_argnums=0
    )
    plain = jax.jit(lambda p, b: sgd(p, b, lambda g: g), donate_argnums=0)
    theirs = fdp.replicate(jax.device_get(params), mesh)
    return carried(lambda p: step(p, batch), params, lambda p: plain(p, batch), theirs)


FRONTS: dict[str, tuple[str, str, Callable[..., Any]]] = {
    "linen": ("fdp.train_step", "jax.jit", linen_pair),
    "nnx": ("fdp.nnx_train_step (in place)", "nnx.jit", nnx_pair),
    "nnx-split": ("step.apply (split state)", "jax.jit over nnx.split", nnx_split_pair),
    "ddp": ("@fdp.ddp", "jax.jit", ddp_pair),
}


def rows() -> list[dict[str, Any]]:
    out = []
    for devices in (1, 8):
        for front in ("linen", "nnx-split"):
            for stage in (0, 3):
                for accum in (1, 4):
                    out.append(dict(front=front, devices=devices, stage=stage, accum=accum))
        out.append(dict(front="nnx", devices=devices, stage=0, accum=1))
        out.append(dict(front="ddp", devices=devices, stage=0, accum=1))
    return out


LAUNCH_ROWS = [
    dict(front="linen", devices=1, stage=0, accum=1),
    dict(front="nnx-split", devices=1, stage=0, accum=1),
]


def name(row: dict[str, Any]) -> str:
    return f"{row['front']}-{row['devices']}dev-s{row['stage']}-a{row['accum']}"


def time_calls(call: Callable[[], Any], calls: int, wait_each: bool) -> float:
    """Seconds per call over ``calls`` calls (each waited for, or only the last)."""
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = call()
        if wait_each:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def measure(row: dict[str, Any], rounds: int, calls: int) -> dict[str, Any]:
    mesh = fdp.data_mesh(jax.devices()[: row["devices"]])
    fdp_call, plain_call = FRONTS[row["front"]][2](mesh, row["stage"], row["accum"])
    wait_each = row["devices"] > 1
    for call in (fdp_call, plain_call):  # compile, then settle
        for _ in range(20):
            jax.block_until_ready(call())
    ours, theirs, ratios = [], [], []
    for r in range(rounds):
        pair = (fdp_call, plain_call) if r % 2 == 0 else (plain_call, fdp_call)
        first, second = (time_calls(c, calls, wait_each) for c in pair)
        a, b = (first, second) if r % 2 == 0 else (second, first)
        ours.append(a * 1e6)
        theirs.append(b * 1e6)
        ratios.append(a / b)
    return {
        **row,
        "name": name(row),
        "fdp": FRONTS[row["front"]][0],
        "baseline": FRONTS[row["front"]][1],
        "fdp_us": statistics.median(ours),
        "baseline_us": statistics.median(theirs),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "launch": bool(os.environ.get("FDP_HEARTBEAT_FILE")),
        "waited_each_call": wait_each,
    }


def under_launch(rows_: list[dict[str, Any]], rounds: int, calls: int) -> list[dict[str, Any]]:
    """The rows measured again inside ``fdp launch`` (one worker, heartbeat watched)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "launch.json")
        only = ",".join(name(r) for r in rows_)
        cmd = [sys.executable, "-m", "fdp", "launch", "--nproc-per-node", "1", __file__]
        cmd += ["--only", only, "--rounds", str(rounds), "--calls", str(calls), "--json", out]
        subprocess.run(cmd, check=True)
        with open(out) as f:
            return json.load(f)["rows"]


def table(results: list[dict[str, Any]]) -> str:
    head = f"{'row':24s} {'launch':>6s} {'fdp us':>9s} {'baseline us':>12s} {'ratio':>7s}  baseline"
    lines = [head]
    for r in results:
        lines.append(
            f"{r['name']:24s} {'yes' if r['launch'] else '':>6s} {r['fdp_us']:9.1f} "
            f"{r['baseline_us']:12.1f} {r['ratio']:7.3f}  {r['baseline']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--only", help="comma-separated row names (default: all)")
    parser.add_argument("--no-launch", action="store_true", help="skip the fdp launch rows")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    chosen = rows()
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [r for r in chosen if name(r) in wanted]
    results = [measure(r, args.rounds, args.calls) for r in chosen]
    inside = bool(os.environ.get("FDP_HEARTBEAT_FILE"))
    if not inside and not args.no_launch and not args.only:
        results += under_launch(LAUNCH_ROWS, args.rounds, args.calls)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "jax": jax.__version__,
                    "python": platform.python_version(),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "rounds": args.rounds,
                    "calls": args.calls,
                    "rows": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
