"""A small data-parallel training loop in which one rank misbehaves (for fault tests).

    faulty.py MODE RANK STEP OUTDIR

After its step STEP, rank RANK writes the time to OUTDIR/fault and then, by MODE:
`stop` (SIGSTOP to itself: a hang), `kill` (SIGKILL), `raise` (an exception), or
`none` (nothing). Every rank then trains on until it is stopped or (`none`) has done the
step number written in OUTDIR/finish, so that all ranks leave the loop after the same
step (a rank that left one step early would leave its peer waiting in that step's
all-reduce); each writes OUTDIR/steps_<rank> with its step count as it goes.

Modes about where a hang happens, each with a blocking wait of an hour:
`callback` (rank RANK blocks in a `jax.debug.callback` inside its step STEP + 1),
`absent` (rank RANK never reaches its first step), `late` (rank RANK starts its first
step STEP seconds late, and takes 4 x STEP seconds more to trace it: slow loading and
compiling, not a hang), `slowexit` (rank RANK takes STEP seconds to exit after its last
step). With `late` and `slowexit` every rank stops after step 5.
"""

import atexit
import os
import signal
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 1)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402

mode, bad_rank, fault_step, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fdp.init(initialization_timeout=60)
rank = fdp.process_index()


HOUR = 3600.0
calls = [0]


def block_in_callback(x):
    calls[0] += 1
    if rank == bad_rank and calls[0] == fault_step + 1:
        with open(os.path.join(outdir, "fault"), "w") as f:
            f.write(repr(time.time()))
        time.sleep(HOUR)


def loss_fn(params, batch):
    if mode == "callback":
        jax.debug.callback(block_in_callback, batch["x"])
    if mode == "late" and rank == bad_rank:
        time.sleep(4 * fault_step)  # runs while the first call traces: slow compiling
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def last_step(outdir):
    try:
        with open(os.path.join(outdir, "finish")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 62


state = fdp.replicate(
    TrainState.create(apply_fn=None, params={"w": jnp.zeros((4, 1))}, tx=optax.sgd(0.01))
)
step = fdp.train_step(loss_fn)
rng = np.random.default_rng(rank)
if rank == bad_rank and mode in ("absent", "late"):
    with open(os.path.join(outdir, "fault"), "w") as f:
        f.write(repr(time.time()))
    time.sleep(HOUR if mode == "absent" else fault_step)  # loading, before the first step
if rank == bad_rank and mode == "slowexit":
    atexit.register(time.sleep, fault_step)  # runs after the script returned
for n in range(1, 100_000):
    local = {"x": rng.normal(size=(4, 4)).astype(np.float32), "y": np.ones((4, 1), np.float32)}
    state, metrics = step(state, fdp.shard_batch(local))
    float(metrics["loss"])  # wait for the step, as a loop that logs its loss does
    with open(os.path.join(outdir, f"steps_{rank}"), "w") as f:
        f.write(str(n))
    if n == fault_step and rank == bad_rank and mode != "none":
        with open(os.path.join(outdir, "fault"), "w") as f:
            f.write(repr(time.time()))
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "raise":
            raise RuntimeError(f"rank {rank} failed on purpose after step {n}")
    if (mode == "none" and n >= last_step(outdir)) or (mode in ("late", "slowexit") and n >= 5):
        break
    time.sleep(0.02)
print(f"rank {rank} done after step {n}", flush=True)
