"""A small data-parallel training loop in which one rank misbehaves (for fault tests).

    faulty.py MODE RANK STEP OUTDIR

After its step STEP, rank RANK writes the time to OUTDIR/fault and then, by MODE:
`stop` (SIGSTOP to itself: a hang), `kill` (SIGKILL), `raise` (an exception), or
`none` (nothing). Every rank then trains on until it is stopped or (`none`) has done the
step number written in OUTDIR/finish, so that all ranks leave the loop after the same
step (a rank that left one step early would leave its peer waiting in that step's
all-reduce); each writes OUTDIR/steps_<rank> with its step count as it goes.
"""

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


def loss_fn(params, batch):
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
    if mode == "none" and n >= last_step(outdir):
        break
    time.sleep(0.02)
print(f"rank {rank} done after step {n}", flush=True)
