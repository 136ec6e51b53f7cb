"""Two processes build a step, possibly different ones, and run it (for the DETAIL tests).

    detail.py [--cap-mb-rank1 MB] [--narrow-rank R] [--steps N]

Run under `fdp launch --nproc-per-node 2` with FDP_DEBUG=DETAIL. Each process has 2
CPU devices. `--cap-mb-rank1` gives rank 1 another bucket_cap_mb; `--narrow-rank`
gives that rank a narrower hidden layer, and then the state is placed on the mesh
without fdp.replicate (whose own check would catch it first), as a program that
builds its global arrays itself does. Prints when it calls its first step.
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--cap-mb-rank1", type=float, default=25.0)
parser.add_argument("--narrow-rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import MLP, cross_entropy, make_data  # noqa: E402

fdp.init(initialization_timeout=60)
rank = fdp.process_index()
mesh = fdp.data_mesh()
model = MLP(features=(32, 8) if rank == args.narrow_rank else (32, 16))
params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
if args.narrow_rank < 0:
    state = fdp.replicate(state, mesh)
else:
    replicated = NamedSharding(mesh, P())

    def place(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, replicated, lambda index: x[index])

    state = jax.tree.map(place, state)

cap = args.cap_mb_rank1 if rank == 1 else 25.0
step = fdp.train_step(
    cross_entropy(model.apply), mesh=mesh, reduction=fdp.Reduction(bucket_cap_mb=cap)
)
data = make_data(rank, 8)  # this process's half of a global batch of 16
print(f"first step at {time.time()!r}", flush=True)
for _ in range(args.steps):
    state, metrics = step(state, fdp.shard_batch(data, mesh))
print(f"done: loss {float(metrics['loss']):.4f}", flush=True)
