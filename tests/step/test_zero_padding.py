"""ZeRO padding: the optimizer state of leaves that 8 does not divide, padded and sharded.

Every leaf here has sizes 8 does not divide (7 x 5, 5 x 3, 3 x 10, biases of 5, 3,
10). The reference is stage 0 and a single device stepping on the whole batch
(plain optax); the padded stages must end where they do, and each device must hold
1/8 of the optimizer state plus its share of the padding.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import device0_bytes, reference_steps, train_on
from flax import nnx
from flax.training.train_state import TrainState

import fdp
from fdp.step.layout._padding import pad_dim, padded_shape
from fdp.step.layout._zero import memory_table

N = 8
STEPS = 3

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(1e-2),
    "adamw_decay_mask": lambda: optax.adamw(
        1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
    "clip_global_norm_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
}


class Odd(nn.Module):
    @nn.compact
    def __call__(self, x):  # x: [batch, 7]
        h = nn.tanh(nn.Dense(5)(x))  # kernel 7 x 5: padded to 8 x 5; bias 5 stays whole
        h = nn.tanh(nn.Dense(3)(h))  # kernel 5 x 3: 8 x 3; bias 3 whole
        return nn.Dense(10)(h)  # kernel 3 x 10: 3 x 16; bias 10: 16


def loss_fn(params, batch):
    return jnp.mean((Odd().apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


def odd_state(tx):
    params = Odd().init(jax.random.key(0), jnp.zeros((1, 7)))["params"]
    return TrainState.create(apply_fn=None, params=params, tx=tx)


def batches(num=STEPS, rows=32):
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.normal(size=(rows, 7)).astype(np.float32),
            "y": rng.normal(size=(rows, 10)).astype(np.float32),
        }
        for _ in range(num)
    ]


def test_the_padding_rule():
    assert [pad_dim(s, N) for s in [(7, 5), (5, 3), (3, 10), (10,), (5,), (3,), (16, 5)]] == [
        0,
        0,
        1,
        0,
        None,
        None,
        None,
    ]
    assert padded_shape((3, 10), N) == (3, 16)
    params = {"k": jax.ShapeDtypeStruct((7, 5), jnp.float32)}
    table = memory_table(1, N, params, {"mu": params})
    assert "optimizer state padding (zeros, in all): 20 B, 2 B per device" in table
    assert padded_shape((1, 1001), N) == (1, 1008)  # the dimension that leaves least per device


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_padded_stages_end_where_stage_0_and_one_device_do(opt):
    data = batches()
    expected, losses = reference_steps(odd_state(OPTIMIZERS[opt]()), data, loss_fn)
    ends = {}
    for stage in (0, 1, 2, 3):
        step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=stage))
        state, metrics = train_on(step, fdp.replicate(odd_state(OPTIMIZERS[opt]())), data)
        # The user's parameters keep their shapes; the padding never shows there.
        assert jax.tree.map(jnp.shape, state.params) == jax.tree.map(jnp.shape, expected.params)
        ends[stage] = jax.device_get(state.params)
        np.testing.assert_allclose(float(metrics["loss"]), losses[-1], rtol=1e-5)
        padded = [x for x in jax.tree.leaves(state.opt_state) if x.shape == (8, 5)]
        assert len(padded) == (2 if stage and opt != "sgd" else 0)  # Adam's mu and nu
        for x in padded:  # 7 x 5 padded to 8 x 5, one row a device; the padding stays zero
            assert x.addressable_shards[0].data.shape == (1, 5)
            assert float(jnp.abs(x[7]).max()) == 0.0
    for stage in (0, 1, 2, 3):
        chex.assert_trees_all_close(
            ends[stage], jax.device_get(expected.params), atol=2e-6, rtol=1e-5
        )
        chex.assert_trees_all_close(ends[stage], ends[0], atol=2e-6, rtol=1e-5)


def test_each_device_holds_an_eighth_of_the_optimizer_state_plus_padding():
    data = batches(2)  # the second call's state is padded: describe keeps the first's shapes
    whole = {}
    for stage in (0, 1, 2, 3):
        step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=stage))
        state, _ = train_on(step, fdp.replicate(odd_state(optax.adam(1e-2))), data)
        held = device0_bytes(state.opt_state)
        if stage == 0:
            whole = {"opt": held, "params": state.params}
            continue
        # mu and nu of each leaf: padded to a multiple of 8 where it has >= 8 elements.
        padding = 2 * sum(
            4 * (np.prod(padded_shape(x.shape, N)) - x.size)
            for x in jax.tree.leaves(whole["params"])
        )
        small = 2 * 4 * (5 + 3)  # the biases of 5 and 3: fewer than 8 elements, whole
        count = 4  # Adam's step count
        assert held <= (whole["opt"] - small - count) / N + padding / N + small + count
        assert held < whole["opt"] / 3
        report = fdp.describe(step)
        assert f"optimizer state padding (zeros, in all): {padding:,} B" in report


class NNXOdd(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(7, 5, rngs=rngs)
        self.b = nnx.Linear(5, 3, rngs=rngs)
        self.c = nnx.Linear(3, 10, rngs=rngs)

    def __call__(self, x):
        return self.c(nnx.tanh(self.b(nnx.tanh(self.a(x)))))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("opt", ["adam", "clip_global_norm_adam"])
def test_nnx_padded_stages_end_where_stage_0_does(opt):
    data = batches()
    ends = {}
    for stage in (0, 1, 2, 3):
        model = NNXOdd(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, OPTIMIZERS[opt](), wrt=nnx.Param)
        step = fdp.nnx_train_step(nnx_loss, sharding=fdp.Sharding(zero_stage=stage))
        for batch in data:
            metrics = step(model, optimizer, fdp.shard_batch(batch))
        assert model.a.kernel[...].shape == (7, 5)
        ends[stage] = jax.device_get(nnx.state(model)), float(metrics["loss"])
        if stage:
            padded = [
                x for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if x.shape == (8, 5)
            ]
            assert padded and all(x.addressable_shards[0].data.shape == (1, 5) for x in padded)
    for stage in (1, 2, 3):
        chex.assert_trees_all_close(ends[stage][0], ends[0][0], atol=2e-6, rtol=1e-5)
        np.testing.assert_allclose(ends[stage][1], ends[0][1], rtol=1e-6)


@pytest.mark.parametrize(("saved", "restored", "devices"), [(1, 0, 4), (2, 3, 4), (3, 3, 8)])
def test_a_padded_checkpoint_restores_onto_another_stage_and_device_count(
    saved, restored, devices, tmp_path
):
    data = batches(4)
    make = lambda: odd_state(optax.adam(1e-2))  # noqa: E731
    step8 = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=saved))
    uninterrupted, _ = train_on(step8, fdp.replicate(make()), data)
    state, _ = train_on(step8, fdp.replicate(make()), data[:2])
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, state)
        ckpt.wait_until_finished()
    mesh = fdp.data_mesh(devices=jax.devices()[:devices])
    step = fdp.train_step(loss_fn, mesh=mesh, sharding=fdp.Sharding(zero_stage=restored))
    template = step.abstract_init(lambda key: make(), jax.random.key(0))
    with fdp.CheckpointManager(tmp_path) as ckpt:
        resumed = ckpt.restore(template).state
    mu = resumed.opt_state[0].mu["Dense_2"]["bias"]  # 10 floats: padded to 12 on 4, 16 on 8
    assert mu.shape == ((10,) if restored == 0 else padded_shape((10,), devices))
    assert resumed.params["Dense_2"]["bias"].shape == (10,)
    resumed, _ = train_on(step, resumed, data[2:], mesh)
    chex.assert_trees_all_close(
        jax.device_get(resumed.params), jax.device_get(uninterrupted.params), atol=2e-6, rtol=1e-5
    )


def test_a_parameter_of_another_shape_is_still_refused(tmp_path):
    step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=1))
    state = step.init(odd_state(optax.adam(1e-2)))
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(0, state)
        ckpt.wait_until_finished()
    params = dict(state.params)
    params["Dense_2"] = {"kernel": jnp.zeros((3, 11)), "bias": jnp.zeros((11,))}
    other = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    with fdp.CheckpointManager(tmp_path) as ckpt, pytest.raises(ValueError, match="params"):
        ckpt.restore(step.init(other))


def test_sharded_init_builds_the_padded_state_directly():
    step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=3))
    built = step.init_sharded(lambda key: odd_state(optax.adam(1e-2)), jax.random.key(0))
    placed = step.init(odd_state(optax.adam(1e-2)))
    chex.assert_trees_all_equal(jax.device_get(built.opt_state), jax.device_get(placed.opt_state))
    assert built.opt_state[0].mu["Dense_1"]["kernel"].shape == (8, 3)
    assert built.params["Dense_1"]["kernel"].shape == (5, 3)
