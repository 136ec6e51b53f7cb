"""Flax's NNX MNIST tutorial, on scikit-learn's digits.

Reconstructed with the tutorial's structure (a CNN with BatchNorm and dropout;
``@nnx.jit`` ``train_step(model, optimizer, metrics, rngs, batch)`` that
updates an ``nnx.MultiMetric`` inside, with the dropout ``nnx.Rngs`` passed as
an argument; ``eval_step``), on 8x8 digits (offline) instead of MNIST. The
files ``*_original.py`` (one device), ``*_plain_jax.py`` and ``*_fdp.py``
(data-parallel) differ only in the lines docs/porting.md shows.
"""

import types
from functools import partial

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import fdp


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(256, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


def loss_fn(model: CNN, rngs: nnx.Rngs | None, batch):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


@fdp.ddp(batch_argnums=4)
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs, batch):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, rngs, batch)
    grads = fdp.reduce_gradients(grads)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


@fdp.ddp(batch_argnums=2)
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, None, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.


def get_datasets():
    """Load the digits train and test sets into memory (1,437 and 360 images)."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=360, random_state=0, stratify=labels
    )
    return {"image": x_tr, "label": y_tr}, {"image": x_te, "label": y_te}


def batches(ds, batch_size, seed):
    """The dataset in shuffled batches (the incomplete last batch skipped)."""
    perm = np.random.default_rng(seed).permutation(len(ds["label"]))
    for i in range(len(perm) // batch_size):
        idx = perm[i * batch_size : (i + 1) * batch_size]
        yield {k: v[idx] for k, v in ds.items()}


def train_and_evaluate(config):
    """Execute model training and evaluation loop."""
    train_ds, test_ds = get_datasets()
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, optax.adamw(config.learning_rate, config.momentum), wrt=nnx.Param
    )
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    rngs = nnx.Rngs(0)
    history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}

    for epoch in range(1, config.num_epochs + 1):
        model.train()  # Switch to training mode.
        for batch in batches(train_ds, config.batch_size, epoch):
            train_step(model, optimizer, metrics, rngs, batch)
        for metric, value in metrics.compute().items():
            history[f"train_{metric}"].append(float(value))
        metrics.reset()

        model.eval()  # Switch to evaluation mode.
        for test_batch in batches(test_ds, config.batch_size, 0):
            eval_step(model, metrics, test_batch)
        for metric, value in metrics.compute().items():
            history[f"test_{metric}"].append(float(value))
        metrics.reset()
        print(
            f"epoch:{epoch:3}, train_loss: {history['train_loss'][-1]:.4f}, "
            f"train_accuracy: {history['train_accuracy'][-1] * 100:.2f}, "
            f"test_loss: {history['test_loss'][-1]:.4f}, "
            f"test_accuracy: {history['test_accuracy'][-1] * 100:.2f}"
        )
    return model, history


CONFIG = types.SimpleNamespace(learning_rate=0.005, momentum=0.9, batch_size=120, num_epochs=10)

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # simulated CPU devices; GPUs are used as they are
    train_and_evaluate(CONFIG)
