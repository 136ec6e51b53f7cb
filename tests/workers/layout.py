"""Prints the layout fdp.train_step picks and the all-reduces XLA compiles (for tests).

Under fdp launch with 2 processes x 1 CPU device, 'auto' must pick DDP's flat
buckets, and XLA (comm_hook='allreduce') must keep them apart in the compiled program.
The default hook sums them through shared memory there (tests/runtime/test_shm_allreduce.py).
"""

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402

import fdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import cross_entropy, make_data, make_state  # noqa: E402

fdp.init(initialization_timeout=60)
init = make_state("mlp", "sgd")
step = fdp.train_step(
    cross_entropy(init.apply_fn),
    reduction=fdp.Reduction(comm_hook="allreduce", bucket_cap_mb=1e-3, first_bucket_cap_mb=1e-3),
)
state = fdp.replicate(init)
batch = fdp.shard_batch(make_data(fdp.process_index(), 4))
compiled = step.lower(state, batch).compile()
stats = fdp.collective_stats(compiled)
state, metrics = step(state, batch)
assert np.isfinite(float(metrics["loss"]))
print(
    f"process {fdp.process_index()}: layout {step.config.layout}, "
    f"{len(step.plan.buckets)} buckets, {stats.count('all-reduce')} all-reduces compiled"
)
