"""Per-step heartbeats from a worker to the ``fdp launch`` agent that watches it.

The agent names a file in ``FDP_HEARTBEAT_FILE``; every step a worker
completes overwrites it with the number of steps completed so far (one
``pwrite`` of 21 bytes, a few microseconds). The agent reads the files to tell a
worker that stopped making progress (hung, or stopped by a signal) from its
peers, which soon wait for it and stop too, and to report its last step.
Outside the launcher (no variable) nothing is written.
"""

from __future__ import annotations

import os

HEARTBEAT_VAR = "FDP_HEARTBEAT_FILE"

_state = {"steps": 0, "fd": None, "pid": None}


def _file() -> int:
    """The heartbeat file's descriptor, opened once per process (-1 when not watched)."""
    if _state["pid"] != os.getpid():  # first use, or a forked child: do not share the file
        path = os.environ.get(HEARTBEAT_VAR)
        fd = -1
        if path:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                fd = -1
        _state.update(fd=fd, pid=os.getpid())
    return _state["fd"]  # pyright: ignore[reportReturnType]


def step_done() -> None:
    """Records that this process completed (dispatched) one more step."""
    _state["steps"] += 1  # pyright: ignore[reportOperatorIssue]
    fd = _file()
    if fd >= 0:
        try:
            os.pwrite(fd, b"%20d\n" % _state["steps"], 0)
        except OSError:
            _state["fd"] = -1  # the agent's directory went away: stop trying


def steps_done() -> int:
    """Steps this process has completed."""
    return _state["steps"]  # pyright: ignore[reportReturnType]


def read(path: str) -> int | None:
    """The step count in a heartbeat file, or ``None`` if there is none (yet)."""
    try:
        with open(path, "rb") as f:
            text = f.read(64)
    except OSError:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None
