"""Trains an MLP on batches read with a grain DataLoader, checkpointing its iterator (for tests).

    grain_train.py --ckpt-dir D --seen PREFIX [--devices 2] [--global-batch 8]
                   [--ckpt-every 2] [--die-after-step S]

One epoch of 48 examples, shuffled by grain's IndexSampler and sharded per process
with fdp.grain_shard_options(). Every `--ckpt-every` steps the train state and the
grain iterator are saved together; a run that finds a checkpoint restores both.
Each process appends `ATTEMPT STEP INDEX...` to PREFIX.rank<R> for every step it
reads. On the first attempt rank 1 SIGKILLs itself after step `--die-after-step`,
once the checkpoint before it is on disk.
"""

import argparse
import os
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--seen", required=True)
parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
parser.add_argument("--global-batch", type=int, default=8)
parser.add_argument("--ckpt-every", type=int, default=2)
parser.add_argument("--die-after-step", type=int, default=0)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)

import grain  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import MLP, cross_entropy, make_data  # noqa: E402

EXAMPLES = 48
fdp.init(initialization_timeout=60)
rank, nproc = fdp.process_index(), fdp.process_count()
attempt = int(os.environ.get("FDP_RESTART_COUNT", "0"))
data = make_data(0, EXAMPLES)

sampler = grain.samplers.IndexSampler(
    EXAMPLES, shard_options=fdp.grain_shard_options(), shuffle=True, seed=0, num_epochs=1
)
loader = grain.DataLoader(
    data_source=list(range(EXAMPLES)),  # the example indices; rows are looked up below
    sampler=sampler,
    operations=[grain.transforms.Batch(args.global_batch // nproc, drop_remainder=True)],
    worker_count=0,
)
batches = iter(loader)

model = MLP()
params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
state = fdp.replicate(TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2)))
step_fn = fdp.train_step(cross_entropy(model.apply))

ckpt = fdp.CheckpointManager(args.ckpt_dir, max_to_keep=2)
step = 0
if ckpt.latest_step() is not None:
    state, _, step = ckpt.restore(state, data_iterator=batches)
    print(f"resumed at step {step}", flush=True)

for idx in batches:
    state, metrics = step_fn(state, fdp.shard_batch({k: v[idx] for k, v in data.items()}))
    step += 1
    with open(f"{args.seen}.rank{rank}", "a") as f:
        f.write(f"{attempt} {step} {' '.join(map(str, idx.tolist()))}\n")
    if step % args.ckpt_every == 0:
        ckpt.save(step, state, data_iterator=batches)
    if step == args.die_after_step and rank == 1 and attempt == 0:
        ckpt.wait_until_finished()  # the last checkpoint is on disk: die after it
        print(f"rank 1 kills itself after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

ckpt.close()
print(f"done: step {step}, loss {float(metrics['loss']):.6f}", flush=True)
