"""Flax's official NNX MNIST example, as ``benchmarks/step_overhead.py`` runs it.

The model, optimizer and batch follow ``examples/mnist/train.py`` of google/flax (the
NNX version of January 2026, which flax 0.12.8 ships with): a CNN with two
convolutions, BatchNorm after each, dropout (rate 0.025) before the first BatchNorm
and after the first dense layer, average pooling; ``optax.sgd(0.1, momentum=0.9)``;
batch 128; the dropout stream is an ``nnx.Rngs(0)`` handed to the model's call. fdp's
``loss_fn(model, batch)`` cannot take the stream as an argument, so both variants keep
it on a wrapper module (``Trainee.rngs``) that the loss reads: the same key and
counter, in the model state instead of a separate argument. The example also updates
an ``nnx.MultiMetric`` in its step; both variants here return the loss only.

Variants (timed in paired rounds by ``step_overhead.py``):

  fdp           fdp.nnx_train_step: per-device BatchNorm statistics, buffers from
                device 0 (DDP's BatchNorm)
  fdp-syncbn    the same with BatchNorm(axis_name="data") and buffers="mean": the
                global batch's statistics, what GSPMD computes for the jit variant
  jit           nnx.jit with the batch sharded (NamedSharding) and the state
                replicated: GSPMD inserts the all-reduces (the idiomatic baseline)
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

BATCH = 128
DROPOUT = 0.025


def make_classes(axis_name: str | None, dropout: float):
    from flax import nnx

    class CNN(nnx.Module):
        """The example's CNN (``examples/mnist/train.py``), BatchNorm axis optional."""

        def __init__(self, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm1 = nnx.BatchNorm(32, axis_name=axis_name, rngs=rngs)
            self.dropout1 = nnx.Dropout(rate=dropout)
            self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm2 = nnx.BatchNorm(64, axis_name=axis_name, rngs=rngs)
            self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
            self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
            self.dropout2 = nnx.Dropout(rate=dropout)
            self.linear2 = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x, rngs):
            x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
            x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
            x = x.reshape(x.shape[0], -1)
            x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
            return self.linear2(x)

    class Trainee(nnx.Module):
        """The CNN and the example's dropout stream ``nnx.Rngs(0)``."""

        def __init__(self):
            self.cnn = CNN(rngs=nnx.Rngs(0))
            self.rngs = nnx.Rngs(0)

    return Trainee


def loss_fn(model: Any, batch: dict) -> Any:
    import optax

    logits = model.cnn(batch["image"], model.rngs)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()


def make_batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.random((BATCH, 28, 28, 1), np.float32),
        "label": rng.integers(0, 10, BATCH).astype(np.int32),
    }


def build(mesh: Any, dropout: float = DROPOUT) -> dict[str, tuple]:
    """name -> (call(), lower(), state()) for each variant; call() runs one step."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import fdp

    batch = fdp.shard_batch(make_batch(), mesh)
    variants = {}

    def fdp_variant(axis_name, buffers):
        model = make_classes(axis_name, dropout)()
        opt = nnx.Optimizer(model, optax.sgd(0.1, 0.9), wrt=nnx.Param)
        step = fdp.nnx_train_step(loss_fn, mesh=mesh, buffers=buffers)
        return (
            lambda: step(model, opt, batch),
            lambda: step.lower(model, opt, batch),
            lambda: nnx.state(model),
        )

    variants["fdp"] = fdp_variant(None, "broadcast")
    variants["fdp-syncbn"] = fdp_variant("data", "mean")

    model = make_classes(None, dropout)()
    opt = nnx.Optimizer(model, optax.sgd(0.1, 0.9), wrt=nnx.Param)
    nnx.update((model, opt), jax.device_put(nnx.state((model, opt)), NamedSharding(mesh, P())))

    @nnx.jit(donate_argnums=(0, 1))
    def jit_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss}

    variants["jit"] = (
        lambda: jit_step(model, opt, batch),
        lambda: jit_step.lower(model, opt, batch),
        lambda: nnx.state(model),
    )
    return variants
