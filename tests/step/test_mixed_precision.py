"""Mixed-precision parameters (``Sharding(param_dtype=jnp.bfloat16)``): bf16 gathers and
compute, float32 master weights and optimizer state, sharded as the stage says.

The reference is plain JAX on one device and the whole batch whose loss reads
``param.astype(bfloat16)`` of float32 parameters: the casts fdp must make, and no
others. The all-gathers' dtype is read from the compiled program.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp
from fdp.observe._hlo import collective_stats

STEPS = 3
MODES = {  # name: Sharding settings
    "stage0": {"zero_stage": 0},
    "stage1": {"zero_stage": 1},
    "stage2": {"zero_stage": 2},
    "stage3_per_use": {"zero_stage": 3},
    "stage3_kept": {"zero_stage": 3, "reshard_after_forward": False},
}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(32)(x))  # Dense_0
        return nn.Dense(8)(h)  # Dense_1


def loss_fn(params, batch):
    out = MLP().apply({"params": params}, batch["x"])
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def make_state(tx=None):
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    return TrainState.create(apply_fn=None, params=params, tx=tx or optax.adam(1e-2))


def batches(num=STEPS, rows=32):
    rng = np.random.default_rng(3)
    return [
        {
            "x": rng.normal(size=(rows, 16)).astype(np.float32),
            "y": rng.normal(size=(rows, 8)).astype(np.float32),
        }
        for _ in range(num)
    ]


def reference(data, dtype, shards=8):
    """Plain JAX on one device: float32 parameters, the loss on ``param.astype(dtype)``.

    The gradient of the cast parameters is in ``dtype`` (the cast's transpose rounds
    it), one per batch shard as each of DDP's ranks has its own; their float32 mean
    updates the float32 parameters.
    """
    state = make_state()

    def shard_grad(params, batch):
        low = jax.tree.map(lambda x: x.astype(dtype), params)
        grads = jax.grad(loss_fn)(low, batch)
        return jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    grad = jax.jit(shard_grad)
    for batch in data:
        parts = [
            grad(state.params, {k: np.split(v, shards)[i] for k, v in batch.items()})
            for i in range(shards)
        ]
        state = state.apply_gradients(grads=jax.tree.map(lambda *g: sum(g) / shards, *parts))
    return jax.device_get(state.params)


def run(mode, data, param_dtype=jnp.bfloat16):
    sharding = fdp.Sharding(**MODES[mode], param_dtype=param_dtype)
    step = fdp.train_step(loss_fn, sharding=sharding)
    state = fdp.replicate(make_state())
    for batch in data:
        state, _ = step(state, fdp.shard_batch(batch))
    return step, state


def max_diff(a, b):
    return max(
        float(np.max(np.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_bf16_params_end_where_plain_jax_with_the_same_casts_does(mode):
    data = batches()
    bf16, f32 = reference(data, jnp.bfloat16), reference(data, jnp.float32)
    _, state = run(mode, data)
    got = jax.device_get(state.params)
    # Master weights and optimizer state stay float32 (and sharded as the stage says).
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state[0].mu)} == {jnp.dtype(jnp.float32)}
    # float32 sums in another order; the casts themselves move the result 100x more.
    tolerance = 2e-6
    assert max_diff(got, bf16) < tolerance
    assert max_diff(bf16, f32) > 100 * tolerance


def gather_and_reduce_dtypes(program):
    stats = collective_stats(program)
    gathers = {op.dtypes for op in stats.ops if op.kind == "all-gather"}
    reductions = {op.dtypes for op in stats.ops if op.kind in ("reduce-scatter", "all-reduce")}
    return gathers, reductions, stats.nbytes("all-gather")


@pytest.mark.parametrize("mode", ["stage3_per_use", "stage3_kept"])
def test_the_all_gathers_fdp_emits_move_bf16_and_the_reduction_f32(mode):
    # The lowered program (what fdp emits): XLA:CPU then promotes 16-bit collectives to
    # float32 (as it does bf16 all-reduces); the GPU tier below reads the compiled program.
    batch = fdp.shard_batch(batches(1)[0])
    step, state = run(mode, batches(1))
    gathers, reductions, nbytes = gather_and_reduce_dtypes(step.lower(state, batch))
    assert gathers == {("bf16",)} and reductions == {("f32",)}
    f32_step, f32_state = run(mode, batches(1), param_dtype=None)
    assert gather_and_reduce_dtypes(f32_step.lower(f32_state, batch))[2] == 2 * nbytes


@pytest.mark.gpu_compile
@pytest.mark.parametrize("mode", ["stage3_per_use", "stage3_kept"])
def test_the_gpu_compiled_all_gathers_are_bf16_and_the_reduce_scatters_f32(gpu_mesh, mode):
    def compiled(param_dtype):
        sharding = fdp.Sharding(**MODES[mode], param_dtype=param_dtype)
        step = fdp.train_step(loss_fn, mesh=gpu_mesh, sharding=sharding)
        state = fdp.replicate(jax.eval_shape(make_state), gpu_mesh)  # shapes only
        data = NamedSharding(gpu_mesh, P("data"))
        batch = {
            "x": jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=data),
            "y": jax.ShapeDtypeStruct((32, 8), jnp.float32, sharding=data),
        }
        return step.lower(state, batch).compile()

    gathers, reductions, nbytes = gather_and_reduce_dtypes(compiled(jnp.bfloat16))
    # Per use, a gather group's leaves are one all-gather of several operands.
    assert {dtype for operands in gathers for dtype in operands} == {"bf16"}
    assert any("f32" in r for r in reductions) and not any("bf16" in r for r in reductions)
    assert gather_and_reduce_dtypes(compiled(None))[2] == 2 * nbytes


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(16, 32, rngs=rngs)
        self.b = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.tanh(self.a(x)))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)


@pytest.mark.parametrize("mode", ["stage1", "stage3_per_use", "stage3_kept"])
def test_nnx_bf16_params_end_where_linen_does(mode):
    data = batches()
    model = NNXMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    # The same initial values as the Linen model's, so the Linen run is the reference.
    params = make_state().params
    model.a.kernel[...] = params["Dense_0"]["kernel"]
    model.a.bias[...] = params["Dense_0"]["bias"]
    model.b.kernel[...] = params["Dense_1"]["kernel"]
    model.b.bias[...] = params["Dense_1"]["bias"]
    sharding = fdp.Sharding(**MODES[mode], param_dtype=jnp.bfloat16)
    step = fdp.nnx_train_step(nnx_loss, sharding=sharding)
    for batch in data:
        step(model, optimizer, fdp.shard_batch(batch))
    assert model.a.kernel[...].dtype == jnp.float32
    got = {
        "Dense_0": {"kernel": model.a.kernel[...], "bias": model.a.bias[...]},
        "Dense_1": {"kernel": model.b.kernel[...], "bias": model.b.bias[...]},
    }
    assert max_diff(jax.device_get(got), reference(data, jnp.bfloat16)) < 2e-6


def test_param_dtype_must_be_a_floating_dtype():
    with pytest.raises(ValueError, match="param_dtype must be a floating dtype"):
        fdp.Sharding(param_dtype=jnp.int8)
    assert fdp.Sharding(param_dtype="bfloat16").param_dtype == jnp.bfloat16
    chex.assert_equal(fdp.Sharding().param_dtype, None)


@pytest.mark.parametrize("mode", ["stage0", "stage3_per_use"])
def test_bf16_params_of_a_scanned_stack_end_where_plain_jax_with_the_same_casts_does(mode):
    # The scan paths: stage 3 gathers the stack one layer per loop trip (_per_use);
    # stage 0 reduces it after the backward pass with a param_dtype (the cast before
    # the scan leaves no per-layer form: asking for the in-loop reduction ran the
    # whole scan in a remat, 3 loops instead of 2, and reduced nothing in the loop).
    # The bf16 cast must be made once, as the loss reads the parameters, on both.
    from test_per_layer import Stack, data, linen_loss, linen_state

    model, steps = Stack(depth=4), data()
    loss = linen_loss(model)
    sharding = fdp.Sharding(**MODES[mode], param_dtype=jnp.bfloat16)
    step = fdp.train_step(loss, sharding=sharding)
    assert not step.config.reduces_scanned_in_loop
    state = fdp.replicate(linen_state(model))
    for batch in steps:
        state, _ = step(state, fdp.shard_batch(batch))

    def shard_grad(params, batch, dtype):
        low = jax.tree.map(lambda x: x.astype(dtype), params)
        return jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(loss)(low, batch))

    grad = jax.jit(shard_grad, static_argnums=2)

    def reference(dtype):
        ref = linen_state(model)
        for batch in steps:
            parts = [
                grad(ref.params, {k: np.split(v, 8)[i] for k, v in batch.items()}, dtype)
                for i in range(8)
            ]
            ref = ref.apply_gradients(grads=jax.tree.map(lambda *g: sum(g) / 8, *parts))
        return jax.device_get(ref.params)

    bf16, f32 = reference(jnp.bfloat16), reference(jnp.float32)
    got = jax.device_get(state.params)
    assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    tolerance = 2e-6  # float32 sums in another order; the casts move the result far more
    assert max_diff(got, bf16) < tolerance
    assert max_diff(bf16, f32) > 100 * tolerance
