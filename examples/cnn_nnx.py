"""A small CNN on scikit-learn's digits with fdp.nnx_train_step (Flax NNX): the pieces to copy.

BatchNorm (its statistics kept in step across devices), dropout (a different mask on
each device), Adam, gradient accumulation, a comm hook (bf16 compression), a
checkpoint to resume from, and data-parallel evaluation with an ``nnx.MultiMetric``.
Runs offline; without a GPU it simulates 8 CPU devices.

    python examples/cnn_nnx.py --steps 300
    python examples/cnn_nnx.py --steps 600 --ckpt-dir /tmp/cnn_nnx  # run again: it resumes
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import fdp


class CNN(nnx.Module):
    """Two conv blocks (conv, BatchNorm, relu, pool), dropout, a dense head."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.norm1 = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.norm2 = nnx.BatchNorm(64, momentum=0.9, rngs=rngs)
        self.dense = nnx.Linear(4 * 64, 128, rngs=rngs)
        # The dropout stream lives in the model: fdp.nnx_train_step folds it per device.
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for conv, norm in ((self.conv1, self.norm1), (self.conv2, self.norm2)):
            x = nnx.avg_pool(nnx.relu(norm(conv(x))), (2, 2), strides=(2, 2))
        x = self.dropout(nnx.relu(self.dense(x.reshape(x.shape[0], -1))))
        return self.head(x)


def load() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=360, random_state=0, stratify=y)
    return {"x": x_tr, "y": y_tr}, {"x": x_te, "y": y_te}


def batch_at(train: dict[str, np.ndarray], step: int, batch_size: int) -> dict[str, np.ndarray]:
    """The batch of global step ``step``, so a resumed run sees the same batches."""
    per_epoch = len(train["y"]) // batch_size
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng(epoch).permutation(len(train["y"]))
    idx = perm[i * batch_size : (i + 1) * batch_size]
    return {k: v[idx] for k, v in train.items()}


def loss_fn(model: CNN, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


@fdp.ddp(batch_argnums=2)  # evaluation, data-parallel: the test set is split over the devices
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch: dict) -> None:
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    metrics.update(loss=loss, logits=logits, labels=batch["y"])


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--accumulate-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--comm-hook", default="bf16_compress", choices=sorted(fdp.hooks.HOOKS))
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint here and resume from it")
    parser.add_argument("--ckpt-every", type=int, default=100)
    args = parser.parse_args(argv)

    train, test = load()
    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
    step = fdp.nnx_train_step(
        loss_fn,
        loss=fdp.Loss(has_aux=True),
        # DDP's no_sync: one reduction per step of accumulate_steps micro-batches
        accumulation=fdp.Accumulation(steps=args.accumulate_steps),
        reduction=fdp.Reduction(comm_hook=args.comm_hook),
    )
    # Placed on the mesh; comm_state holds a stateful hook's state (PowerSGD's), passed
    # to every step and checkpointed with the model and optimizer.
    comm_state = step.init(model, optimizer)
    objects = (model, optimizer, comm_state)

    start = 0
    ckpt = fdp.CheckpointManager(args.ckpt_dir, max_to_keep=2) if args.ckpt_dir else None
    if ckpt is not None and ckpt.latest_step() is not None:
        # The whole state of the objects is one pytree: restore it into the current
        # one (the template) and write it back into the objects.
        restored = ckpt.restore(nnx.state(objects))
        nnx.update(objects, restored.state)
        start = restored.data_position["step"]
        print(f"resumed from step {start}")

    metrics: dict = {}
    model.train()
    for i in range(start, args.steps):
        batch = fdp.shard_batch(batch_at(train, i, args.batch_size))
        metrics = step(model, optimizer, batch, comm_state=comm_state)
        if ckpt is not None and (i + 1) % args.ckpt_every == 0:
            ckpt.save(i + 1, nnx.state(objects), data_position={"step": i + 1})
    if ckpt is not None:
        if ckpt.latest_step() != args.steps and args.steps > start:
            ckpt.save(args.steps, nnx.state(objects), data_position={"step": args.steps})
        ckpt.close()

    model.eval()  # BatchNorm's running statistics, no dropout
    test_metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
    )
    eval_step(model, test_metrics, test)
    result = {
        "train_loss": float(metrics["loss"]) if metrics else float("nan"),
        "test_accuracy": float(test_metrics.compute()["accuracy"]),
    }
    print(
        f"step {int(optimizer.step[...])}: train loss {result['train_loss']:.6f}, "
        f"test accuracy {result['test_accuracy']:.4f}"
    )
    return result


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # simulated CPU devices; GPUs are used as they are
    main()
