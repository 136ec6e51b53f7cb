"""Trains with comm_hook='allreduce' and 'shm_allreduce' from the same start (for tests).

    shm_sum.py --out DIR [--stall-rank R]

Under `fdp launch`, one CPU device per process: 4 Adam steps of a small MLP with
tiny buckets (several per step), both layouts, each hook; each rank writes its final
parameters to DIR/rank{R}.npz, with the compiled programs' shared-memory calls (the
operands of each). The layers have odd widths, so buffers split unevenly between
processes. Then rank R sleeps before one more shared-memory sum whose peers wait 2 s:
each rank writes the error it got to DIR/stall{R}.txt.
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--stall-rank", type=int, default=1)
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fdp  # noqa: E402
from fdp.backends.cpu._shm import shm_sum  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import MLP, make_data, train_tiny_buckets  # noqa: E402

fdp.init(initialization_timeout=60)
rank = fdp.process_index()
model = MLP(features=(33, 15))
params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
data = make_data(10 + rank, 4 * 8)
batches = [{k: v[i * 8 : (i + 1) * 8] for k, v in data.items()} for i in range(4)]
results = {
    f"start/{jax.tree_util.keystr(k)}": np.asarray(v)
    for k, v in jax.tree_util.tree_leaves_with_path(params)
}
for layout in ("flat", "leaves"):
    for hook in ("allreduce", "shm_allreduce"):
        placed = [fdp.shard_batch(batch) for batch in batches]
        state, step = train_tiny_buckets(
            model, params, optax.adam(1e-2), placed, hook=hook, layout=layout
        )
        hlo = step.lower(state, placed[0]).compile().as_text()
        calls = [line for line in hlo.splitlines() if 'custom_call_target="fdp_shm_sum"' in line]
        # Operands of each shared-memory call: the ordering token, then the bucket's arrays.
        results[f"calls/{layout}/{hook}"] = np.array(
            [line.split("custom-call(", 1)[1].split(")", 1)[0].count("%") for line in calls]
        )
        results[f"packs/{layout}/{hook}"] = np.array(
            hlo.count("concatenate(") + hlo.count("dynamic-update-slice(")
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
            results[f"{layout}/{hook}/{jax.tree_util.keystr(path)}"] = np.asarray(
                leaf.addressable_shards[0].data
            )
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)


def one_sum(v):
    return shm_sum(v, fdp.DATA_AXIS, timeout=2.0)


# A sum with no other collective in its program, so nothing else waits for the peer.
summed = jax.jit(
    jax.shard_map(
        one_sum,
        mesh=fdp.data_mesh(),
        in_specs=P(fdp.DATA_AXIS),
        out_specs=P(fdp.DATA_AXIS),
        check_vma=False,
    )
)
x = fdp.shard_batch(np.ones((1, 1001), np.float32))
assert float(np.asarray(summed(x).addressable_shards[0].data)[0, 0]) == fdp.process_count()
if rank == args.stall_rank:
    time.sleep(5.0)
started = time.monotonic()
try:
    jax.block_until_ready(summed(x))
    message = "no error"
except Exception as e:
    message = f"{type(e).__name__} after {time.monotonic() - started:.1f} s: {e}"
with open(os.path.join(args.out, f"stall{rank}.txt"), "w") as f:
    f.write(message)
