"""Buffers (BatchNorm statistics): broadcast from device 0, averaged, or per device."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_data

import fdp


class BNNet(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name=self.axis_name)(x)
        return nn.Dense(10)(nn.relu(x))


def setup(axis_name=None):
    model = BNNet(axis_name)
    variables = BNNet().init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)))
    state = fdp.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.sgd(0.1),
        batch_stats=variables["batch_stats"],
    )

    def loss_fn(params, batch, batch_stats):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, updates["batch_stats"]

    return state, loss_fn


def stats_after_forward(state, x):
    _, updates = BNNet().apply(
        {"params": state.params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
    )
    return updates["batch_stats"]


def test_broadcast_gives_every_device_device_zeros_statistics():
    state, loss_fn = setup()
    batch = make_data(0, 16)
    new, _ = fdp.train_step(loss_fn, buffers="broadcast")(
        fdp.replicate(state), fdp.shard_batch(batch)
    )
    want = stats_after_forward(state, batch["x"][:2])  # device 0's two examples
    for leaf in jax.tree.leaves(new.batch_stats):
        assert leaf.sharding.is_fully_replicated
    chex.assert_trees_all_close(new.batch_stats, want, rtol=1e-5, atol=1e-6)


def test_mean_averages_the_statistics_over_devices():
    state, loss_fn = setup()
    batch = make_data(1, 16)
    new, _ = fdp.train_step(loss_fn, buffers="mean")(fdp.replicate(state), fdp.shard_batch(batch))
    per_device = [stats_after_forward(state, batch["x"][2 * d : 2 * d + 2]) for d in range(8)]
    want = jax.tree.map(lambda *s: np.mean(s, axis=0), *per_device)
    chex.assert_trees_all_close(new.batch_stats, want, rtol=1e-5, atol=1e-6)
    # The running mean is then exactly the full batch's (equal shares).
    full = stats_after_forward(state, batch["x"])
    np.testing.assert_allclose(
        new.batch_stats["BatchNorm_0"]["mean"], full["BatchNorm_0"]["mean"], rtol=1e-5, atol=1e-6
    )


def max_over_devices(buffers, axis_name):
    """A buffer comm hook (DDP's _register_buffer_comm_hook): the largest value wins."""
    return jax.tree.map(lambda x: jax.lax.pmax(x, axis_name), buffers)


def test_a_buffer_comm_hook_decides_how_statistics_are_synced():
    state, loss_fn = setup()
    batch = make_data(4, 16)
    step = fdp.train_step(loss_fn, buffers=max_over_devices)
    new, _ = step(fdp.replicate(state), fdp.shard_batch(batch))
    per_device = [stats_after_forward(state, batch["x"][2 * d : 2 * d + 2]) for d in range(8)]
    want = jax.tree.map(lambda *s: np.max(s, axis=0), *per_device)
    chex.assert_trees_all_close(new.batch_stats, want, rtol=1e-5, atol=1e-6)
    assert step.config.describe()["buffers"] == "max_over_devices"  # the same on every process


def test_local_keeps_one_copy_per_device():
    state, loss_fn = setup()
    batch = make_data(2, 16)
    step = fdp.train_step(loss_fn, buffers="local")
    new, _ = step(fdp.replicate(state), fdp.shard_batch(batch))
    new, _ = step(new, fdp.shard_batch(batch))  # the per-device copies carry on
    assert isinstance(new.batch_stats, fdp.PerDevice)
    mean = np.asarray(new.batch_stats.value["BatchNorm_0"]["mean"])
    assert mean.shape == (8, 16)
    assert not np.allclose(mean[0], mean[1])


@pytest.mark.parametrize("mode", ["broadcast", "mean"])
def test_sync_batchnorm_matches_full_batch_training(mode):
    state, loss_fn = setup(axis_name="data")  # nn.BatchNorm(axis_name='data'): SyncBatchNorm
    ref_state, ref_loss = setup(axis_name=None)
    step = fdp.train_step(loss_fn, buffers=mode)

    @jax.jit
    def ref_step(state, batch):
        (loss, stats), grads = jax.value_and_grad(ref_loss, has_aux=True)(
            state.params, batch, state.batch_stats
        )
        return state.apply_gradients(grads=grads, batch_stats=stats), loss

    state = fdp.replicate(state)
    for s in range(2):
        batch = make_data(s, 16)
        state, metrics = step(state, fdp.shard_batch(batch))
        ref_state, ref_loss_value = ref_step(ref_state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss_value), rtol=1e-5)
    chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.batch_stats, ref_state.batch_stats, rtol=1e-5, atol=1e-6)


def test_unknown_buffer_mode_is_rejected():
    _, loss_fn = setup()
    with pytest.raises(ValueError, match=r"buffers must be one of \('broadcast', 'mean', 'l"):
        fdp.train_step(loss_fn, buffers="sync")
    with pytest.raises(ValueError, match="buffers='local' keeps batch statistics once per device"):
        fdp.nnx_train_step(loss_fn, buffers="local")


def test_statistics_are_synced_under_hooks_jax_cannot_type():
    # quantize_per_tensor runs the step without replication tracking; buffers must
    # still be broadcast (they were left per device before a fix).
    state, loss_fn = setup()
    batch = make_data(3, 16)
    step = fdp.train_step(loss_fn, comm_hook="quantize_per_tensor")
    new, _ = step(fdp.replicate(state), fdp.shard_batch(batch))
    want = stats_after_forward(state, batch["x"][:2])
    chex.assert_trees_all_close(new.batch_stats, want, rtol=1e-5, atol=1e-6)
    for leaf in jax.tree.leaves(new.batch_stats):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])
