"""Trains a small MLP data-parallel, with per-process data and checkpoints (for tests).

    train.py --out params.npz [--devices 2] [--replicas R] [--ckpt-dir D]
             [--die-at-step S] [--narrow-rank R] [--zero-stage Z] [--hierarchical]
             [--host-mesh] [--shard-over inner]

Under `fdp launch` each process feeds its own local batches, read with a
DistributedSampler. Alone, `--replicas R` builds the same global batches from R
samplers, so both runs see identical data. Each process initialises the model with
its own seed: fdp.replicate must hand everyone process 0's values.
"""

import argparse
import os
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
parser.add_argument("--replicas", type=int, default=1, help="samplers to simulate alone")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--global-batch", type=int, default=16)
parser.add_argument("--ckpt-dir")
parser.add_argument("--ckpt-every", type=int, default=2)
parser.add_argument("--die-at-step", type=int, default=0, help="rank 1 SIGKILLs itself here")
parser.add_argument("--narrow-rank", type=int, default=-1, help="this rank builds a narrower MLP")
parser.add_argument("--zero-stage", type=int, default=0)
parser.add_argument("--hierarchical", action="store_true", help="host x device mesh, two levels")
parser.add_argument("--host-mesh", action="store_true", help="host x device mesh, flat reduction")
parser.add_argument("--shard-over", default="all", help="ZeRO over 'all' devices or 'inner' (HSDP)")
parser.add_argument("--comm-hook", default=None)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import MLP, cross_entropy, make_data  # noqa: E402

fdp.init(initialization_timeout=60)
rank, nproc = fdp.process_index(), fdp.process_count()
data = make_data(0, 96)
replicas = nproc if nproc > 1 else args.replicas
samplers = [
    fdp.DistributedSampler(len(data["y"]), replicas, r, shuffle=True, seed=0, drop_last=True)
    for r in ([rank] if nproc > 1 else range(replicas))
]
local_batch = args.global_batch // replicas
steps_per_epoch = samplers[0].num_batches(local_batch)

model = MLP(features=(32, 8) if rank == args.narrow_rank else (32, 16))
params = model.init(jax.random.key(rank), np.zeros((1, 8, 8, 1), np.float32))["params"]
host_mesh = args.hierarchical or args.host_mesh
axes = fdp.HOST_AXES if host_mesh else fdp.DATA_AXIS
mesh = fdp.data_mesh(axis_name=axes)
if host_mesh:  # one row of the mesh per process: its devices
    assert [{d.process_index for d in row} for row in mesh.devices] == [{p} for p in range(nproc)]
state = fdp.replicate(
    TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2)), mesh
)
step_fn = fdp.train_step(
    cross_entropy(model.apply),
    mesh=mesh,
    axis_name=axes,
    sharding=fdp.Sharding(zero_stage=args.zero_stage, shard_over=args.shard_over),
    reduction=fdp.Reduction(hierarchical=args.hierarchical, comm_hook=args.comm_hook),
)
if args.zero_stage:
    state = step_fn.init(state)  # sharded before a restore, so orbax reads only each shard
    held = state.opt_state[0].mu["Dense_0"]["kernel"].addressable_shards
    print(f"Adam mu of Dense_0 kernel: {held[0].data.shape} on each device", flush=True)

start = 0
# Synchronous saves: the kill test expects the save of step 4 to be on disk when rank 1
# kills itself after step 5 (a background save may still be in flight then, and lost).
ckpt = (
    fdp.CheckpointManager(args.ckpt_dir, max_to_keep=2, async_save=False) if args.ckpt_dir else None
)
if ckpt is not None and ckpt.latest_step() is not None:
    state, position, start = ckpt.restore(state)
    assert position["epoch"] * steps_per_epoch + position["batch"] == start, position
    print(f"resumed at step {start} from {position}", flush=True)

for step in range(start, args.steps):
    epoch, batch = divmod(step, steps_per_epoch)
    rows = []
    for s in samplers:
        s.set_epoch(epoch)
        rows.append(s.indices()[batch * local_batch : (batch + 1) * local_batch])
    local = {k: v[np.concatenate(rows)] for k, v in data.items()}
    state, metrics = step_fn(state, fdp.shard_batch(local, mesh, axis_name=axes))
    if ckpt is not None and (step + 1) % args.ckpt_every == 0:
        epoch, batch = divmod(step + 1, steps_per_epoch)
        ckpt.save(step + 1, state, data_position={"epoch": epoch, "batch": batch})
    restarted = int(os.environ.get("FDP_RESTART_COUNT", "0"))
    if step + 1 == args.die_at_step and rank == 1 and restarted == 0:
        print(f"rank 1 kills itself after step {step + 1}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

if ckpt is not None:
    ckpt.close()
params = state.params
if args.zero_stage >= 3:  # sharded over both processes: gather the whole arrays
    from jax.experimental import multihost_utils

    params = multihost_utils.process_allgather(params, tiled=True)
if rank == 0:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    whole = [x if isinstance(x, np.ndarray) else x.addressable_data(0) for _, x in flat]
    arrays = {jax.tree_util.keystr(p): np.asarray(x) for (p, _), x in zip(flat, whole, strict=True)}
    np.savez(args.out, step=int(state.step), **arrays)
print(f"done: step {int(state.step)}, loss {float(metrics['loss']):.6f}", flush=True)
