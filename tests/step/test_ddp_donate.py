"""``fdp.ddp(donate_argnums=...)``: jax.jit's donation, on the program alone and the full path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fdp


def _loss(w, x):
    return jnp.mean((x @ w) ** 2)


def _sgd(w, x, reduce=fdp.reduce_gradients):
    loss, grads = jax.value_and_grad(_loss)(w, x)
    return w - 0.1 * reduce(grads), loss


def _batches():
    rng = np.random.default_rng(0)
    return [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(4)]


@pytest.mark.parametrize("devices", [1, 8], ids=["one-device", "eight-devices"])
def test_a_donated_argument_is_reused_and_the_steps_equal_one_device(devices):
    mesh = fdp.data_mesh(jax.devices()[:devices])
    step = fdp.ddp(_sgd, mesh=mesh, batch_argnums=1, donate_argnums=0)
    w = fdp.replicate(jnp.ones((3, 1)), mesh)
    want = np.ones((3, 1), np.float32)
    for x in _batches():
        old = w
        w, loss = step(w, fdp.shard_batch(x, mesh=mesh))
        assert old.is_deleted()  # its buffers went to the new w
        want, want_loss = _sgd(want, x, reduce=lambda g: g)  # one device, the whole batch
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(w), np.asarray(want), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"donate_argnums \(argument 0 \(w\)\) was donated"):
        step(old, fdp.shard_batch(_batches()[0], mesh=mesh))


def test_donate_argnums_naming_what_cannot_be_donated_is_refused():
    with pytest.raises(ValueError, match="donate_argnums must be non-negative"):
        fdp.ddp(_sgd, batch_argnums=1, donate_argnums=-1)
    with pytest.raises(TypeError, match="donate_argnums must be an int or a tuple of ints"):
        fdp.ddp(_sgd, batch_argnums=1, donate_argnums="w")
    x = fdp.shard_batch(_batches()[0])
    step = fdp.ddp(_sgd, batch_argnums=1, donate_argnums=2)
    with pytest.raises(ValueError, match="names position 2, but the step was called with 2"):
        step(jnp.ones((3, 1)), x)

    def scaled(w, x, scale):
        return _sgd(w * scale, x)

    step = fdp.ddp(scaled, batch_argnums=1, static_argnums=2, donate_argnums=2)
    with pytest.raises(ValueError, match=r"argument 2 \(scale\) is static"):
        step(jnp.ones((3, 1)), x, 2.0)
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

    def nnx_step(model, x):
        return _loss(model.kernel[...], x)

    step = fdp.ddp(nnx_step, batch_argnums=1, donate_argnums=0)
    with pytest.raises(ValueError, match="is an NNX object, updated in place"):
        step(model, x)
