"""Two processes, each host collective met by a faulty peer; prints one JSON line per rank.

Run under `fdp launch --nproc-per-node 2`. Rank 0 plays the faulty peer: it sends bytes
that are not an encoded value, writes a stray key where all_gather_object reads,
calls a different host collective than rank 1, passes more rows to shard_batch, and
checks a batch's rows while rank 1 checks its step's settings.
Every error must be fdp's, naming the key, the peer and what was expected; afterwards
the collectives still work.
"""

import json

import jax

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402
from fdp import runtime  # noqa: E402
from fdp.runtime import _client, _host, _serialize  # noqa: E402

fdp.init(initialization_timeout=60)
me = fdp.process_index()
out = {"process_index": me}


def attempt(name, call):
    try:
        out[name] = ["returned", repr(call())]
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]


def next_call_number():
    return int(repr(_host._SEQUENCE)[len("count(") : -1])


# 1. Process 0 broadcasts bytes that are not an encoded value.
if me == 0:
    real = _serialize.dumps
    _serialize.dumps = lambda obj: b"\xc1garbage"
    attempt("garbage", lambda: runtime.broadcast_object("x", src=0, timeout=20))
    _serialize.dumps = real
else:
    attempt("garbage", lambda: runtime.broadcast_object(None, src=0, timeout=20))

# 2. A stray key where all_gather_object's values are.
runtime.barrier(timeout=20)
number = next_call_number() + 1  # after the barrier below
if me == 0:
    _client.coordination_client().key_value_set_bytes(
        f"fdp/host/{number}/all_gather_object/in/x", b""
    )
runtime.barrier(timeout=20)
attempt("stray", lambda: runtime.all_gather_object(me, timeout=20))

# 3. Process 0 calls a barrier where process 1 calls broadcast_object.
if me == 0:
    attempt("mismatch", lambda: runtime.barrier(timeout=3))
else:
    attempt("mismatch", lambda: runtime.broadcast_object(None, src=1, timeout=3))

# 4. Local batches of different sizes (8 rows and 6): refused on both, naming each.
attempt("rows", lambda: fdp.shard_batch(np.zeros((8 if me == 0 else 6, 2), np.float32)).shape)
out["equal_rows"] = list(fdp.shard_batch(np.zeros((4, 2), np.float32)).shape)

# 5. Process 0 checks its batch's rows (fdp.shard_batch) where process 1 checks its
# step's settings (step.init): each is told the other's collective, never its value.
state = TrainState.create(apply_fn=None, params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
if me == 0:
    attempt("crossed", lambda: fdp.shard_batch(np.zeros((3, 2), np.float32)).shape)
else:
    attempt("crossed", lambda: fdp.train_step(lambda p, b: 0.0).init(state) and "done")

# Afterwards the collectives still agree.
out["after"] = runtime.all_gather_object(me, timeout=20)
print("RESULT " + json.dumps(out), flush=True)
