"""Flax's Linen MNIST example (examples/mnist/train.py), on scikit-learn's digits.

Reconstructed with the original's structure (``apply_model`` returns the
gradients, loss and accuracy; ``update_model`` applies them; ``train_epoch``;
``train_and_evaluate``), on 8x8 digits (offline) instead of MNIST. The files
``*_original.py`` (one device), ``*_plain_jax.py`` and ``*_fdp.py`` (data-parallel)
differ only in the lines docs/porting.md shows.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import fdp


class CNN(nn.Module):
    """A simple CNN model."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


@fdp.ddp(batch_argnums=(1, 2))
def apply_model(state, images, labels):
    """Computes gradients, loss and accuracy for a single batch."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, 10)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        return loss, logits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(state.params)
    grads = fdp.reduce_gradients(grads)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return grads, loss, accuracy


@jax.jit
def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def train_epoch(state, train_ds, batch_size, rng):
    """Train for a single epoch."""
    train_ds_size = len(train_ds["image"])
    steps_per_epoch = train_ds_size // batch_size

    perms = jax.random.permutation(rng, len(train_ds["image"]))
    perms = perms[: steps_per_epoch * batch_size]  # skip incomplete batch
    perms = np.asarray(perms).reshape((steps_per_epoch, batch_size))

    epoch_loss = []
    epoch_accuracy = []

    for perm in perms:
        batch_images = train_ds["image"][perm, ...]
        batch_labels = train_ds["label"][perm, ...]
        grads, loss, accuracy = apply_model(state, batch_images, batch_labels)
        state = update_model(state, grads)
        epoch_loss.append(loss)
        epoch_accuracy.append(accuracy)
    train_loss = np.mean(epoch_loss)
    train_accuracy = np.mean(epoch_accuracy)
    return state, train_loss, train_accuracy


def get_datasets():
    """Load the digits train and test sets into memory (1,437 and 360 images)."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=360, random_state=0, stratify=labels
    )
    return {"image": x_tr, "label": y_tr}, {"image": x_te, "label": y_te}


def create_train_state(rng, config):
    """Creates initial `TrainState`."""
    cnn = CNN()
    params = cnn.init(rng, jnp.ones([1, 8, 8, 1]))["params"]
    tx = optax.sgd(config.learning_rate, config.momentum)
    return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


def train_and_evaluate(config):
    """Execute model training and evaluation loop."""
    train_ds, test_ds = get_datasets()
    rng = jax.random.key(0)

    rng, init_rng = jax.random.split(rng)
    state = create_train_state(init_rng, config)

    for epoch in range(1, config.num_epochs + 1):
        rng, input_rng = jax.random.split(rng)
        state, train_loss, train_accuracy = train_epoch(
            state, train_ds, config.batch_size, input_rng
        )
        _, test_loss, test_accuracy = apply_model(state, test_ds["image"], test_ds["label"])
        print(
            f"epoch:{epoch:3}, train_loss: {train_loss:.4f}, "
            f"train_accuracy: {train_accuracy * 100:.2f}, test_loss: {test_loss:.4f}, "
            f"test_accuracy: {test_accuracy * 100:.2f}"
        )
    return state


CONFIG = types.SimpleNamespace(learning_rate=0.1, momentum=0.9, batch_size=128, num_epochs=10)

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # simulated CPU devices; GPUs are used as they are
    train_and_evaluate(CONFIG)
