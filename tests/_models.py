"""Small Flax models, a single-device reference trainer and step helpers shared by the tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training.train_state import TrainState

import fdp


class MLP(nn.Module):
    features: tuple = (32, 16)
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for f in self.features:
            x = nn.relu(nn.Dense(f)(x))
        return nn.Dense(self.classes)(x)


class CNN(nn.Module):
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))


MODELS = {"mlp": MLP, "cnn": CNN}
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(1e-2)}


def make_data(seed, num, shape=(8, 8, 1), classes=10):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(num, *shape)).astype(np.float32),
        "y": rng.integers(0, classes, size=(num,)).astype(np.int32),
    }


def make_state(model_name, opt_name, seed=0):
    model = MODELS[model_name]()
    params = model.init(jax.random.key(seed), jnp.zeros((1, 8, 8, 1)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=OPTIMIZERS[opt_name]())


def cross_entropy(apply_fn):
    def loss_fn(params, batch):
        logits = apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn


def reference_steps(state, batches, loss_fn):
    """Plain optax on one device, on each full (concatenated) batch."""
    device = jax.devices()[0]
    state = jax.device_put(state, device)

    @jax.jit
    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for batch in batches:
        state, loss = step(state, jax.device_put(batch, device))
        losses.append(float(loss))
    return state, losses


def train_tiny_buckets(model, params, tx, batches, *, hook, layout, cap_mb=0.004):
    """``fdp.train_step`` of ``model`` with buckets of a few KiB (several per step), run
    from ``params`` over ``batches`` (placed); returns ``(state, step)``."""
    import fdp

    state = fdp.replicate(TrainState.create(apply_fn=None, params=params, tx=tx))
    step = fdp.train_step(
        cross_entropy(model.apply),
        reduction=fdp.Reduction(
            comm_hook=hook, layout=layout, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb / 2
        ),
    )
    for batch in batches:
        state, _ = step(state, batch)
    return state, step


def train_on(step, state, data, mesh=None):
    """``state`` after one ``step`` per batch of ``data``; the last step's metrics too."""
    for batch in data:
        state, metrics = step(state, fdp.shard_batch(batch, mesh))
    return state, metrics


def device0_bytes(tree):
    """Bytes device 0 holds of a tree of global arrays (from its addressable shards)."""
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == jax.devices()[0]
    )


class NNXMLP(nnx.Module):
    """A 64 -> 32 -> 10 NNX MLP on the 8x8x1 images of ``make_data``."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x.reshape(x.shape[0], -1))))


def nnx_cross_entropy(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()
