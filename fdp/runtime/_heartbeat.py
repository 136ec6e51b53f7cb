"""Where a worker is, for the ``fdp launch`` agent that watches it for hangs.

The agent names a file in ``FDP_HEARTBEAT_FILE``; a worker overwrites it (128
bytes, mapped into memory: a copy, no system call) when it finishes a step, starts or
stops waiting for its peers outside the compiled program (a store key, a host
collective), enters or leaves :func:`busy` (an evaluation, a checkpoint), compiles,
and when its script has returned. Entering a step only updates the record in memory (a
tuple assignment); a daemon thread writes that out within :data:`FLUSH_SECONDS`, where
a worker that stays inside the step (waiting for its peers) is seen by the agent,
which judges over tens of seconds. A step costs one memory copy of the record, where it
cost two ``pwrite`` calls.

The agent reads the files to tell the worker that holds the others up (one that did
not enter the step its peers wait in) from the peers that wait for it, to leave
compiling and the exit after the last step alone, and to report where every worker
was (:mod:`fdp.launch._watchdog`). Outside the launcher (no variable) nothing is written.

The record is one line: ``ENTERED FINISHED FLAGS WRITES [WAITING FOR...]``, where
``FLAGS`` is ``-`` (none) or letters: ``c`` (tracing and compiling: a step's first
call for its shapes, or ``lower``) or ``x`` (the script returned: the process is
exiting), and ``b`` (inside :func:`busy`); ``WRITES`` counts the changes of the
record, so that any activity shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import threading
import time
from collections.abc import Iterator

HEARTBEAT_VAR = "FDP_HEARTBEAT_FILE"
FLUSH_SECONDS = 0.05  # how soon the writer thread writes a step's record out
_SIZE = 128
_busy_lock = threading.Lock()
_write_lock = threading.Lock()  # the writer thread and the main thread's own writes

# The record as the process knows it. ``steps`` is one tuple ``(entered, finished)``,
# assigned at once, so that the writer thread never reads half of a change; ``changes``
# counts every change (the record's WRITES field).
_state: dict = {
    "steps": (0, 0),
    "flag": "-",
    "waiting": "",
    "changes": 0,
    "busy": 0,  # busy() sections open, on any thread
    "map": None,  # the file, mapped; False: not watched (no variable, or it failed)
    "written": -1,  # ``changes`` when the record was last written out
    "writer": None,  # the writer thread, started at the first change
}


@dataclasses.dataclass(frozen=True)
class Beat:
    """One worker's record.

    Attributes:
      entered: steps it entered (started to call).
      finished: steps it finished (the call returned: dispatched).
      compiling: it traces and compiles (a step's first call for its shapes).
      exiting: its script returned; it is shutting down.
      waiting: what it waits for outside the compiled program (``''``: nothing).
      writes: records it wrote (any change of where it is).
      busy: it is inside :func:`busy` (an evaluation, a checkpoint): a pause, not a hang.
    """

    entered: int
    finished: int
    compiling: bool = False
    exiting: bool = False
    waiting: str = ""
    writes: int = 0
    busy: bool = False

    @property
    def inside(self) -> bool:
        """Inside a step: entered it and not finished it."""
        return self.entered > self.finished


def _forget() -> None:
    """In a forked child: the parent's mapping and writer thread are not this process's."""
    _state.update(map=None, written=-1, writer=None)


os.register_at_fork(after_in_child=_forget)


def _mapped() -> mmap.mmap | None:
    """The heartbeat file mapped into memory, once per process (None when not watched)."""
    m = _state["map"]
    if m is None:
        m = False
        path = os.environ.get(HEARTBEAT_VAR)
        if path:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    if os.fstat(fd).st_size < _SIZE:
                        os.ftruncate(fd, _SIZE)
                    m = mmap.mmap(fd, _SIZE)
                finally:
                    os.close(fd)
            except (OSError, ValueError):
                m = False
        _state["map"] = m
    return m or None


def active() -> bool:
    """Whether this process writes a heartbeat (it runs under ``fdp launch``).

    Example:
      >>> isinstance(active(), bool)
      True
    """
    return _mapped() is not None


def _write() -> None:
    """Writes the record out now (a change the agent must see at once)."""
    _state["changes"] += 1  # any change shows, even one undone before the agent reads
    _flush()


def _flush() -> None:
    m = _mapped()
    if m is None:
        return
    with _write_lock:
        s = _state
        changes = s["changes"]
        if changes == s["written"]:
            return
        entered, finished = s["steps"]
        flags = s["flag"].strip("-") + ("b" if s["busy"] else "") or "-"
        line = f"{entered} {finished} {flags} {changes} {s['waiting']}"
        try:
            m[:] = line.encode("ascii", "replace")[: _SIZE - 1].ljust(_SIZE - 1) + b"\n"
        except (OSError, ValueError):
            s["map"] = False  # closed under us: stop trying
            return
        s["written"] = changes


def _writer() -> None:
    while True:
        time.sleep(FLUSH_SECONDS)
        if _state["changes"] != _state["written"]:
            _flush()


def _changed() -> None:
    """A step's record changed: the writer thread writes it out (started once per process)."""
    _state["changes"] += 1
    if _state["writer"] is None and _state["map"] is not False and _mapped() is not None:
        thread = threading.Thread(target=_writer, name="fdp-heartbeat", daemon=True)
        _state["writer"] = thread
        thread.start()


def step_entered() -> None:
    """Records that this process entered one more step (called at the start of the call)."""
    s = _state
    s["steps"] = (s["steps"][1] + 1, s["steps"][1])
    if s["flag"] != "-":
        s["flag"] = "-"
    _changed()


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Records, while inside, that this process traces and compiles (never a hang).

    Example:
      >>> with compiling():
      ...     pass
    """
    before = _state["flag"]
    _state["flag"] = "c"
    _write()
    try:
        yield
    finally:
        if _state["flag"] == "c":
            _state["flag"] = before
            _write()


def step_done() -> None:
    """Records that this process completed (dispatched) one more step."""
    s = _state
    entered, finished = s["steps"]
    s["steps"] = (max(entered, finished + 1), finished + 1)
    if s["flag"] != "-":
        s["flag"] = "-"
    _write()  # at once: a worker stopped right after a step is named with that step


def steps_done() -> int:
    """Steps this process has completed."""
    return _state["steps"][1]


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
    """Records, while inside, that this process waits for its peers for ``what``.

    Only the main thread's waits are recorded (the one that runs the steps): a
    background thread's (a checkpoint's) would blur where the steps are.

    Example:
      >>> with waiting("store key 'host/1'"):
      ...     pass
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = _state["waiting"]
    _state["waiting"] = " ".join(what.split())
    _write()
    try:
        yield
    finally:
        _state["waiting"] = before
        _write()


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Says, while inside, that this process is busy outside the steps, not hung.

    ``fdp launch`` takes a pause in which every worker is alive and between steps
    (none waiting for a peer) for a hang only after ``--idle-timeout`` (10
    minutes by default); while any worker is inside ``busy()``, never. Wrap
    what may take longer: an evaluation, a checkpoint (fdp's
    :class:`~fdp.CheckpointManager` does so itself), data that every process
    prepares. A worker that is stopped, or one its peers wait for in a step or
    a host collective for ``--hang-timeout``, is still hung, busy or not.
    Sections nest, may be opened on any thread, and cost one copy of the record
    each way under the launcher (nothing outside it). Also a decorator.

    Example:
      >>> from fdp import runtime
      >>> with runtime.busy():  # e.g. an evaluation on every process
      ...     accuracy = 0.9
    """
    with _busy_lock:
        _state["busy"] += 1
        _write()
    try:
        yield
    finally:
        with _busy_lock:
            _state["busy"] -= 1
            _write()


def exiting() -> None:
    """Records that the script returned: what follows is the process's exit, never a hang."""
    _state["flag"] = "x"
    _write()


