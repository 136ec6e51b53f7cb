"""Per-example aux outputs (logits) come back gathered along the batch, not averaged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fdp

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 4)).astype(np.float32)
Y = RNG.integers(0, 3, size=16).astype(np.int32)
W = RNG.normal(size=(4, 3)).astype(np.float32)


def logits_of(params, x):
    return x @ params["w"]


def loss_fn(params, batch):
    logits = logits_of(params, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return loss.mean(), {"logits": logits, "correct": jnp.sum(jnp.argmax(logits, -1) == batch["y"])}


def state():
    return TrainState.create(apply_fn=None, params={"w": jnp.asarray(W)}, tx=optax.sgd(0.1))


def reference_logits(n):
    # One device, the whole batch: the logits before the update.
    return np.asarray(jax.jit(logits_of)({"w": jnp.asarray(W)}, X[:n]))


@pytest.mark.parametrize("accumulate_steps", [1, 2])
def test_linen_logits_are_gathered_in_batch_order(accumulate_steps):
    """On main: logits of shape (2, 3), averaged elementwise over the 8 devices."""
    step = fdp.train_step(loss_fn, has_aux=True, accumulate_steps=accumulate_steps)
    _, metrics = step(state(), {"x": X, "y": Y})
    np.testing.assert_allclose(metrics["aux"]["logits"], reference_logits(16), rtol=1e-5, atol=1e-5)
    # Counts still add up over devices.
    want = int(np.sum(np.argmax(reference_logits(16), -1) == Y))
    assert int(metrics["aux"]["correct"]) == want


def test_padded_per_example_batch_gives_one_row_per_real_example():
    def per_example(params, batch):
        logits = logits_of(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), logits

    step = fdp.train_step(per_example, has_aux=True, per_example=True)
    _, metrics = step(state(), {"x": X[:13], "y": Y[:13]})
    np.testing.assert_allclose(metrics["aux"], reference_logits(13), rtol=1e-5, atol=1e-5)


def test_gather_aux_false_keeps_the_device_mean():
    step = fdp.train_step(loss_fn, has_aux=True, gather_aux=False)
    _, metrics = step(state(), {"x": X, "y": Y})
    want = reference_logits(16).reshape(8, 2, 3).mean(0)
    np.testing.assert_allclose(metrics["aux"]["logits"], want, rtol=1e-5, atol=1e-5)


def test_gather_aux_naming_a_scalar_leaf_is_an_error():
    step = fdp.train_step(loss_fn, has_aux=True, gather_aux=lambda path: "correct" in path)
    with pytest.raises(ValueError, match=r"gather_aux names aux leaf \['correct'\].*\(\)"):
        step(state(), {"x": X, "y": Y})


def test_nnx_logits_are_gathered():
    model = nnx.Linear(4, 3, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.asarray(W)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def nnx_loss(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

    metrics = fdp.nnx_train_step(nnx_loss, has_aux=True)(model, optimizer, {"x": X, "y": Y})
    np.testing.assert_allclose(metrics["aux"], reference_logits(16), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accumulate_steps", [1, 2])
def test_python_numbers_in_aux_are_reduced_like_arrays(accumulate_steps):
    def loss_with_numbers(params, batch):
        loss, _ = loss_fn(params, batch)
        return loss, {"scale": 0.5, "count": 3}

    step = fdp.train_step(loss_with_numbers, has_aux=True, accumulate_steps=accumulate_steps)
    _, metrics = step(fdp.replicate(state()), fdp.shard_batch({"x": X, "y": Y}))
    # Floats are averaged; integers add up over micro-batches and the 8 devices.
    assert float(metrics["aux"]["scale"]) == 0.5
    assert int(metrics["aux"]["count"]) == 3 * accumulate_steps * 8
