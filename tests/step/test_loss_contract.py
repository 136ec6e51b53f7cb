"""Loss-contract mistakes get fdp's message naming the fix, not a JAX tracer error."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fdp

BATCH = {"x": np.ones((16, 4), np.float32)}


def linen_state():
    return TrainState.create(apply_fn=None, params={"w": jnp.zeros(4)}, tx=optax.sgd(0.1))


def linen_loss(params, batch):
    return jnp.mean(batch["x"] @ params["w"])


def nnx_loss(model, batch):
    return jnp.mean(model(batch["x"]))


def nnx_call(loss_fn, **kwargs):
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    return fdp.nnx_train_step(loss_fn, **kwargs)(model, optimizer, BATCH)


FORGOT_AUX = (
    r"loss_fn returned a tuple of 2 \(an array float32\[\], dict\), but has_aux=False"
    r".*pass has_aux=True"
)


def test_linen_tuple_without_has_aux_names_the_fix():
    """On main: TracerArrayConversionError from jnp.shape(loss)."""
    step = fdp.train_step(lambda p, b: (linen_loss(p, b), {"n": 1}))
    with pytest.raises(TypeError, match=FORGOT_AUX):
        step(linen_state(), BATCH)


def test_nnx_tuple_without_has_aux_names_the_fix():
    with pytest.raises(TypeError, match=FORGOT_AUX):
        nnx_call(lambda m, b: (nnx_loss(m, b), {"n": 1}))


def test_aux_nested_one_level_too_deep_is_named():
    # has_aux=True but ((loss, aux), extra): the "loss" is itself a tuple.
    step = fdp.train_step(
        lambda p, b: ((linen_loss(p, b), {"n": 1}), None), has_aux=True, donate=False
    )
    with pytest.raises(TypeError, match=r"got a tuple of 2\. With has_aux=True .* too deep"):
        step(linen_state(), BATCH)
