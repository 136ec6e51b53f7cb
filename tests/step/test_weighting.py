"""How the step weighs losses, against torch's formulas re-derived in NumPy.

A linear model with per-example loss ``0.5 * (x @ w - y)**2`` has the gradient
``(x @ w - y) * x`` per example, so every expected update below is NumPy arithmetic
on torch's rules, with nothing from fdp:

- torch's ``no_sync`` adds the K micro-batch gradients (``.grad`` accumulates);
- DDP averages each rank's gradient of its own mean loss (each rank counts once);
- under ``Join``, a rank out of data contributes zero, and the sum is divided by the
  initial world size (``divide_by_initial_world_size=True``, the default) or by the
  ranks still joined (``False``).
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fdp

N, D = 8, 3  # devices, features


def loss_per_example(params, batch):
    return 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2


def mean_loss(params, batch):
    return loss_per_example(params, batch).mean()


def example_grads(w, x, y):
    return (x @ w - y)[:, None] * x  # one gradient per example


def sgd_update(loss_fn, batch, mask=None, **settings):
    """The parameter change of one SGD step with learning rate 1: minus the gradient."""
    w0 = np.linspace(-0.5, 0.5, D).astype(np.float32)
    state = fdp.TrainState.create(apply_fn=None, params={"w": jnp.asarray(w0)}, tx=optax.sgd(1.0))
    step = fdp.train_step(loss_fn, **settings)
    extra = {} if mask is None else {"mask": fdp.shard_batch(mask)}
    state, _ = step(fdp.replicate(state), fdp.shard_batch(batch), **extra)
    return w0, w0 - np.asarray(state.params["w"])


def joined_batch(lengths, batch_size=2, seed=0):
    """One step of fdp.join over per-device streams holding lengths[d] examples."""
    rng = np.random.default_rng(seed)
    streams = [
        [
            {
                "x": rng.normal(size=(n, D)).astype(np.float32),
                "y": rng.normal(size=n).astype(np.float32),
            }
        ]
        if n
        else []
        for n in lengths
    ]
    like = {"x": np.zeros((1, D), np.float32), "y": np.zeros(1, np.float32)}
    ((batch, mask),) = list(fdp.join(*streams, batch_size=batch_size, like=like))
    return batch, mask


# Real examples per device: full, partial and empty (out of data) devices.
LENGTHS = [2, 1, 0, 2, 2, 0, 1, 2]


@pytest.mark.parametrize("weighting", ["example", "device"])
@pytest.mark.parametrize("divide", [True, False])
def test_join_weighting_follows_torchs_formulas(weighting, divide):
    batch, mask = joined_batch(LENGTHS)
    w0, got = sgd_update(
        loss_per_example,
        batch,
        mask,
        per_example=True,
        weighting=weighting,
        divide_by_initial_world_size=divide,
    )
    g = example_grads(w0, batch["x"], batch["y"]) * mask[:, None]
    per_device = g.reshape(N, 2, D).sum(1)  # sums of real examples' gradients
    counts = mask.reshape(N, 2).sum(1)
    active = int((counts > 0).sum())
    if weighting == "device":  # torch: each rank's mean loss, divided by the world size
        means = per_device / np.maximum(counts, 1)[:, None]
        want = means.sum(0) / (N if divide else active)
    else:  # every real example the same; out-of-data devices count as average ones
        want = g.sum(0) / counts.sum() * (active / N if divide else 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_torchs_join_default_with_full_batches():
    # Ranks with full batches and ranks out of data: torch's default divides the sum of
    # the active ranks' mean gradients by the initial world size, 8, not by 5.
    lengths = [2, 2, 0, 2, 0, 2, 0, 2]
    batch, mask = joined_batch(lengths, seed=1)
    w0, got = sgd_update(loss_per_example, batch, mask, per_example=True)
    g = example_grads(w0, batch["x"], batch["y"]).reshape(N, 2, D)
    want = sum(g[d].mean(0) for d in range(N) if lengths[d]) / N
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    _, old = sgd_update(
        loss_per_example, batch, mask, per_example=True, divide_by_initial_world_size=False
    )
    np.testing.assert_allclose(old, want * N / 5, rtol=1e-5, atol=1e-7)  # fdp's old rule


def test_step_padding_is_not_a_device_out_of_data():
    # 13 examples on 8 devices: the step pads to 16, device 7 holds only its padding.
    # The update stays the mean over the 13 (DataParallel), whatever the Join option.
    rng = np.random.default_rng(2)
    batch = {"x": rng.normal(size=(13, D)).astype(np.float32), "y": rng.normal(size=13)}
    batch["y"] = batch["y"].astype(np.float32)
    w0 = np.linspace(-0.5, 0.5, D).astype(np.float32)
    want = example_grads(w0, batch["x"], batch["y"]).mean(0)
    for divide in (True, False):
        state = fdp.TrainState.create(
            apply_fn=None, params={"w": jnp.asarray(w0)}, tx=optax.sgd(1.0)
        )
        step = fdp.train_step(
            loss_per_example, per_example=True, divide_by_initial_world_size=divide
        )
        state, _ = step(fdp.replicate(state), batch)
        np.testing.assert_allclose(w0 - np.asarray(state.params["w"]), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_accumulation_mean_or_torchs_no_sync_sum(op):
    k, rng = 4, np.random.default_rng(3)
    batch = {"x": rng.normal(size=(k * N * 2, D)), "y": rng.normal(size=k * N * 2)}
    batch = {key: v.astype(np.float32) for key, v in batch.items()}
    w0, got = sgd_update(mean_loss, batch, accumulate_steps=k, accumulate_op=op)
    # Device d's share is rows [d*K*2, (d+1)*K*2), split into K micro-batches of 2.
    g = example_grads(w0, batch["x"], batch["y"]).reshape(N, k, 2, D)
    micro_means = g.mean(2)  # each micro-batch's gradient of its mean loss
    summed = micro_means.sum(1)  # torch: no_sync adds them into .grad
    want = summed.mean(0) if op == "sum" else summed.mean(0) / k  # then DDP's mean
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_per_example_accumulation_sum_is_k_times_the_mean():
    k, rng = 2, np.random.default_rng(4)
    batch = {"x": rng.normal(size=(k * N, D)), "y": rng.normal(size=k * N)}
    batch = {key: v.astype(np.float32) for key, v in batch.items()}
    w0, got = sgd_update(
        loss_per_example, batch, per_example=True, accumulate_steps=k, accumulate_op="sum"
    )
    want = k * example_grads(w0, batch["x"], batch["y"]).mean(0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_grad_accumulator_mean_or_sum(op):
    k, rng = 3, np.random.default_rng(5)
    w0 = np.linspace(-0.5, 0.5, D).astype(np.float32)
    state = fdp.TrainState.create(apply_fn=None, params={"w": jnp.asarray(w0)}, tx=optax.sgd(1.0))
    acc = fdp.grad_accumulator(mean_loss, accumulate_op=op)
    state = fdp.replicate(state)
    grads, want = acc.init(state), np.zeros(D)
    for _ in range(k):
        micro = {"x": rng.normal(size=(N, D)), "y": rng.normal(size=N)}
        micro = {key: v.astype(np.float32) for key, v in micro.items()}
        grads, _ = acc.accumulate(state, grads, fdp.shard_batch(micro))
        want += example_grads(w0, micro["x"], micro["y"]).mean(0)  # DDP: mean of 1-row ranks
    state, _ = acc.sync(state, grads)
    want = want if op == "sum" else want / k
    np.testing.assert_allclose(w0 - np.asarray(state.params["w"]), want, rtol=1e-5, atol=1e-7)


def test_settings_are_checked():
    with pytest.raises(ValueError, match=r"Accumulation.op must be one of \('mean', 'sum'\)"):
        fdp.train_step(mean_loss, accumulation=fdp.Accumulation(op="add"))
    with pytest.raises(ValueError, match=r"weighting must be one of \('example', 'device'\)"):
        fdp.train_step(loss_per_example, per_example=True, weighting="rank")
    with pytest.raises(ValueError, match=r"weighting='device' .* needs per_example=True"):
        fdp.train_step(mean_loss, weighting="device")
    with pytest.raises(ValueError, match=r"accumulate_op='sum'\) .* needs per_example=False"):
        fdp.grad_accumulator(loss_per_example, per_example=True, accumulate_op="sum")
