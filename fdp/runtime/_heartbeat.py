"""Where a worker is, for the ``fdp launch`` agent that watches it for hangs.

The agent names a file in ``FDP_HEARTBEAT_FILE``; a worker maps it into memory
(128 bytes, once per process) and keeps its record there: no system call per
write. A step writes three counters in place (one ``struct.pack_into``: the
steps entered, the steps finished, the writes so far) when it starts and when it
finishes, so an agent reading at any moment sees where it is, and a worker
stopped right after a step is named with that step. The rest of the record is
written whole when it changes: the worker starts or stops waiting for its peers
outside the compiled program (a store key, a host collective), enters or leaves
:func:`busy` (an evaluation, a checkpoint), compiles, or its script has returned.

The agent reads the files to tell the worker that holds the others up (one that did
not enter the step its peers wait in) from the peers that wait for it, to leave
compiling and the exit after the last step alone, and to report where every worker
was (:mod:`fdp.launch._watchdog`). Outside the launcher (no variable) nothing is written.

The record: ``FDPH``, 4 bytes of padding, ``ENTERED FINISHED WRITES`` as three
native 8-byte integers, then one line of text, ``FLAGS [WAITING FOR...]``, where
``FLAGS`` is ``-`` (none) or letters: ``c`` (tracing and compiling: a step's first
call for its shapes, or ``lower``) or ``x`` (the script returned: the process is
exiting), and ``b`` (inside :func:`busy`); ``WRITES`` counts the changes of the
record, so that any activity shows. :func:`parse` also reads the text records of
fdp before it (``ENTERED FINISHED FLAGS WRITES [WAITING...]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import struct
import threading
from collections.abc import Iterator

HEARTBEAT_VAR = "FDP_HEARTBEAT_FILE"
_SIZE = 128
_MAGIC = b"FDPH"
_COUNTS = struct.Struct("=qqq")  # entered, finished, writes: native order, 8 bytes each
_pack_counts = _COUNTS.pack_into
_AT = 8  # where the counters start (after the magic and 4 bytes of padding)
_TEXT = _AT + _COUNTS.size  # where the line of text starts
_busy_lock = threading.Lock()
_write_lock = threading.Lock()  # whole-record writes, from any thread

# The record as the process knows it. ``steps`` is one tuple ``(entered, finished)``,
# assigned at once; ``changes`` counts every change (the record's WRITES field).
_state: dict = {
    "steps": (0, 0),
    "flag": "-",
    "waiting": "",
    "changes": 0,
    "busy": 0,  # busy() sections open, on any thread
    "map": None,  # the file, mapped; False: not watched (no variable, or it failed)
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
    """In a forked child: the parent's mapping is not this process's."""
    _state.update(map=None)


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
        if m:
            _write()  # the whole record, before the first step writes its counters
    return m or None


def active() -> bool:
    """Whether this process writes a heartbeat (it runs under ``fdp launch``).

    Example:
      >>> isinstance(active(), bool)
      True
    """
    return _mapped() is not None


def _write() -> None:
    """Writes the whole record now (a change the agent must see at once)."""
    m = _state["map"]
    if not m:  # not mapped yet (mapping writes it), or not watched
        _mapped()
        return
    with _write_lock:
        s = _state
        s["changes"] += 1  # any change shows, even one undone before the agent reads
        entered, finished = s["steps"]
        flags = s["flag"].strip("-") + ("b" if s["busy"] else "") or "-"
        text = f"{flags} {s['waiting']}".encode("ascii", "replace")[: _SIZE - _TEXT - 1]
        try:
            m[:_AT] = _MAGIC.ljust(_AT, b"\0")
            _COUNTS.pack_into(m, _AT, entered, finished, s["changes"])
            m[_TEXT:] = text.ljust(_SIZE - _TEXT - 1) + b"\n"
        except (OSError, ValueError, TypeError):
            s["map"] = False  # closed under us: stop trying


def _count(entered: int, finished: int) -> None:
    """A step's counters, written in place (one copy; the text stays as it is)."""
    s = _state
    s["steps"] = (entered, finished)
    if s["flag"] != "-":  # the first step after compiling: the whole record
        s["flag"] = "-"
        _write()
        return
    m = s["map"]
    if not m:
        if m is False or _mapped() is None:
            return
        m = s["map"]
    s["changes"] += 1
    try:
        _COUNTS.pack_into(m, _AT, entered, finished, s["changes"])
    except (ValueError, TypeError):
        s["map"] = False  # closed under us: stop trying


def step_entered() -> None:
    """Records that this process entered one more step (called at the start of the call)."""
    s = _state
    finished = s["steps"][1]
    m = s["map"]
    if not m or s["flag"] != "-":  # not mapped yet, or the whole record to write
        _count(finished + 1, finished)
        return
    # The steady state, inlined (a step's every call): both writes 0.7x the time through
    # _count (1.37 against 1.94 us under fdp launch on the 2-core VM).
    s["steps"] = (finished + 1, finished)
    s["changes"] = changes = s["changes"] + 1
    try:
        _pack_counts(m, _AT, finished + 1, finished, changes)
    except (ValueError, TypeError):
        s["map"] = False  # closed under us: stop trying


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
    finished += 1
    if entered < finished:
        entered = finished
    m = s["map"]
    if not m or s["flag"] != "-":
        _count(entered, finished)
        return
    s["steps"] = (entered, finished)  # as step_entered: _count inlined
    s["changes"] = changes = s["changes"] + 1
    try:
        _pack_counts(m, _AT, entered, finished, changes)
    except (ValueError, TypeError):
        s["map"] = False


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

    Reads the record :func:`step_done` and the others write, and the text records
    of fdp before it (``ENTERED FINISHED FLAGS WRITES [WAITING...]``; a bare
    number counts as that many finished steps).

    Example:
      >>> record = b"FDPH\0\0\0\0" + _COUNTS.pack(4, 3, 12) + b"cb store key 'host/1'\n"
      >>> parse(record)  # doctest: +NORMALIZE_WHITESPACE
      Beat(entered=4, finished=3, compiling=True, exiting=False,
           waiting="store key 'host/1'", writes=12, busy=True)
      >>> parse(b"4 3 - 12 store key 'host/1'\n").waiting  # fdp's text records
      "store key 'host/1'"
      >>> parse(b"7\n").finished, parse(b"5 5 cb 9").busy, parse(b"") is None
      (7, True, True)
    """
    if text.startswith(_MAGIC):
        if len(text) < _TEXT:
            return None
        entered, finished, writes = _COUNTS.unpack_from(text, _AT)
        line = text[_TEXT:].decode("ascii", "replace").strip().split(maxsplit=1)
        flags = line[0] if line else "-"
        waiting = line[1] if len(line) > 1 else ""
        return Beat(entered, finished, "c" in flags, "x" in flags, waiting, writes, "b" in flags)
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
