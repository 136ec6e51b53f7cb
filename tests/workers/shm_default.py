"""Trains with fdp's default hook, then with XLA's all-reduce, from one start (for tests).

    shm_default.py --out DIR [--rank1 none|off|no-compiler]

Under `fdp launch`, one CPU device per process: 3 SGD steps of a small MLP with tiny
buckets, first with no comm_hook (fdp's default: summed through shared memory where the
processes agree they can), then with comm_hook='allreduce' in both layouts; then both
again with one bucket of the whole model. Before the first step rank 1 may set
FDP_SHM_ALLREDUCE=0 (`off`) or lose its C++ compiler and the cached build
(`no-compiler`). Each rank writes its parameters, the shared-memory calls and
all-reduces of the default steps' programs, and what fdp logged, to DIR/rank{R}.npz.
"""

import argparse
import logging
import os
import sys
import tempfile

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--rank1", choices=("none", "off", "no-compiler"), default="none")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import fdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _models import MLP, make_data, train_tiny_buckets  # noqa: E402


class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


kept = Keep()
logging.getLogger("fdp").addHandler(kept)
logging.getLogger("fdp").setLevel(logging.INFO)

fdp.init(initialization_timeout=60)
rank = fdp.process_index()
if rank == 1 and args.rank1 == "off":
    os.environ["FDP_SHM_ALLREDUCE"] = "0"
if rank == 1 and args.rank1 == "no-compiler":
    os.environ["CXX"] = "/nonexistent/c++"
    os.environ["FDP_CACHE_DIR"] = tempfile.mkdtemp()  # no build cached from earlier runs

model = MLP(features=(33, 15))
params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
data = make_data(10 + rank, 3 * 8)
batches = [fdp.shard_batch({k: v[i * 8 : (i + 1) * 8] for k, v in data.items()}) for i in range(3)]
results = {}
for name, hook, layout, cap in (
    ("default", None, "auto", 0.004),
    ("allreduce-flat", "allreduce", "flat", 0.004),
    ("allreduce-leaves", "allreduce", "leaves", 0.004),
    # A later program whose one bucket (the whole model, 11.6 kB) is larger than any
    # the first program reserved room for: the processes agree again.
    ("big", None, "auto", 1.0),
    ("big-allreduce", "allreduce", "flat", 1.0),
):
    state, step = train_tiny_buckets(
        model, params, optax.sgd(0.1), batches, hook=hook, layout=layout, cap_mb=cap
    )
    if hook is None:
        hlo = step.lower(state, batches[0]).compile().as_text()
        results[f"{name}:shm_calls"] = np.array(hlo.count('custom_call_target="fdp_shm_sum"'))
        results[f"{name}:all_reduces"] = np.array(hlo.count(" all-reduce("))
        results[f"{name}:buckets"] = np.array(len(step.plan.buckets))
        results[f"{name}:hook"] = np.array(step.config.comm_hook.name)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        results[f"{name}/{jax.tree_util.keystr(path)}"] = np.asarray(
            leaf.addressable_shards[0].data
        )
results["log"] = np.array("\n".join(kept.messages))
np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)
