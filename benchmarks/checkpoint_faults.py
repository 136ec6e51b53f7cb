"""Faults injected into checkpoints, what fdp does about each, and the time to resume.

Each fault is applied to a directory of checkpoints written by
``tests/workers/ckpt_writer.py`` (8 arrays of 256x256 float32, checkpoint s filled
with s), then a fresh ``fdp.CheckpointManager`` restores it. The outcome is the
step restored (and whether its values are exactly that step's), a warning, or the
error raised; the time to resume is the wall time of the restore (opening the
manager, checking checksums, reading the arrays).

  kill-sync / kill-async   the writer SIGKILLed at a random moment (10 times each)
  bit flip                 8 bytes flipped in the middle of an array data file
  truncation               an array data file cut to half its size
  truncated metadata       state/_METADATA cut to half its size
  deleted metadata         state/_METADATA removed

    python benchmarks/checkpoint_faults.py --json benchmarks/results/checkpoint_faults.json
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITER = os.path.join(ROOT, "tests", "workers", "ckpt_writer.py")


def start_writer(directory: str, use_async: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, WRITER, directory] + (["--async"] if use_async else [])
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip


def restore(directory: str, template) -> dict:
    import numpy as np

    import fdp

    began = time.perf_counter()
    try:
        with fdp.CheckpointManager(directory) as ckpt:
            out = ckpt.restore(template)
    except Exception as e:  # the outcome to report
        return {"outcome": f"{type(e).__name__}", "seconds": time.perf_counter() - began}
    took = time.perf_counter() - began
    exact = all(
        np.array_equal(np.asarray(x), np.full(x.shape, out.step, np.float32))
        for x in jax.tree.leaves(out.state)
    )
    return {"outcome": f"restored step {out.step}", "exact": exact, "seconds": took}


def kills(template, use_async: bool, times: int, rng: random.Random) -> list[dict]:
    directory = tempfile.mkdtemp(prefix="fdp-kill-")
    rows = []
    for i in range(times):
        proc = start_writer(directory, use_async)
        assert proc.stdout is not None
        proc.stdout.readline()  # its first save returned
        delay = rng.uniform(0.0, 0.4)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        rows.append({"kill": i, "delay_s": delay, **restore(directory, template)})
    return rows


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(8)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))


def truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


DAMAGE = {
    "bit flip (8 bytes, array data)": ("state/ocdbt.process_0/d/*", flip),
    "truncated array data": ("state/ocdbt.process_0/d/*", truncate),
    "truncated metadata": ("state/_METADATA", truncate),
    "deleted metadata": ("state/_METADATA", os.remove),
}


def damaged(template, name: str) -> dict:
    import fdp

    directory = tempfile.mkdtemp(prefix="fdp-damage-")
    with fdp.CheckpointManager(directory) as ckpt:
        for s in (1, 2):
            ckpt.save(s, jax.tree.map(lambda x, s=s: x + s, template))
    pattern, damage = DAMAGE[name]
    for path in sorted(glob.glob(os.path.join(directory, "2", pattern)))[:1]:
        damage(path)
    return {"fault": name, **restore(directory, template)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 2)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    import jax.numpy as jnp

    import fdp

    template = fdp.replicate({f"w{i}": jnp.zeros((256, 256)) for i in range(8)})
    rng = random.Random(args.seed)
    rows = []
    for mode in ("sync", "async"):
        for r in kills(template, mode == "async", args.kills, rng):
            rows.append({"fault": f"kill during write ({mode}) #{r.pop('kill')}", **r})
    rows += [damaged(template, name) for name in DAMAGE]
    print(f"{'fault':<36} {'outcome':<34} {'exact':>5} {'resume s':>8}")
    for r in rows:
        exact = "-" if "exact" not in r else ("yes" if r["exact"] else "NO")
        print(f"{r['fault']:<36} {r['outcome']:<34} {exact:>5} {r['seconds']:>8.2f}")
    if args.json:
        meta = {
            "command": "python benchmarks/checkpoint_faults.py " + " ".join(argv or sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "jax": jax.__version__,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
