"""The numerics guard (FDP_CHECK_FINITE=1) and the check of non-finite hyper-parameters.

One device's NaN poisons every device through the all-reduce; the guard names the
device and the call where it first appeared, and leaves the step as it is when off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, cross_entropy, make_data
from flax import nnx
from flax.training.train_state import TrainState

import fdp
from fdp.step.grads import _finite


def run(batches, **step_options):
    model = MLP()
    params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
    state = fdp.replicate(TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1)))
    step = fdp.train_step(cross_entropy(model.apply), **step_options)
    losses = []
    for batch in batches:
        state, metrics = step(state, fdp.shard_batch(batch))
        assert sorted(metrics) == ["loss"]  # the guard's codes never reach the caller
        losses.append(float(metrics["loss"]))
    return losses


def batches_with_nan(row, at):
    out = [make_data(i, 16) for i in range(3)]
    out[at]["x"][row] = np.nan
    return out


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_guard_names_the_device_and_call_of_the_first_nan(monkeypatch, zero_stage):
    monkeypatch.setenv(_finite.ENV_VAR, "1")
    # 8 devices x 2 rows: row 9 is on device 4.
    with pytest.raises(FloatingPointError) as info:
        run(batches_with_nan(9, 1), zero_stage=zero_stage)
    message = str(info.value)
    assert "non-finite values (NaN or inf) at call 2 of this step" in message
    assert "first on process 0: device 4 (process 0): loss and gradients." in message
    assert "The other devices' values were finite" in message


def test_off_the_nan_spreads_silently_and_on_finite_steps_are_the_same(monkeypatch):
    monkeypatch.delenv(_finite.ENV_VAR, raising=False)
    poisoned = run(batches_with_nan(9, 1))
    assert np.isfinite(poisoned[0]) and np.isnan(poisoned[1:]).all()
    clean = [make_data(i, 16) for i in range(3)]
    off = run(clean)
    monkeypatch.setenv(_finite.ENV_VAR, "1")
    assert run(clean) == off


def test_the_switch_is_read_strictly():
    assert not _finite.enabled({}) and not _finite.enabled({_finite.ENV_VAR: "off"})
    assert _finite.enabled({_finite.ENV_VAR: " TRUE "})
    with pytest.raises(ValueError, match="FDP_CHECK_FINITE must be 1 or 0"):
        _finite.enabled({_finite.ENV_VAR: "maybe"})


@pytest.mark.parametrize("lr", [float("nan"), float("inf")])
def test_a_non_finite_learning_rate_is_refused_naming_it(lr):
    model = MLP()
    params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    step = fdp.train_step(cross_entropy(model.apply))
    with pytest.raises(ValueError, match=r"hyperparams\['learning_rate'\]=(nan|inf)"):
        step(state, fdp.shard_batch(make_data(0, 16)))


def test_a_non_finite_learning_rate_of_an_nnx_optimizer_is_refused():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=float("nan"))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = fdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2))
    with pytest.raises(ValueError, match=r"\['learning_rate'\]\.value=nan"):
        step(model, optimizer, fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones(8)}))


NAN = float("nan")


@pytest.mark.parametrize(
    "tx",
    [
        optax.sgd(NAN),  # the learning rate only in the update's closure
        optax.adam(jnp.float32(NAN)),  # as an array
        optax.sgd(0.1, momentum=NAN),
        optax.sgd(optax.linear_schedule(NAN, 0.0, 10)),  # a schedule
    ],
    ids=["sgd", "adam_array", "momentum", "schedule"],
)
def test_a_nan_setting_in_the_optimizers_closure_is_refused_before_the_first_step(tx):
    """Issue 44: optax.sgd(float("nan")) trained silently (NaN from the first update)."""
    model = MLP()
    params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
    state = fdp.replicate(TrainState.create(apply_fn=model.apply, params=params, tx=tx))
    step = fdp.train_step(cross_entropy(model.apply))
    with pytest.raises(ValueError, match="the optimizer's update computes with a NaN constant"):
        step(state, fdp.shard_batch(make_data(0, 16)))
    nnx_model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(nnx_model, tx, wrt=nnx.Param)
    nnx_step = fdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2))
    with pytest.raises(ValueError, match="the optimizer's update computes with a NaN constant"):
        nnx_step(nnx_model, optimizer, fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones(8)}))


def test_nan_and_inf_constants_an_optimizer_holds_on_purpose_are_not_refused():
    params = {"w": jnp.ones(3)}
    for tx in (
        optax.chain(optax.clip_by_global_norm(float("inf")), optax.sgd(0.1)),  # inf: no clip
        optax.contrib.schedule_free_sgd(0.1),  # a NaN fill inside a jnp.where
    ):
        assert _finite.nan_constants(tx, tx.init(params), params) == []


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_guard_names_the_device_of_a_scanned_stacks_nan(monkeypatch, zero_stage):
    # Reduced inside the backward loop, a stack's gradient is every device's before the
    # guard reads it: with the guard on, stacks are reduced after the backward pass.
    from test_per_layer import Stack, data, linen_loss, linen_state

    monkeypatch.setenv(_finite.ENV_VAR, "1")
    model = Stack(depth=8)
    step = fdp.train_step(linen_loss(model), sharding=fdp.Sharding(zero_stage=zero_stage))
    state = fdp.replicate(linen_state(model))
    batch = data(steps=1)[0]
    batch["x"][9] = np.nan  # 8 devices x 4 rows: row 9 is on device 2
    with pytest.raises(FloatingPointError) as info:
        step(state, fdp.shard_batch(batch))
    message = str(info.value)
    assert "first on process 0: device 2 (process 0): loss and gradients." in message
    assert "The other devices' values were finite" in message
