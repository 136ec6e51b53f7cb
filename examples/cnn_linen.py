"""A small CNN on scikit-learn's digits with fdp.train_step (Flax Linen): the pieces to copy.

BatchNorm (its statistics kept in step across devices), dropout (a different mask on
each device), Adam, gradient accumulation, a comm hook (bf16 compression), a
checkpoint to resume from, and data-parallel evaluation. Runs offline; without a GPU
it simulates 8 CPU devices.

    python examples/cnn_linen.py --steps 300
    python examples/cnn_linen.py --steps 600 --ckpt-dir /tmp/cnn  # run again: it resumes
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import fdp


class CNN(nn.Module):
    """Two conv blocks (conv, BatchNorm, relu, pool), dropout, a dense head."""

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        for features in (32, 64):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(nn.Dense(128)(x)))
        return nn.Dense(10)(x)


def load() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=360, random_state=0, stratify=y)
    return {"x": x_tr, "y": y_tr}, {"x": x_te, "y": y_te}


def batch_at(train: dict[str, np.ndarray], step: int, batch_size: int) -> dict[str, np.ndarray]:
    """The batch of global step ``step``: a function of the step, so a resumed run
    sees the batches the interrupted one would have."""
    per_epoch = len(train["y"]) // batch_size
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng(epoch).permutation(len(train["y"]))
    idx = perm[i * batch_size : (i + 1) * batch_size]
    return {k: v[idx] for k, v in train.items()}


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
    model = CNN()
    variables = model.init(jax.random.key(0), train["x"][:1], train=False)
    state = fdp.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.adam(args.lr),
    )

    # With batch_stats on the state, the loss takes and returns them; with has_aux it
    # returns (loss, (aux, new_batch_stats)). The rng is folded per device by the step.
    def loss_fn(params, batch, batch_stats, rng):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats},
            batch["x"],
            train=True,
            rngs={"dropout": rng},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss, ({"accuracy": accuracy}, updates["batch_stats"])

    step = fdp.train_step(
        loss_fn,
        loss=fdp.Loss(has_aux=True),
        # DDP's no_sync: one reduction per step of accumulate_steps micro-batches
        accumulation=fdp.Accumulation(steps=args.accumulate_steps),
        reduction=fdp.Reduction(comm_hook=args.comm_hook),
        buffers="broadcast",  # BatchNorm statistics: device 0's, as DDP's default
    )
    state = step.init(fdp.replicate(state))  # placed and given the hook's state

    start = 0
    ckpt = fdp.CheckpointManager(args.ckpt_dir, max_to_keep=2) if args.ckpt_dir else None
    if ckpt is not None and ckpt.latest_step() is not None:
        restored = ckpt.restore(state)  # the prepared state is the template
        state, start = restored.state, restored.data_position["step"]
        print(f"resumed from step {start}")

    # Evaluation: one line, data-parallel (the test set split over the devices).
    predict = fdp.data_parallel(lambda v, x: model.apply(v, x, train=False))

    key = jax.random.key(1)
    metrics: dict = {}
    for i in range(start, args.steps):
        batch = fdp.shard_batch(batch_at(train, i, args.batch_size))
        state, metrics = step(state, batch, jax.random.fold_in(key, i))
        if ckpt is not None and (i + 1) % args.ckpt_every == 0:
            ckpt.save(i + 1, state, data_position={"step": i + 1})
    if ckpt is not None:
        if ckpt.latest_step() != args.steps and args.steps > start:
            ckpt.save(args.steps, state, data_position={"step": args.steps})
        ckpt.close()

    logits = predict({"params": state.params, "batch_stats": state.batch_stats}, test["x"])
    result = {
        "train_loss": float(metrics["loss"]) if metrics else float("nan"),
        "test_accuracy": float(np.mean(np.argmax(logits, -1) == test["y"])),
    }
    print(
        f"step {int(state.step)}: train loss {result['train_loss']:.6f}, "
        f"test accuracy {result['test_accuracy']:.4f}"
    )
    return result


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # simulated CPU devices; GPUs are used as they are
    main()
