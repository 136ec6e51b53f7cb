"""ZeRO-3 state built sharded over 2 processes x 2 devices, checked on each process (for tests).

    fdp launch --nproc-per-node 2 tests/workers/sharded_init.py --ckpt-dir D

Each process compares its own shards of ``step.init_sharded(make_state, key)`` with
those of the state built whole and placed by ``step.init``, trains both a few steps,
saves one, and restores it into ``step.abstract_init``'s template.
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", required=True)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import MLP, cross_entropy, make_data  # noqa: E402

fdp.init(initialization_timeout=60)
model = MLP(features=(32, 16))
tx = optax.adam(1e-2)


def make_state(key):
    params = model.init(key, np.zeros((1, 8, 8, 1), np.float32))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def same_shards(got, want, what):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.sharding == b.sharding, (what, a.sharding, b.sharding)
        assert not a.is_fully_addressable or jax.process_count() == 1
        for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
            assert x.index == y.index and x.device == y.device, what
            np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data), err_msg=what)


step = fdp.train_step(cross_entropy(model.apply), sharding=fdp.Sharding(zero_stage=3))
sharded = step.init_sharded(make_state, jax.random.key(0))
whole = fdp.train_step(cross_entropy(model.apply), sharding=fdp.Sharding(zero_stage=3)).init(
    fdp.replicate(make_state(jax.random.key(0)))
)
same_shards(sharded, whole, "init")
kernel = sharded.params["Dense_0"]["kernel"]  # [64, 32] over 4 devices: 16 rows each
assert [s.data.shape for s in kernel.addressable_shards] == [(16, 32), (16, 32)], kernel.sharding

rank, rows = fdp.process_index(), 16
data = make_data(0, 3 * 2 * rows)
for i in range(3):
    start = (2 * i + rank) * rows
    local = {k: v[start : start + rows] for k, v in data.items()}
    sharded, _ = step(sharded, fdp.shard_batch(local))
    whole, _ = step(whole, fdp.shard_batch(local))
same_shards(sharded, whole, "trained")

with fdp.CheckpointManager(args.ckpt_dir, async_save=False) as ckpt:
    ckpt.save(3, sharded)
    restored = ckpt.restore(step.abstract_init(make_state, jax.random.key(1))).state
same_shards(restored, sharded, "restored")
print(f"process {rank}: sharded init ok", flush=True)
