"""Hang detection: the agent's watch over where its workers are.

A worker that dies is seen at once; one that hangs (a deadlock, an endless
loop, a blocking host callback, a process stopped by SIGSTOP or a debugger) is
not dead, and its peers soon wait for it in a collective, so every worker goes
quiet. Each worker records where it is in a heartbeat file
(:mod:`fdp.runtime._heartbeat`): the steps it entered and finished, whether it is
tracing and compiling, what it waits for outside the compiled program, whether
it said it is busy (``fdp.runtime.busy``), and that its script returned. The
agent declares a hang from evidence, never from silence alone. After
``timeout`` seconds (``--hang-timeout``) of it:

- a worker stopped: its ``/proc`` state is ``T`` (a signal: SIGSTOP, SIGTSTP)
  or ``t`` (a debugger's ptrace stop), and only then does a message say "stopped";
- a worker *behind*: a peer finished (or waits inside) a step that this worker
  has not entered, or waits for it at a store key or host collective, and this
  worker made no move (a worker that never reaches its first step while its
  peers wait is one); one inside ``fdp.runtime.busy()`` (process 0 checking a
  checkpoint while its peers wait for the verdict) only after ``idle_timeout``;
- every worker quiet while one waits at a store key or host collective (peers
  waiting for what no one will do: different keys, a deadlock);
- every worker quiet, and one of them blocked in a host callback (read from
  the Python stacks of every worker, which the agent asks for once a pause
  has lasted ``timeout``, unless a worker is busy or stopped).

A pause with no such evidence (every worker alive and between steps, or all
inside one step, none waiting for a peer) is an evaluation or a synchronous
checkpoint as often as a hang: it counts only after ``idle_timeout`` seconds
(``--idle-timeout``, 10 minutes by default, as NCCL's watchdog in a collective),
and never while a worker is inside ``fdp.runtime.busy()``.

Compiling never counts: while any worker traces and compiles (a step's first
call for its shapes) no one is quiet, and a worker that entered the step is not
behind. Nor does the exit after the last step (the script returned). The worker
blamed is, in order: a stopped one, the one behind, one blocked in a host
callback, then the one that entered and finished the fewest steps, quiet the
longest. :meth:`Hang.table` shows every worker's state.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence

from fdp.runtime._heartbeat import Beat, read


@dataclasses.dataclass(frozen=True)
class Hang:
    """The worker blamed for a hang, and where every worker was.

    Attributes:
      rank: its global rank.
      steps: steps it completed (0: none).
      quiet: seconds it made no progress (for the one behind: since a peer waited for it).
      stopped: its process was stopped (``/proc`` state ``T`` or ``t``) when blamed.
      why: what the evidence says, as the end of ``'hung: it ...'``.
      table: one line per worker (a header first): its steps and where it was.
    """

    rank: int
    steps: int
    quiet: float
    stopped: bool
    why: str = ""
    table: tuple[str, ...] = ()

    def describe(self) -> str:
        """``'hung: it completed no step for 30.1 s after its step 5 (...)'``."""
        return f"hung: it {self.why or self._quiet_text()}"

    def _quiet_text(self) -> str:
        if self.steps:
            what = f"completed no step for {self.quiet:.1f} s after its step {self.steps}"
        else:
            what = f"made no progress for {self.quiet:.1f} s before its first step"
        how = " (its process is stopped: /proc state T or t)" if self.stopped else ""
        return what + how


# /proc/<pid>/stat states of a stopped process: what stopped it, and the evidence.
_STOPPED = {
    "T": ("stopped by a signal", "/proc state T, e.g. SIGSTOP or SIGTSTP"),
    "t": ("stopped by a debugger", "/proc state t, a ptrace stop"),
}


@dataclasses.dataclass
class _Watched:
    rank: int
    pid: int
    heartbeat: str
    beat: Beat = dataclasses.field(default_factory=lambda: Beat(0, 0))
    changed: float = 0.0  # when it last entered or finished a step (or the watch began)
    behind_since: float | None = None
    stopped_since: float | None = None
    state: str = ""  # its last /proc state letter ('' if unknown)

    @property
    def exiting(self) -> bool:
        return self.beat.exiting

    @property
    def compiling(self) -> bool:
        return self.beat.compiling and not self.beat.exiting


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in ``/proc`` (``'T'``: stopped), ``''`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


def _waits_for(peer: Beat, beat: Beat) -> bool:
    """Whether a worker at ``peer`` waits for one at ``beat``.

    It does when it finished a step the other has not entered (it waits in that
    step's collective); when it is inside such a step, unless still compiling it
    without waiting for its peers there (e.g. at a store key); and when it waits
    for its peers outside the compiled program (a store key, a host collective)
    no later than the other, which neither waits nor compiles.
    """
    if peer.exiting:
        return False
    if peer.finished > beat.entered:
        return True
    if peer.entered > beat.entered and (not peer.compiling or bool(peer.waiting)):
        return True
    return (
        bool(peer.waiting)
        and not (beat.waiting or beat.compiling or beat.exiting)
        and (peer.entered, peer.finished) >= (beat.entered, beat.finished)
    )


def _ahead(peer: Beat, beat: Beat) -> bool:
    """Whether ``peer`` is past ``beat`` in steps: it finished or entered a step beyond."""
    return peer.finished > beat.entered or peer.entered > beat.entered


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>\S+)')
_LIBRARY = re.compile(r"/lib/python3[^/]*/|[/\\](site|dist)-packages[/\\]|^<frozen ")
_FDP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fdp's own frames
# Where a step's call runs its compiled program: the runner, or a front end that calls
# the program alone (tests/launch/test_launch.py checks that each file exists).
STEP_CALLS = tuple(
    os.path.join(_FDP, "step", *parts)
    for parts in (
        ("core", "_runner.py"),
        ("front", "_linen.py"),
        ("front", "_nnx.py"),
        ("front", "_ddp.py"),
    )
)


def callback_frame(stack: str) -> str | None:
    """Where a host callback runs inside the compiled step, from a ``faulthandler`` dump.

    A host callback (``jax.debug.callback``, ``jax.pure_callback``,
    ``io_callback``) is Python code that the compiled program calls: either on
    the runtime's own thread, a thread whose outermost frame is neither the
    script's (the launcher's bootstrap) nor a Python thread's (``threading``), or
    on the thread that called the step, where it shows as code of the user's
    (not fdp's, not a library's) called from inside fdp's step call. Read only
    while the step is not tracing, when the user's loss runs there too. Returns
    the innermost frame of the user's code (else the innermost frame), or None.

    Example:
      >>> dump = '''Thread 0x1 (most recent call first):
      ...   File "/w/train.py", line 9 in block
      ...   File "/x/lib/python3.11/site-packages/jax/_src/debugging.py", line 3 in cb
      ...
      ... Current thread 0x2 (most recent call first):
      ...   File "/w/train.py", line 20 in <module>
      ...   File "/x/fdp/launch/_bootstrap.py", line 1 in <module>
      ... '''
      >>> callback_frame(dump)
      'train.py, line 9 in block'
      >>> callback_frame(dump.split("Current")[1]) is None
      True
    """
    for frames, truncated in _threads(stack):
        if not frames or truncated:
            continue
        if frames[-1]["file"].endswith(("_bootstrap.py", "threading.py")):
            calls = [i for i, f in enumerate(frames) if f["file"] in STEP_CALLS]
            frames = frames[: calls[0]] if calls else []  # what the step's call runs
        own = [f for f in frames if not (_LIBRARY.search(f["file"]) or f["file"].startswith(_FDP))]
        if own:
            top = own[0]
            return f"{os.path.basename(top['file'])}, line {top['line']} in {top['name']}"
    return None


def _threads(stack: str) -> list[tuple[list[dict[str, str]], bool]]:
    """The frames of each thread in a ``faulthandler`` dump (innermost first), and if cut."""
    threads: list[tuple[list[dict[str, str]], bool]] = []
    for line in stack.splitlines():
        if re.match(r"^(Current thread|Thread) 0x[0-9a-fA-F]+", line):
            threads.append(([], False))
        elif threads and (m := _FRAME.match(line)):
            threads[-1][0].append(m.groupdict())
        elif threads and line.strip() == "...":
            threads[-1] = (threads[-1][0], True)
    return threads


class Watchdog:
    """Watches one attempt's workers for a hang.

    Args:
      timeout: seconds of a hang's evidence (behind, stopped, waiting, in a host
        callback) before it counts.
      workers: ``(rank, pid, heartbeat file)`` of each worker.
      idle_timeout: seconds a pause without evidence (every worker alive, quiet,
        none busy) may last before it counts; 0: never.
    """

    def __init__(
        self,
        timeout: float,
        workers: Sequence[tuple[int, int, str]],
        *,
        idle_timeout: float = 600.0,
    ):
        self.timeout, self.idle_timeout = timeout, idle_timeout
        now = time.monotonic()
        self._workers = [_Watched(rank, pid, path, changed=now) for rank, pid, path in workers]
        self._probed = float("-inf")  # when the stacks were last read for a host callback

    def _update(self, live: list[_Watched], now: float) -> None:
        for w in live:
            beat = read(w.heartbeat)
            if beat is not None:
                if beat != w.beat:  # any record written counts: it moved
                    w.changed = now
                    w.behind_since = None
                w.beat = beat
            w.state = process_state(w.pid)
            if w.state in _STOPPED:
                w.stopped_since = w.stopped_since or now
            else:
                w.stopped_since = None
        for w in live:
            waited = not w.exiting and any(_waits_for(p.beat, w.beat) for p in live if p is not w)
            if not waited:
                w.behind_since = None
            elif w.behind_since is None:
                w.behind_since = now

    def _triggered(self, live: list[_Watched], now: float) -> str | None:
        """Which evidence held long enough, if any.

        ``'hang'``; ``'probe'``: read the stacks for a host callback; ``'idle'``: a
        pause past ``idle_timeout``; None.
        """
        if any(w.stopped_since is not None and now - w.stopped_since >= self.timeout for w in live):
            return "hang"
        if any(w.behind_since is not None and now - w.behind_since >= self._limit(w) for w in live):
            return "hang"
        active = [w for w in live if not w.exiting]
        if not active or any(w.compiling for w in live):
            return None
        if not any(w.beat.finished for w in active):
            return None  # nothing has stepped yet: start-up
        since = max(w.changed for w in live)
        if now - since < self.timeout:
            return None
        busy = any(w.beat.busy for w in active)
        if any(w.beat.waiting for w in active) and not busy:
            return "hang"  # it waits for peers that are quiet too: for nothing
        if busy or any(w.stopped_since is not None for w in active):
            return None  # busy: a pause; stopped: a hang once it has lasted `timeout`
        # One look at the stacks per `timeout` of a pause, not one per check.
        if self._probed < since or now - self._probed >= self.timeout:
            self._probed = now
            return "probe"
        return "idle" if self._idle(live, now) else None

    def _limit(self, w: _Watched) -> float:
        """How long peers may wait for ``w``: ``timeout``, or ``idle_timeout`` while it is busy.

        A worker inside ``fdp.runtime.busy()`` says why its peers wait (process 0
        checksumming a checkpoint while the others wait for its verdict); that
        counts as a pause, and only ``idle_timeout`` ends it (0: never).
        """
        if not w.beat.busy:
            return self.timeout
        return self.idle_timeout if self.idle_timeout else float("inf")

    def _idle(self, live: list[_Watched], now: float) -> bool:
        return bool(self.idle_timeout) and now - max(w.changed for w in live) >= self.idle_timeout

    def check(
        self,
        running: set[int],
        stacks: Callable[[list[int]], Mapping[int, str]] | None = None,
    ) -> Hang | None:
        """The hung worker to blame, or ``None``; ``running`` are the ranks still running.

        ``stacks`` returns the Python stacks of the given ranks; it is called
        once a hang is found, for the evidence of a host callback and the table,
        and once a pause has lasted ``timeout``, to look for a host callback.
        """
        now = time.monotonic()
        live = [w for w in self._workers if w.rank in running]
        self._update(live, now)
        reason = self._triggered(live, now)
        if reason is None:
            return None
        dumps = dict(stacks([w.rank for w in live])) if stacks else {}
        inside = {
            w.rank: None if w.compiling else callback_frame(dumps.get(w.rank, "")) for w in live
        }
        if reason == "probe" and all(frame is None for frame in inside.values()):
            if not self._idle(live, now):
                return None  # a pause, not (yet) a hang: idle_timeout decides
            reason = "idle"
        candidates = [w for w in live if not w.exiting] or live
        blamed = min(
            candidates,
            key=lambda w: (
                w.stopped_since is None,
                w.behind_since is None,
                inside[w.rank] is None,
                w.beat.entered,
                w.beat.finished,
                w.changed,
                w.rank,
            ),
        )
        why, quiet = self._why(blamed, live, inside[blamed.rank], now, idle=reason == "idle")
        return Hang(
            blamed.rank,
            blamed.beat.finished,
            quiet,
            blamed.stopped_since is not None,
            why,
            self._table(now, running, inside),
        )

    def _why(
        self, w: _Watched, live: list[_Watched], callback: str | None, now: float, *, idle: bool
    ) -> tuple[str, float]:
        """What the evidence says of the blamed worker, and how long it has held the others up."""
        steps = w.beat.finished
        after = f"after its step {steps}" if steps else "before its first step"
        if w.stopped_since is not None:  # only on the evidence of its /proc state
            by, evidence = _STOPPED.get(w.state, _STOPPED["T"])
            stopped = now - w.stopped_since
            if steps:
                quiet = now - w.changed
                what = f"completed no step for {quiet:.1f} s {after} (its process has been"
                return f"{what} {by} for {stopped:.1f} s: {evidence})", quiet
            return f"has been {by} for {stopped:.1f} s {after} ({evidence})", stopped
        if w.behind_since is not None:
            quiet = now - w.behind_since
            peers = [p for p in live if p is not w and _waits_for(p.beat, w.beat)]
            ranks = ", ".join(str(p.rank) for p in peers)
            labels = sorted({p.beat.waiting for p in peers if p.beat.waiting})
            at = f"at {', '.join(labels)}" if labels else f"in step {w.beat.entered + 1}"
            entered = w.beat.entered
            if not entered:
                what = "reach its first step"
            elif any(_ahead(p.beat, w.beat) for p in peers):
                what = f"enter step {entered + 1} {after}"
            else:
                what = f"join them {after}"
            return f"did not {what} for {quiet:.1f} s while rank(s) {ranks} waited {at}", quiet
        quiet = now - w.changed
        what = f"completed no step for {quiet:.1f} s {after}"
        if callback is not None:
            return f"{what}: it is blocked in a host callback ({callback}) inside the step", quiet
        waiting = sorted({p.beat.waiting for p in live if p.beat.waiting and not p.exiting})
        if not idle and waiting:
            return (
                f"{what}, while every worker was quiet and some waited for their peers at "
                f"{', '.join(waiting)} (no worker is behind, stopped or in a host callback: "
                "blamed as the one with the fewest steps, of the lowest rank; see every "
                "worker's state below)",
                quiet,
            )
        return (
            f"{what}, nor did any other worker: a pause past the --idle-timeout of "
            f"{self.idle_timeout:g} s (no worker is behind, stopped, busy or in a host "
            "callback: blamed as the one with the fewest steps, of the lowest rank; see every "
            "worker's state below; wrap long evaluations or checkpoints in "
            "fdp.runtime.busy())",
            quiet,
        )

    def _table(
        self, now: float, running: set[int], inside: Mapping[int, str | None]
    ) -> tuple[str, ...]:
        rows = [("rank", "steps", "where", "no progress for")]
        for w in sorted(self._workers, key=lambda w: w.rank):
            rows.append(
                (
                    str(w.rank),
                    str(w.beat.finished),
                    _where(w, w.rank in running, inside.get(w.rank)),
                    f"{now - w.changed:.1f} s",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return tuple(
            "  ".join(c.ljust(n) for c, n in zip(row, widths, strict=True)).rstrip() for row in rows
        )


def _where(w: _Watched, running: bool, callback: str | None) -> str:
    """One worker's state in words, e.g. ``'inside step 4, waiting for store key ...'``."""
    beat = w.beat
    if not running:
        return "ended"
    if w.stopped_since is not None:
        return f"{_STOPPED.get(w.state, _STOPPED['T'])[0]} (/proc state {w.state or 'T'})"
    if beat.exiting:
        return "exiting (its script returned)"
    if beat.compiling:
        where = f"compiling step {beat.entered}" if beat.inside else "compiling"
    elif beat.inside:
        where = f"inside step {beat.entered}"
    elif beat.finished:
        where = f"between steps {beat.finished} and {beat.finished + 1}"
    else:
        where = "before its first step"
    if beat.busy:
        where += ", busy"
    if beat.waiting:
        where += f", waiting for {beat.waiting}"
    if callback is not None:
        where += f", in a host callback ({callback})"
    return where
