"""Trains models whose state holds typed PRNG keys (dtype key<fry>), for tests.

    prng_train.py --out params.npz [--devices 2] [--steps 3] [--ckpt-dir D]

An NNX model with nnx.Dropout and nnx.BatchNorm (its nnx.Rngs hold typed keys) trained
with fdp.nnx_train_step, and a Linen TrainState with a `jax.random.key` field whose key
feeds the step's dropout. Each process builds both from its own seed: fdp.replicate
must hand everyone process 0's values, keys included. Under `fdp launch` each process
feeds its half of every global batch; alone, one process feeds all of it.
"""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--ckpt-dir")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402

fdp.init(initialization_timeout=60)
rank, nproc = fdp.process_index(), fdp.process_count()
mesh = fdp.data_mesh()


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, use_bias=False, rngs=rngs)  # BatchNorm follows
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def nnx_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, rng):
        x = nn.Dropout(0.1, deterministic=False)(nn.relu(nn.Dense(16)(x)), rng=rng)
        return nn.Dense(4)(x)


class KeyedState(TrainState):
    key: jax.Array


linen = LinenNet()


def linen_loss(params, batch, rng):
    logits = linen.apply({"params": params}, batch["x"], rng)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


# Every process seeds its own model (rank): replicate must make process 0's win.
model = Net(nnx.Rngs(params=rank, dropout=100 + rank))
optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
nnx_step = fdp.nnx_train_step(nnx_loss, mesh=mesh)
key = jax.random.key(rank)
state = fdp.replicate(
    KeyedState.create(
        apply_fn=linen.apply,
        params=linen.init(key, jnp.zeros((1, 8)), key)["params"],
        tx=optax.adam(1e-2),
        key=jax.random.key(200 + rank),
    ),
    mesh,
)
assert jax.dtypes.issubdtype(state.key.dtype, jax.dtypes.prng_key), state.key.dtype
linen_step = fdp.train_step(linen_loss, mesh=mesh)

data = np.random.default_rng(0)
global_batch = 16
for step in range(args.steps):
    batch = {
        "x": data.normal(size=(global_batch, 8)).astype(np.float32),
        "y": data.integers(0, 4, size=global_batch).astype(np.int32),
    }
    if nproc > 1:  # this process's half of the global batch
        share = global_batch // nproc
        batch = {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}
    local = fdp.shard_batch(batch, mesh)
    nnx_step(model, optimizer, local)
    # A new key each step (not state.key itself: the step donates the state's buffers).
    state, _ = linen_step(state, local, jax.random.fold_in(state.key, step))

if args.ckpt_dir:  # typed keys in checkpoints written by every process, and read back
    fresh = Net(nnx.Rngs(params=7, dropout=7))
    fresh_opt = nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param)
    like = state.replace(key=jax.random.key(7))
    for sub, saved, template in (
        ("nnx", (model, optimizer), (fresh, fresh_opt)),  # restored in place
        ("linen", state, like),
    ):
        with fdp.CheckpointManager(os.path.join(args.ckpt_dir, sub)) as ckpt:
            ckpt.save(args.steps, saved)
        with fdp.CheckpointManager(os.path.join(args.ckpt_dir, sub)) as ckpt:
            restored = ckpt.restore(template).state
    for back, want in (
        (restored.key, state.key),
        (fresh.drop.rngs.key[...], model.drop.rngs.key[...]),
    ):
        assert back.dtype == want.dtype, back.dtype
        assert jax.random.key_impl(back) == jax.random.key_impl(want)
        np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(want))


def whole(x):
    """A numpy copy of a replicated leaf (typed keys as their raw key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x.addressable_data(0))


if rank == 0:
    arrays = {}
    for name, tree in (("nnx", nnx.state(model)), ("linen", state.params), ("key", state.key)):
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            arrays[name + jax.tree_util.keystr(path)] = whole(x)
    np.savez(args.out, step=int(optimizer.step[...]), **arrays)
print(f"done: step {int(optimizer.step[...])}", flush=True)