def parse(text: bytes) -> Beat | None:
    r"""The record in a heartbeat file's bytes, or ``None`` if there is none (yet).

    A bare number (an older record) counts as that many finished steps.

    Example:
      >>> parse(b"4 3 - 12 store key 'host/1'\n")  # doctest: +NORMALIZE_WHITESPACE
      Beat(entered=4, finished=3, compiling=False, exiting=False,
           waiting="store key 'host/1'", writes=12, busy=False)
      >>> parse(b"7\n").finished, parse(b"5 5 cb 9").busy, parse(b"") is None
      (7, True, True)
    """
    fields = text.decode("ascii", "replace").strip().split(maxsplit=4)
    if len(fields) == 1 and fields[0].isdigit():
        return Beat(int(fields[0]), int(fields[0]))
    if len(fields) < 4 or not all(f.isdigit() for f in (fields[0], fields[1], fields[3])):
        return None
    flags, waiting = fields[2], fields[4] if len(fields) > 4 else ""
    return Beat(
        int(fields[0]),
        int(fields[1]),
        "c" in flags,
        "x" in flags,
        waiting,
        int(fields[3]),
        "b" in flags,
    )


def read(path: str) -> Beat | None:
    """The record in a heartbeat file, or ``None`` if there is none (yet)."""
    try:
        with open(path, "rb") as f:
            return parse(f.read(_SIZE))
    except OSError:
        return None
