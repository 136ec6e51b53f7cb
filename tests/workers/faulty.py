"""A small data-parallel training loop in which one rank misbehaves (for fault tests).

    faulty.py MODE RANK STEP OUTDIR [PAUSE]

After its step STEP, rank RANK writes the time to OUTDIR/fault and then, by MODE:
`stop` (SIGSTOP to itself: a hang), `kill` (SIGKILL), `raise` (an exception), or
`none` (nothing). Every rank then trains on until it is stopped or (`none`) has done the
step number written in OUTDIR/finish, so that all ranks leave the loop after the same
step (a rank that left one step early would leave its peer waiting in that step's
all-reduce); each writes OUTDIR/steps_<rank> with its step count as it goes.

Modes about where a hang happens, each with a blocking wait of an hour:
`callback` (rank RANK blocks in a `jax.debug.callback` inside its step STEP + 1),
`absent` (rank RANK never reaches its first step), `late` (rank RANK calls its first
step STEP seconds after its peers, and takes 4 x STEP seconds more to trace it: slow
loading and compiling, not a hang), `latecompile` (the same at step 4, where every rank
compiles again for a new batch size), `slowexit` (rank RANK takes STEP seconds to exit
after its last step). In these modes every rank stops after step 5.

Modes about pauses, of PAUSE seconds (default 90): `pause` (every rank sleeps between
its steps STEP and STEP + 1: an evaluation, a synchronous checkpoint; not a hang),
`busy` (the same inside `fdp.runtime.busy()`), `sleep` (rank RANK sleeps there, not
stopped, while its peers go on and wait for it inside step STEP + 1: a hang), and
`sleepbusy` (the same inside `fdp.runtime.busy()`: a hang only past --idle-timeout).
Every rank writes the time to OUTDIR/fault as it begins the pause, and stops after step
STEP + 2.
"""

import atexit
import contextlib
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
pause = float(sys.argv[5]) if len(sys.argv) > 5 else 90.0
fdp.init(initialization_timeout=60)
rank = fdp.process_index()


HOUR = 3600.0
calls = [0]
slow_trace = []  # not empty: tracing the loss takes 4 x STEP s
FIVE_STEPS = ("late", "latecompile", "slowexit")
PAUSES = ("pause", "busy", "sleep", "sleepbusy")


def block_in_callback(x):
    calls[0] += 1
    if rank == bad_rank and calls[0] == fault_step + 1:
        with open(os.path.join(outdir, "fault"), "w") as f:
            f.write(repr(time.time()))
        time.sleep(HOUR)


def loss_fn(params, batch):
    if mode == "callback":
        jax.debug.callback(block_in_callback, batch["x"])
    if slow_trace:
        time.sleep(4 * fault_step)  # runs while the call traces: slow compiling
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
# FAULTY_COMM_HOOK=allreduce: XLA's all-reduce (gloo), with no shared-memory set-up.
hook = os.environ.get("FAULTY_COMM_HOOK")
step = fdp.train_step(loss_fn, comm_hook=hook) if hook else fdp.train_step(loss_fn)
rng = np.random.default_rng(rank)
if rank == bad_rank and mode == "slowexit":
    atexit.register(time.sleep, fault_step)  # runs after the script returned
for n in range(1, 100_000):
    local = {"x": rng.normal(size=(4, 4)).astype(np.float32), "y": np.ones((4, 1), np.float32)}
    if mode == "latecompile" and n >= 4:  # a new batch size: every rank compiles again
        local = {k: np.concatenate([v, v]) for k, v in local.items()}
    batch = fdp.shard_batch(local)
    late = 1 if mode == "late" else 4 if mode == "latecompile" else 0
    if n == late and rank == bad_rank:  # its peers wait in the step
        time.sleep(fault_step)  # loading
        slow_trace.append(True)
    if n == 1 and rank == bad_rank and mode == "absent":  # so do they here
        with open(os.path.join(outdir, "fault"), "w") as f:
            f.write(repr(time.time()))
        time.sleep(HOUR)
    state, metrics = step(state, batch)
    slow_trace.clear()
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
    if n == fault_step and mode in PAUSES and (rank == bad_rank or mode in ("pause", "busy")):
        with open(os.path.join(outdir, "fault"), "w") as f:
            f.write(repr(time.time()))
        with fdp.runtime.busy() if mode.endswith("busy") else contextlib.nullcontext():
            time.sleep(pause)
    if (mode == "none" and n >= last_step(outdir)) or (mode in FIVE_STEPS and n >= 5):
        break
    if mode in PAUSES and n >= fault_step + 2:
        break
    time.sleep(0.02)
print(f"rank {rank} done after step {n}", flush=True)
