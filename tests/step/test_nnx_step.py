"""fdp.nnx_train_step: NNX models match single-device training on the full batch."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_data
from flax import nnx

import fdp


class Net(nnx.Module):
    def __init__(self, rngs, *, norm=False, dropout=0.0):
        self.l1 = nnx.Linear(64, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs) if norm else None
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.l2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.l1(x.reshape(x.shape[0], -1))
        if self.norm is not None:
            x = self.norm(x)
        x = nnx.relu(x)
        if self.drop is not None:
            x = self.drop(x)
        return self.l2(x)


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def params_of(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize(
    "tx", [optax.sgd(0.1, momentum=0.9), optax.adamw(1e-2)], ids=["sgd", "adamw"]
)
def test_matches_single_device_on_the_full_batch(n, tx):
    batches = [make_data(seed, 16) for seed in range(3)]
    ref = Net(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    mesh = fdp.data_mesh(jax.devices()[:n])
    step = fdp.nnx_train_step(loss_fn, mesh=mesh, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
    for batch in batches:
        want_loss = ref_step(ref, ref_opt, batch)
        metrics = step(model, opt, fdp.shard_batch(batch, mesh))
        np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-5)
    chex.assert_trees_all_close(params_of(model), params_of(ref), rtol=1e-5, atol=1e-6)
    assert int(opt.step[...]) == 3
    assert len(step.plan.buckets) == 4


def test_batch_stats_take_device_zero_values():
    batch = make_data(0, 16)
    model = Net(nnx.Rngs(0), norm=True)
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    fdp.nnx_train_step(loss_fn)(model, opt, fdp.shard_batch(batch))

    ref = Net(nnx.Rngs(0), norm=True)  # same init; device 0 saw examples 0 and 1
    ref(batch["x"][:2])
    np.testing.assert_allclose(model.norm.mean[...], ref.norm.mean[...], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(model.norm.var[...], ref.norm.var[...], rtol=1e-5, atol=1e-7)
    assert model.norm.mean[...].sharding.is_fully_replicated


def test_dropout_draws_differ_across_devices():
    # aux is averaged over devices: one mask shared by all 8 devices would
    # average to 0s and 2s (inverted dropout at rate 0.5); 8 masks do not.
    model = Net(nnx.Rngs(0), dropout=0.5)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def with_mask(model, batch):
        return loss_fn(model, batch), model.drop(jnp.ones(256))

    step = fdp.nnx_train_step(with_mask, has_aux=True)
    first = step(model, opt, fdp.shard_batch(make_data(0, 8)))["aux"]
    second = step(model, opt, fdp.shard_batch(make_data(0, 8)))["aux"]
    assert not np.all(np.isin(np.asarray(first), [0.0, 2.0]))
    np.testing.assert_allclose(float(first.mean()), 1.0, atol=0.2)
    assert not np.allclose(first, second)  # and the stream advances between steps


def test_bad_input_is_a_clear_error():
    model = Net(nnx.Rngs(0))
    step = fdp.nnx_train_step(loss_fn)
    with pytest.raises(TypeError, match="optimizer must be an nnx.Optimizer, got dict"):
        step(model, {}, make_data(0, 8))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="divisible by the 8 devices"):
        step(model, opt, make_data(0, 4))
    assert jnp.all(model.l1.kernel[...] == Net(nnx.Rngs(0)).l1.kernel[...])


def test_the_step_compiles_once_for_a_model_not_yet_on_the_mesh():
    traces = []

    def counting_loss(model, batch):
        traces.append(1)
        return loss_fn(model, batch)

    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fdp.nnx_train_step(counting_loss)
    batch = fdp.shard_batch(make_data(0, 16))
    step(model, opt, batch)
    after_first = len(traces)
    step(model, opt, batch)
    step(model, opt, batch)
    assert len(traces) == after_first  # no new trace: no second compilation
    assert model.l1.kernel[...].sharding.is_fully_replicated
