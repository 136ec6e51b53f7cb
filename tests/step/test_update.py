"""The update written once (fdp/step/core/_update.py): both front ends, stage 0 and ZeRO alike."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fdp
from fdp.step.core._step import Step


class Routed(nnx.Module):
    """Each device takes branch ``a`` or ``b`` from its own data (``route > 0``: ``a``)."""

    def __init__(self):
        rng = np.random.default_rng(1)
        self.body = nnx.Param(jnp.asarray(rng.normal(size=(3, 4)), jnp.float32))
        self.a = nnx.Param(jnp.asarray(rng.normal(size=(4, 2)), jnp.float32))
        self.b = nnx.Param(jnp.asarray(rng.normal(size=(4, 2)), jnp.float32))

    def __call__(self, x, route):
        h = x @ self.body[...]
        a, b = self.a[...], self.b[...]
        return jax.lax.cond(jnp.mean(route) > 0, lambda h: h @ a, lambda h: h @ b, h)


def routed_loss(model, batch):
    return jnp.mean((model(batch["x"], batch["route"]) - batch["y"]) ** 2)


def routed(seed, route):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(16, 3)).astype(np.float32),
        "y": rng.normal(size=(16, 2)).astype(np.float32),
        "route": np.full(16, route, np.float32),
    }


def run(stage):
    model = Routed()
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    step = fdp.nnx_train_step(
        routed_loss,
        loss=fdp.Loss(find_unused_parameters=True),
        sharding=fdp.Sharding(zero_stage=stage),
    )
    # Branch b first, so it has Adam moments; then a alone, when b must stay as it is.
    for seed, route in [(0, -1.0), (1, 1.0), (2, 1.0)]:
        step(model, optimizer, fdp.shard_batch(routed(seed, route)))
    return step, model, optimizer


@pytest.mark.parametrize("stage", [1, 3])
def test_nnx_zero_keeps_an_unused_parameter_and_its_moments_as_stage_0(stage):
    _, want_model, want_opt = run(0)
    step, model, optimizer = run(stage)
    assert isinstance(step, fdp.NNXDataParallelStep) and isinstance(step, Step)
    mu = optimizer.opt_state[0].mu
    # b (4 x 2) has no dimension 8 divides: its moments are kept padded to 8 x 2.
    got, want = np.asarray(mu["b"][...]), np.asarray(want_opt.opt_state[0].mu["b"][...])
    assert got.shape == (8, 2) and not got[4:].any()
    np.testing.assert_allclose(got[:4], want, rtol=1e-6)
    assert got.any()  # moved by the first step, kept after it
    for name in ("body", "a", "b"):
        np.testing.assert_allclose(
            getattr(model, name)[...], getattr(want_model, name)[...], rtol=1e-5, atol=1e-6
        )


def test_both_front_ends_are_the_one_step_class():
    linen = fdp.train_step(lambda p, b: jnp.mean(b @ p))
    nnx_step = fdp.nnx_train_step(lambda m, b: jnp.mean(m(b)))
    assert isinstance(linen, Step) and isinstance(linen, fdp.DataParallelStep)
    assert isinstance(nnx_step, Step) and not isinstance(nnx_step, fdp.DataParallelStep)
    assert type(linen)._global_step is type(nnx_step)._global_step
