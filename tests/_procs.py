"""Running fdp launch and worker scripts as real processes, and proving none outlives a test."""

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
# Variables a surrounding launcher or cluster may have set, which would confuse the children.
_INHERITED = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "XLA_FLAGS",
)


def child_env(marker, **extra):
    """The environment of a test's children: this checkout's fdp first, and a marker."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _INHERITED and not k.startswith(("FDP_", "SLURM_", "OMPI_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["FDP_TEST_MARKER"] = marker
    # As in this test process (pyproject's filterwarnings): errors, but for fdp 0.1's
    # flat step keywords, which still work for one release (a message prefix here,
    # without the ':' that separates PYTHONWARNINGS' fields).
    flat = ("fdp.train_step", "fdp.nnx_train_step", "fdp.grad_accumulator")
    env["PYTHONWARNINGS"] = ",".join(
        ["error", *(f"ignore:{prefix}:DeprecationWarning" for prefix in flat)]
    )
    env.update(extra)
    return env


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    ended_at: float  # time.time() when the process was seen to end

    @property
    def output(self):
        return self.stdout + self.stderr


def start(args, marker, **env):
    """Starts `python ARGS` in its own session, from the repository root."""
    return subprocess.Popen(
        [sys.executable, *map(str, args)],
        cwd=ROOT,
        env=child_env(marker, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc, timeout, started):
    """Waits for `proc` up to `timeout` seconds; kills its session and fails if it hangs."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{out}\n{err}") from None
    return Result(proc.returncode, out, err, time.monotonic() - started, time.time())


def run(args, marker, *, timeout=180, **env):
    """Runs `python ARGS` to the end (bounded by `timeout`)."""
    started = time.monotonic()
    return finish(start(args, marker, **env), timeout, started)


def launch(launch_args, script, script_args, marker, *, timeout=180, **env):
    """Runs `python -m fdp.launch LAUNCH_ARGS tests/workers/SCRIPT SCRIPT_ARGS`."""
    args = ["-m", "fdp.launch", *launch_args, f"tests/workers/{script}", *script_args]
    return run(args, marker, timeout=timeout, **env)


def alive(pid):
    """Whether process `pid` exists and has not ended (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _marked(marker):
    needle = f"FDP_TEST_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and alive(entry):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def survivors(marker, wait=10.0):
    """Processes carrying `marker` still alive after up to `wait` seconds; kills them."""
    deadline = time.monotonic() + wait
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left
