"""Data-parallel training of an MLP on scikit-learn's handwritten digits with fdp.

The dataset (1,797 8x8 images, 10 classes) ships inside scikit-learn, so this runs
offline. Without a GPU it simulates 8 CPU devices; with GPUs it uses all of them.

    python examples/train_digits.py

With several processes, as DDP runs one per GPU, each process reads its own shard of
the training set (fdp.DistributedSampler) and feeds its local batch; on CPU each of
the N processes simulates 8 / N devices, so the mesh is the same 8 devices:

    fdp launch --nproc-per-node 2 examples/train_digits.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Simulated CPU devices must be configured before JAX starts its backend. The
# flag only shapes the CPU platform: with GPUs present, jax.devices() lists them.
# Under `fdp launch`, LOCAL_WORLD_SIZE processes share this host's 8 devices.
os.environ.setdefault(
    "FDP_DEMO_CPU_DEVICES", str(max(1, 8 // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
)

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ["FDP_DEMO_CPU_DEVICES"]))

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

import fdp  # noqa: E402


class MLP(nn.Module):
    """Two hidden layers of 256 units."""

    hidden: int = 256
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(x)


def load(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return {"x": x_tr, "y": y_tr}, {"x": x_te, "y": y_te}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument(
        "--comm-hook",
        default="allreduce",
        choices=sorted(fdp.hooks.HOOKS),
        help="comm hook applied to every gradient bucket",
    )
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument(
        "--powersgd-start",
        type=int,
        default=10,
        help="plain all-reduce steps before PowerSGD compresses",
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        default=0,
        choices=(0, 1, 2, 3),
        help="ZeRO: shard the optimizer state (1), also gradients (2), also parameters (3)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.0,
        help="exit with status 1 below this held-out accuracy",
    )
    args = parser.parse_args(argv)

    fdp.init()  # joins the other processes under `fdp launch`; alone, joins none
    lead = fdp.process_index() == 0  # process 0 reports
    devices = jax.devices()  # every process's devices
    mesh = fdp.data_mesh(devices)
    processes = f" over {fdp.process_count()} processes" if fdp.process_count() > 1 else ""
    if lead:
        print(
            f"fdp {fdp.__version__}: {len(devices)} {devices[0].platform} device(s), "
            f"mesh {dict(mesh.shape)}{processes}"
        )
    if args.batch_size % len(devices):
        parser.error(f"--batch-size must be a multiple of the {len(devices)} devices")

    train, test = load(args.seed)
    model = MLP()
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, 64)))["params"]
    # With several processes, every one starts from process 0's state.
    state = fdp.replicate(
        fdp.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(args.lr)), mesh
    )

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    hook = args.comm_hook
    if hook in ("powersgd", "batched_powersgd"):
        hook = fdp.hooks.HOOKS[hook](
            matrix_approximation_rank=args.powersgd_rank, start_powersgd_iter=args.powersgd_start
        )
    step = fdp.train_step(
        loss_fn,
        mesh=mesh,
        loss=fdp.Loss(has_aux=True),
        reduction=fdp.Reduction(bucket_cap_mb=args.bucket_cap_mb, comm_hook=hook),
        sharding=fdp.Sharding(zero_stage=args.zero_stage),
    )

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(model.apply({"params": params}, x), -1) == y)

    # This process's shard of the training set, reshuffled every epoch, and its
    # share of each global batch (shard_batch assembles them in process order).
    sampler = fdp.DistributedSampler(len(train["y"]), shuffle=True, seed=args.seed, drop_last=True)
    local_batch = args.batch_size // fdp.process_count()
    steps_per_epoch = sampler.num_batches(local_batch)  # drops the last partial batch
    start = time.perf_counter()
    bar = tqdm(range(args.epochs), desc="train", unit="epoch", file=sys.stdout, disable=not lead)
    for epoch in bar:
        sampler.set_epoch(epoch)
        for idx in sampler.batches(local_batch):
            batch = fdp.shard_batch({k: v[idx] for k, v in train.items()}, mesh)
            state, metrics = step(state, batch)
        bar.set_postfix(
            loss=f"{float(metrics['loss']):.4f}", acc=f"{float(metrics['aux']['accuracy']):.3f}"
        )
    elapsed = time.perf_counter() - start

    plan = step.plan
    if args.zero_stage == 3:  # parameters sharded over every process: gather them whole
        params = multihost_utils.process_allgather(state.params, tiled=True)
    else:  # every replica holds the same parameters: evaluate this process's own copy
        params = jax.tree.map(lambda x: x.addressable_data(0), state.params)
    acc = float(accuracy(params, test["x"], test["y"]))
    if lead:
        print(
            f"buckets: {len(plan.buckets)} ({', '.join(f'{b.nbytes} B' for b in plan.buckets)}), "
            f"comm hook {step.config.comm_hook.name}"
        )
        if args.zero_stage:
            print(step.memory_table())
        print(f"trained {args.epochs * steps_per_epoch} steps in {elapsed:.1f} s")
        print(f"held-out accuracy: {acc:.4f} on {len(test['y'])} images")
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
