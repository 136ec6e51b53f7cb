"""Exercises fdp.init, the host collectives and the store; prints one JSON line of results.

Run under `fdp launch` (any number of processes, one or several agents).
"""

import json
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import fdp  # noqa: E402
from fdp import runtime  # noqa: E402

fdp.init(initialization_timeout=60)
me, n = fdp.process_index(), fdp.process_count()
out = {
    "rank_env": int(os.environ.get("RANK") or os.environ["FDP_PROCESS_ID"]),
    "process_index": me,
    "process_count": n,
    "local_rank": fdp.local_rank(),
    "local_world_size": fdp.local_world_size(),
    "devices": jax.device_count(),
    "local_devices": jax.local_device_count(),
}
runtime.barrier(timeout=60)
runtime.monitored_barrier(timeout=60)
out["broadcast"] = runtime.broadcast_object(
    {"from": me, "t": (1, 2), "a": np.arange(3) + me}, src=n - 1
)
out["gathered"] = runtime.all_gather_object({"rank": me, "host_value": me * 10})

store = runtime.Store("test", timeout=60)
if me == 0:
    store.set("config", "lr=0.1")
out["config"] = store.get("config").decode()
out["counter_after_all"] = None
store.add("arrivals", 1)
runtime.barrier(timeout=60)
out["counter_after_all"] = int(store.get("arrivals"))
# Every process tries to become the leader; compare_set lets exactly one win.
won = store.compare_set("leader", "", f"p{me}") == f"p{me}".encode()
out["leaders"] = sum(runtime.all_gather_object(int(won)))
store.set(f"ready/{me}", b"1")
store.wait([f"ready/{i}" for i in range(n)], timeout=60)
out["check"] = store.check([f"ready/{i}" for i in range(n)])
runtime.barrier(timeout=60)
out["num_keys"] = store.num_keys()
t = time.monotonic()
try:
    store.get("never-set", timeout=1.0)
except TimeoutError as e:
    out["get_timeout"] = [str(e), round(time.monotonic() - t, 2)]

# Per-process batches are assembled in process order.
mesh = fdp.data_mesh()
local = np.full((jax.local_device_count(), 1), me, np.int32)
global_batch = fdp.shard_batch(local, mesh)
out["assembled"] = multihost_utils.process_allgather(global_batch, tiled=True).ravel().tolist()
runtime.barrier(timeout=60)
print("RESULT " + json.dumps(out, default=lambda x: x.tolist()), flush=True)
sys.exit(0)
