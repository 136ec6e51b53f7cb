"""Two processes train, one of them set up differently or misbehaving (fault-injection tests).

    mismatch.py [--zero-stage-rank1 N] [--hook-rank1 NAME] [--nan-rank R --nan-step S]
                [--lr-rank1 LR] [--stall-shm-rank1 S] [--steps N]

Run under `fdp launch --nproc-per-node 2`, one CPU device per process, so that fdp's
default comm hook sums through shared memory (a set-up the processes must agree on).
Rank 1 may get another ZeRO stage or comm hook, or another learning rate (in optax.sgd's
closure, as a torch script passes it to its optimizer); rank R may get a
NaN in its share of the batch from step S on; rank 1 may wait S seconds before it joins
the shared-memory set-up (so that rank 0 waits in it, its file in /dev/shm). Prints its
pid and port, when it calls its first step, and a checksum of its parameters at the end.
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--zero-stage-rank1", type=int, default=0)
parser.add_argument("--hook-rank1", default=None)
parser.add_argument("--lr-rank1", type=float, default=0.1)
parser.add_argument("--nan-rank", type=int, default=-1)
parser.add_argument("--nan-step", type=int, default=0)
parser.add_argument("--stall-shm-rank1", type=float, default=0.0)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import MLP, cross_entropy, make_data  # noqa: E402

fdp.init(initialization_timeout=60)
rank = fdp.process_index()
print(f"pid {os.getpid()} port {os.environ['MASTER_PORT']}", flush=True)
if rank == 1 and args.stall_shm_rank1:
    from fdp.backends.cpu import _shm

    install = _shm._install

    def stalled(*a, **k):
        time.sleep(args.stall_shm_rank1)
        return install(*a, **k)

    _shm._install = stalled
mesh = fdp.data_mesh()
model = MLP()
params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
lr = args.lr_rank1 if rank == 1 else 0.1
tx = optax.sgd(lr)
state = fdp.replicate(TrainState.create(apply_fn=model.apply, params=params, tx=tx), mesh)

settings = {}
if rank == 1 and args.zero_stage_rank1:
    settings["sharding"] = fdp.Sharding(zero_stage=args.zero_stage_rank1)
if rank == 1 and args.hook_rank1:
    settings["reduction"] = fdp.Reduction(comm_hook=args.hook_rank1)
step = fdp.train_step(cross_entropy(model.apply), mesh=mesh, **settings)
print(f"first step at {time.time()!r}", flush=True)
for i in range(1, args.steps + 1):
    data = make_data(100 * i + rank, 8)  # this process's half of a global batch of 16
    if rank == args.nan_rank and i >= args.nan_step:
        data["x"][3] = np.nan
    state, metrics = step(state, fdp.shard_batch(data, mesh))
    print(f"step {i}: loss {float(metrics['loss']):.4f}", flush=True)
leaves = jax.tree.leaves(jax.device_get(state.params))
print(f"done: params sum {sum(float(np.sum(x)) for x in leaves):.6f}", flush=True)
