"""Trains an MLP from the newest checkpoint, stopping (and saving) when told to (for tests).

    resume.py --out params.npz --ckpt-dir D [--devices 2] [--steps 12]
              [--stop-after N] [--seen PREFIX] [--step-sleep S] [--no-preemption]

Works under `fdp launch` with any number of processes: the data position is a
DistributedSampler.position, so a run saved on one world size resumes on another
reading each example of the epoch once. It saves and exits after `--stop-after`
steps of this run, or at the step where fdp.reached_preemption says so (SIGTERM).
Each process appends the indices it trained on to PREFIX.rank<R>, one step a line.
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--global-batch", type=int, default=16)
parser.add_argument("--stop-after", type=int, default=0)
parser.add_argument("--seen")
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--no-preemption", action="store_true", help="ignore SIGTERM, as before")
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
sampler = fdp.DistributedSampler(len(data["y"]), nproc, rank, seed=0, drop_last=True)
local_batch = args.global_batch // nproc

model = MLP()
params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
state = fdp.replicate(TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2)))
step_fn = fdp.train_step(cross_entropy(model.apply))

ckpt = fdp.CheckpointManager(args.ckpt_dir)
step = 0
if ckpt.all_steps():
    began = time.monotonic()
    state, position, step = ckpt.restore(state)
    sampler.set_position(position)
    print(f"resumed at step {step} from {position} in {time.monotonic() - began:.2f} s", flush=True)
else:
    sampler.set_epoch(0)


def stop(step, batches):
    ckpt.save(step, state, data_position=sampler.position(batches, local_batch))
    ckpt.close()  # waits for the background save
    print(f"saved step {step} and stopped", flush=True)
    sys.exit(0)


done_here = 0
while step < args.steps:
    for batches, idx in enumerate(sampler.batches(local_batch), start=1):
        state, metrics = step_fn(state, fdp.shard_batch({k: v[idx] for k, v in data.items()}))
        step, done_here = step + 1, done_here + 1
        if args.seen:
            with open(f"{args.seen}.rank{rank}", "a") as f:
                f.write(f"{sampler.epoch} {' '.join(map(str, idx.tolist()))}\n")
        print(f"step {step} loss {float(metrics['loss']):.6f}", flush=True)
        time.sleep(args.step_sleep)
        if done_here == args.stop_after:
            stop(step, batches)
        if not args.no_preemption and fdp.reached_preemption(step):
            print(f"preempted after step {step}", flush=True)
            stop(step, batches)
        if step >= args.steps:
            break
    else:
        sampler.set_epoch(sampler.epoch + 1)

ckpt.close()
if rank == 0:
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    np.savez(
        args.out, step=int(state.step), **{jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}
    )
print(f"done: step {int(state.step)}", flush=True)
