"""Saves checkpoints in a loop until killed (for the kill-during-write test).

    ckpt_writer.py DIR [--async]

Checkpoint s holds arrays filled with s, so a reader can tell whether it got
the whole of one step. After each save it prints `saved s`.
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402

import fdp  # noqa: E402

directory, use_async = sys.argv[1], "--async" in sys.argv
base = fdp.replicate({f"w{i}": jnp.zeros((256, 256)) for i in range(8)})
with fdp.CheckpointManager(directory, max_to_keep=2, async_save=use_async) as ckpt:
    start = (ckpt.latest_step() or 0) + 1
    for s in range(start, start + 100_000):
        ckpt.save(s, jax.tree.map(lambda x, s=s: x + s, base), data_position={"step": s})
        print(f"saved {s}", flush=True)
