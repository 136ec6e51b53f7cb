"""Saves checkpoints in a loop until killed (for the kill-during-write tests).

    ckpt_writer.py DIR [--async] [--keep N] [--die-before-checksums-of S]

Checkpoint s holds arrays filled with s, so a reader can tell whether it got
the whole of one step. After each save it prints `saved s`. With
`--die-before-checksums-of S` it SIGKILLs itself when fdp is about to record
step S's checksums, i.e. just after Orbax has published step S: the moment
issue 32 lost whole runs in, hit every time rather than by chance.
"""

import os
import signal
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402

import fdp  # noqa: E402
from fdp.runtime import _ckpt_files  # noqa: E402


def option(name, default=None):
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


directory, use_async = sys.argv[1], "--async" in sys.argv
keep, die_at = option("--keep", 2), option("--die-before-checksums-of")
if die_at is not None:
    write_manifest = _ckpt_files.write_manifest

    def write_or_die(step_dir):
        if os.path.basename(step_dir) == str(die_at):
            print(f"dying {die_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        write_manifest(step_dir)

    _ckpt_files.write_manifest = write_or_die

base = fdp.replicate({f"w{i}": jnp.zeros((256, 256)) for i in range(8)})
with fdp.CheckpointManager(directory, max_to_keep=keep, async_save=use_async) as ckpt:
    start = (ckpt.latest_step() or 0) + 1
    for s in range(start, start + 100_000):
        ckpt.save(s, jax.tree.map(lambda x, s=s: x + s, base), data_position={"step": s})
        print(f"saved {s}", flush=True)
