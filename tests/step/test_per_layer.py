"""ZeRO stage 3 on scanned layer stacks: each layer gathered inside the loop.

The code: fdp/step/grads/_per_use.py.

A stack under ``nn.scan``/``nnx.scan`` is one stacked parameter per leaf, used by one
``scan``. Stage 0 is the reference: stage 3 must end where it does. The compiled
program must gather one layer at a time inside the forward and the backward loop, and
reduce-scatter each layer's gradient there, never holding the whole stack.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fdp
from fdp.observe._hlo import collective_stats, loop_collectives

STEPS = 3


class Layer(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(self.width)(x)), None


class Stack(nn.Module):
    """``depth`` layers under ``nn.scan(nn.remat(...))`` between two plain ones."""

    depth: int = 8
    width: int = 32
    unroll: int = 1

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        layers = nn.scan(
            nn.remat(Layer),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
            unroll=self.unroll,
        )
        x, _ = layers(self.width)(x, None)
        return nn.Dense(8)(x)


def data(steps=STEPS, rows=32, features=16):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, features)).astype("f4"),
            "y": rng.normal(size=(rows, 8)).astype("f4"),
        }
        for _ in range(steps)
    ]


def linen_loss(model):
    def loss(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return loss


def linen_state(model, features=16):
    params = model.init(jax.random.key(0), jnp.zeros((1, features)))["params"]
    return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))


@pytest.mark.parametrize("depth", [8, 4])
def test_linen_scan_remat_stack_gathers_per_layer_and_ends_where_stage_0_does(depth):
    # The kernel stack [depth, 32, 32] is split along its features (a share of every
    # layer); the bias stack [depth, 32] on 8 devices along its layer axis, so one
    # all-to-all re-splits it (and one sends its gradient back); depth 4: features.
    model, batches = Stack(depth=depth), data()
    results = {}
    for stage in (0, 3):
        step = fdp.train_step(linen_loss(model), sharding=fdp.Sharding(zero_stage=stage))
        state = fdp.replicate(linen_state(model))
        for batch in batches:
            state, metrics = step(state, fdp.shard_batch(batch))
        results[stage] = jax.device_get((state.params, state.opt_state)), float(metrics["loss"])
    chex.assert_trees_all_close(results[3][0], results[0][0], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(results[3][1], results[0][1], rtol=1e-6)

    compiled = step.lower(state, fdp.shard_batch(batches[0])).compile()
    loop, every = loop_collectives(compiled), collective_stats(compiled)
    layer = 32 * 32 * 4  # one layer's kernel, whole
    # In the loops: the layer's kernel gathered in the forward and the backward loop,
    # its gradient share reduce-scattered in the backward loop.
    assert [op.nbytes for op in loop.ops if op.kind == "all-gather"].count(layer) == 2
    assert layer // 8 in [op.nbytes for op in loop.ops if op.kind == "reduce-scatter"]
    # Nowhere the whole stack: no gather bigger than one layer's kernel.
    assert max(op.nbytes for op in every.ops if op.kind == "all-gather") == layer
    assert every.count("all-to-all") == (2 if depth == 8 else 0)  # the bias: there, back


class NNXLayer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class NNXStack(nnx.Module):
    def __init__(self, depth, rngs):
        self.inp = nnx.Linear(16, 32, rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key):
            return NNXLayer(nnx.Rngs(key))

        self.layers = make(jax.random.split(rngs.params(), depth))
        self.out = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(layer, x):
            return layer(x)

        return self.out(run(self.layers, self.inp(x)))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("depth", [8, 4])
def test_nnx_scan_stack_gathers_per_layer_and_ends_where_stage_0_does(depth):
    batches = data()
    results = {}
    for stage in (0, 3):
        model = NNXStack(depth, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = fdp.nnx_train_step(nnx_loss, sharding=fdp.Sharding(zero_stage=stage))
        for batch in batches:
            metrics = step(model, optimizer, fdp.shard_batch(batch))
        results[stage] = jax.device_get(nnx.state((model, optimizer))), float(metrics["loss"])
    chex.assert_trees_all_close(results[3][0], results[0][0], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(results[3][1], results[0][1], rtol=1e-6)

    compiled = step.lower(model, optimizer, fdp.shard_batch(batches[0])).compile()
    gathers = [op.nbytes for op in loop_collectives(compiled).ops if op.kind == "all-gather"]
    assert gathers.count(32 * 32 * 4) == 2  # one layer's kernel, forward and backward loop


def test_a_deep_scanned_stack_never_holds_every_layer():
    # 16 layers of 256 x 256: the stack dwarfs a small batch's activations.
    model = Stack(depth=16, width=256)
    state = fdp.replicate(linen_state(model, features=256))
    rng = np.random.default_rng(0)
    batch = fdp.shard_batch(
        {"x": rng.normal(size=(16, 256)).astype("f4"), "y": rng.normal(size=(16, 8)).astype("f4")}
    )
    stack = sum(x.nbytes for x in jax.tree.leaves(state.params["ScanCheckpointLayer_0"]))
    step = fdp.train_step(linen_loss(model), sharding=fdp.Sharding(zero_stage=3))
    compiled = step.lower(state, batch).compile()
    # Gathered whole before the loop, the stack and its whole gradient sat in temp
    # memory (8.6 MiB for this 4 MiB stack before per-layer gathers); one layer at a
    # time, the shares and a few layers' worth (1.6 MiB).
    assert compiled.memory_analysis().temp_size_in_bytes < stack // 2
