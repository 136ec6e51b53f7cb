"""Hang detection: the agent's watch over its workers' per-step heartbeats.

A worker that dies is seen at once; one that hangs (a deadlock, an endless
loop, a process stopped by SIGSTOP or a debugger) is not dead, and its peers
soon wait for it in a collective, so every worker goes quiet. Each worker
reports every completed step through a heartbeat file
(:mod:`fdp.runtime._heartbeat`); the agent declares a hang when a worker has
completed no step for ``timeout`` seconds after its last one, or has been
stopped by a signal for that long, and blames the worker that is behind: a
stopped one first, then the one with the fewest steps, then the one quiet the
longest. A worker is watched for steps from its first step on, so compiling
and loading before it never count as a hang.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from fdp.runtime._heartbeat import read


@dataclasses.dataclass(frozen=True)
class Hang:
    """The worker blamed for a hang.

    Attributes:
      rank: its global rank.
      steps: steps it completed (0: none).
      quiet: seconds since its last step (since it was stopped, if it never stepped).
      stopped: the process was stopped by a signal (SIGSTOP, SIGTSTP).
    """

    rank: int
    steps: int
    quiet: float
    stopped: bool

    def describe(self) -> str:
        """``'hung: it completed no step for 30.1 s after its step 5 (...)'``."""
        if self.steps:
            what = f"completed no step for {self.quiet:.1f} s after its step {self.steps}"
        else:
            what = f"was stopped for {self.quiet:.1f} s before its first step"
        how = " (the process was stopped by a signal, e.g. SIGSTOP)" if self.stopped else ""
        return f"hung: it {what}{how}"


@dataclasses.dataclass
class _Watched:
    rank: int
    pid: int
    heartbeat: str
    steps: int = 0
    changed: float = 0.0
    stopped_since: float | None = None


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in ``/proc`` (``'T'``: stopped), ``''`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


class Watchdog:
    """Watches one attempt's workers for a hang.

    Args:
      timeout: seconds without a step (or stopped) after which a worker is hung.
      workers: ``(rank, pid, heartbeat file)`` of each worker.
    """

    def __init__(self, timeout: float, workers: Sequence[tuple[int, int, str]]):
        self.timeout = timeout
        now = time.monotonic()
        self._workers = [_Watched(rank, pid, path, changed=now) for rank, pid, path in workers]

    def check(self, running: set[int]) -> Hang | None:
        """The hung worker to blame, or ``None``; ``running`` are the ranks still running."""
        now = time.monotonic()
        live = [w for w in self._workers if w.rank in running]
        for w in live:
            steps = read(w.heartbeat)
            if steps is not None and steps != w.steps:
                w.steps, w.changed = steps, now
            if process_state(w.pid) == "T":
                w.stopped_since = w.stopped_since or now
            else:
                w.stopped_since = None
        late = [
            w
            for w in live
            if (w.steps and now - w.changed >= self.timeout)
            or (w.stopped_since is not None and now - w.stopped_since >= self.timeout)
        ]
        if not late:
            return None
        blamed = min(live, key=lambda w: (w.stopped_since is None, w.steps, w.changed, w.rank))
        since = blamed.changed if blamed.steps else (blamed.stopped_since or blamed.changed)
        return Hang(blamed.rank, blamed.steps, now - since, blamed.stopped_since is not None)
