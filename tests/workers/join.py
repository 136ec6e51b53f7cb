"""Processes with different numbers of batches, joined (for tests; under fdp launch).

    join.py --out params.npz [--throw]

Process p has COUNTS[p] local batches of 4 examples (2 per device). fdp.join keeps
the process that runs out stepping with zero-weight batches until both are done;
with --throw, both raise as soon as one runs out.
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--throw", action="store_true")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import fdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import make_data, make_state  # noqa: E402

COUNTS = (3, 1)

fdp.init(initialization_timeout=60)
rank = fdp.process_index()
batches = [make_data(100 + 10 * rank + i, 4) for i in range(COUNTS[rank])]
init = make_state("mlp", "adam")


def loss_fn(params, batch):
    logits = init.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


state = fdp.replicate(init)
# The mean over the real examples of each step (torch's divide_by_initial_world_size=False):
# the reference the test computes on one device. torch's default is tested in one process.
step = fdp.train_step(loss_fn, loss=fdp.Loss(per_example=True, divide_by_initial_world_size=False))
steps = 0
joined = fdp.join(
    iter(batches), batch_size=4, like=make_data(0, 4), throw_on_early_termination=args.throw
)
for batch, mask in joined:
    state, _ = step(state, fdp.shard_batch(batch), mask=fdp.shard_batch(mask))
    steps += 1
print(f"process {rank} stepped {steps} times")
if rank == 0:
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    np.savez(
        args.out,
        **{jax.tree_util.keystr(p): np.asarray(v.addressable_data(0)) for p, v in flat},
    )
