"""Trains a 1 MiB-per-layer MLP over 2 processes x 1 CPU device (for tests).

    malloc_tuning.py --out params.npz [--steps 4]

The layers are large enough (256 KiB and more) that glibc serves XLA's buffers with
mmap unless fdp.init tunes malloc, so both allocator paths of the gloo reduction run.
Prints which mallopt settings fdp.init applied (none with FDP_MALLOC_TUNING=0).
"""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402
from fdp.backends.cpu import _memory  # noqa: E402

fdp.init(initialization_timeout=60)
rank = fdp.process_index()
print(f"malloc settings: {sorted(_memory.applied.items())}", flush=True)

rng = np.random.default_rng(0)
params = [
    {"w": rng.normal(size=(n, m)).astype(np.float32) / np.sqrt(n), "b": np.zeros(m, np.float32)}
    for n, m in ((256, 512), (512, 512), (512, 10))
]


def loss_fn(params, batch):
    x = batch["x"]
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()


state = fdp.replicate(TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1, 0.9)))
# Small buckets: several all-reduces per step, as in the benchmarks' best setting.
step = fdp.train_step(loss_fn, reduction=fdp.Reduction(bucket_cap_mb=1.0))
data = np.random.default_rng(10 + rank)
for _ in range(args.steps):
    batch = {
        "x": data.normal(size=(32, 256)).astype(np.float32),
        "y": data.integers(0, 10, 32).astype(np.int32),
    }
    state, metrics = step(state, fdp.shard_batch(batch))
if rank == 0:
    leaves = jax.tree.leaves(jax.device_get(state.params))
    np.savez(args.out, **{f"leaf{i}": leaf for i, leaf in enumerate(leaves)})
print(f"done: loss {float(metrics['loss']):.6f}", flush=True)
