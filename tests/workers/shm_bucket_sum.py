"""Sums one bucket of arrays through shared memory, scaled (for tests).

    shm_bucket_sum.py --out DIR

Under `fdp launch`, one CPU device per process: one bucket of four float32 arrays,
1041 elements (chunk boundaries fall inside arrays), each process's drawn from a seeded
generator that every process replays for every rank; summed with scale 1/world and
with scale 0.3, three times each, in place (donated inputs). Then one sum whose bucket
has the same bytes on every rank but another split into arrays. Each rank writes its
sums and that sum's error to DIR/rank{R}.npz.
"""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fdp  # noqa: E402
from fdp.backends.cpu._shm import shm_sum_bucket  # noqa: E402

SIZES = (7, 1001, 2, 31)

fdp.init(initialization_timeout=60)
rank, world = fdp.process_index(), fdp.process_count()
draws = np.random.default_rng(3)
data = [[draws.normal(size=(1, n)).astype(np.float32) for n in SIZES] for _ in range(world)]
spec = P(fdp.DATA_AXIS)
results = {}
for name, scale in (("mean", float(np.float32(1) / np.float32(world))), ("0.3", 0.3)):

    def body(*xs, scale=scale):
        return tuple(shm_sum_bucket(list(xs), fdp.DATA_AXIS, scale=scale))

    mapped = jax.shard_map(
        body, mesh=fdp.data_mesh(), in_specs=(spec,) * 4, out_specs=(spec,) * 4, check_vma=False
    )
    summed = jax.jit(mapped, donate_argnums=range(4))  # in place: outputs alias inputs
    args_now = [fdp.shard_batch(x) for x in data[rank]]
    header = summed.lower(*args_now).compile().as_text().split("\n", 1)[0]
    results[f"{name}/aliased"] = np.array("input_output_alias" in header)
    for call in range(3):  # both slot parities, and back
        sums = summed(*[fdp.shard_batch(x) for x in data[rank]])
        for i, total in enumerate(sums):
            results[f"{name}/{call}/{i}"] = np.asarray(total.addressable_shards[0].data)


# Last (a failed sum closes the group): the same bytes, split differently on each rank.
def split(a, b):
    return tuple(shm_sum_bucket([a, b], fdp.DATA_AXIS, timeout=30.0))


halves = (5, 10) if rank % 2 == 0 else (10, 5)
mismatched = jax.jit(
    jax.shard_map(
        split, mesh=fdp.data_mesh(), in_specs=(spec,) * 2, out_specs=(spec,) * 2, check_vma=False
    )
)
try:
    jax.block_until_ready(
        mismatched(*[fdp.shard_batch(np.ones((1, n), np.float32)) for n in halves])
    )
    results["split_error"] = np.array("no error")
except Exception as e:  # the test reads the message
    results["split_error"] = np.array(str(e))
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)
