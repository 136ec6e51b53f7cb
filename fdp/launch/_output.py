r"""Workers' output: one prefixed, line-buffered stream per rank, and per-rank log files.

Each worker's stdout and stderr are read in records that end at ``\n`` (a
line) or ``\r`` (a progress update that the next one overwrites, as tqdm
writes). The console gets whole lines only, each prefixed with ``[rank N]``
and written under one lock, so ranks never interleave inside a line. A
progress bar is redrawn in place on a terminal for one rank (the first one
shown); elsewhere only its final state, the line that ends it, is printed.
Transport chatter (gloo's ``[Gloo] Rank N is connected to ...``, JAX's
``SIGTERM caught`` when the agent stops a worker) is left out of the console
unless ``FDP_DEBUG`` is ``INFO`` or ``DETAIL``; log files keep everything.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import threading
from collections.abc import Mapping
from typing import IO, Any

_TAIL = 40  # lines kept per worker for the failure summary
_MAX_RECORD = 1 << 16  # a "line" longer than this is cut, so memory stays bounded
_CLEAR = "\r\x1b[K"  # back to the start of the terminal line, erase it

# Lines that say nothing to the user: printed by gloo for every communicator it
# sets up (16-32 per run), and by JAX when the agent stops a worker with SIGTERM.
# gloo writes to stdout from C++, apart from Python's own buffer. The bootstrap
# line-buffers C's stdout, so its line is one write: :data:`GLOO_LINE` takes it
# out of the byte stream wherever it lands (inside a progress bar, between a
# print's text and its newline). Where it is not one write (a line longer than
# C's buffer, a script that unbuffers C's stdout again), a progress bar's "\r"
# may cut it in two, or a line of the worker's land between its text and its
# newline: these patterns are searched anywhere in a record; each half is known
# on its own; a whole message ends where gloo's text ends (what follows it is the
# worker's), a half or another form at the end of the record.
TRANSPORT_NOISE = (
    re.compile(
        r"\[Gloo\] Rank \d+ is connected to"
        r"(?: \d+ peer ranks\. Expected number of connected peer ranks is : \d+|\b.*)"
    ),
    re.compile(r"\b\d+ peer ranks\. Expected number of connected peer ranks is(?: : \d+|\b.*)"),
    re.compile(r"[IWE]\d{4} [\d:.]+\s+\d+ preemption_notifier\.cc:\d+\] SIGTERM caught.*"),
)


def quiet_transport(environ: Mapping[str, str]) -> bool:
    """Whether transport logs stay off the console: unless ``FDP_DEBUG`` is INFO or DETAIL.

    Example:
      >>> quiet_transport({}), quiet_transport({"FDP_DEBUG": "detail"})
      (True, False)
    """
    return environ.get("FDP_DEBUG", "").strip().upper() not in ("INFO", "DETAIL")


def split_noise(line: str) -> tuple[str, str, str]:
    """``line`` cut around the first transport chatter (:data:`TRANSPORT_NOISE`).

    Returns (before, chatter, after). What comes before the chatter is an
    unfinished line of the worker's own (a progress bar that had not ended its
    line when gloo wrote); what comes after a whole gloo message is the worker's
    line written between gloo's text and gloo's newline.

    Example:
      >>> split_noise("[Gloo] Rank 1 is connected to 7 peer ranks. Expected ...")
      ('', '[Gloo] Rank 1 is connected to 7 peer ranks. Expected ...', '')
      >>> split_noise("train: 0%|  | 0/2[Gloo] Rank 0 is connected to 1 peer ranks.")
      ('train: 0%|  | 0/2', '[Gloo] Rank 0 is connected to 1 peer ranks.', '')
      >>> split_noise("[Gloo] Rank 0 is connected to ")  # cut in two by a progress bar
      ('', '[Gloo] Rank 0 is connected to ', '')
      >>> split_noise("step 3 1 peer ranks. Expected number of connected peer ranks is : 1")
      ('step 3 ', '1 peer ranks. Expected number of connected peer ranks is : 1', '')
      >>> gloo = "[Gloo] Rank 0 is connected to 1 peer ranks. "
      >>> gloo += "Expected number of connected peer ranks is : 1"
      >>> split_noise(gloo + "loss 0.25") == ("", gloo, "loss 0.25")
      True
      >>> split_noise("loss 0.25")
      ('loss 0.25', '', '')
    """
    for pattern in TRANSPORT_NOISE:
        m = pattern.search(line)
        if m:
            return line[: m.start()], m.group(), line[m.end() :]
    return line, "", ""


# gloo's whole connection line as C's line-buffered stdout writes it: one write,
# newline and all. Python's print is two writes (the text, then "\n") under
# PYTHONUNBUFFERED, and this line can land between them; cut out of the stream,
# the worker's text and its newline meet again.
GLOO_LINE = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    rb"Expected number of connected peer ranks is : \d+\n"
)


class Splitter:
    r"""Cuts a byte stream into records ending at ``\n`` (lines) or ``\r`` (progress).

    ``\r\n`` ends one line. A partial record waits for more bytes, up to
    64 KiB; :meth:`flush` returns what is left at the end of the stream. Text
    that ``cut`` matches whole (its own line, newline included) is taken out of
    the stream where it stands and given as a line of its own, so what was
    written around it joins up.

    Args:
      cut: whole lines written in one write by another writer (:data:`GLOO_LINE`).

    Example:
      >>> s = Splitter()
      >>> s.feed(b"\rbar 1\rbar 2") + s.feed(b"\rbar 3\nok\r") + s.feed(b"\nhalf")
      [('bar 1', False), ('bar 2', False), ('bar 3', True), ('ok', True)]
      >>> s.flush()
      [('half', True)]
      >>> s = Splitter(cut=re.compile(rb"<noise>\n"))
      >>> s.feed(b"a\nloss 0.25<noise>\n\n")
      [('a', True), ('<noise>', True), ('loss 0.25', True)]
    """

    def __init__(self, cut: re.Pattern[bytes] | None = None) -> None:
        self._buf = b""
        self._cut = cut

    def feed(self, data: bytes) -> list[tuple[str, bool]]:
        """The records ``data`` completes: ``(text, True)`` a line, ``(text, False)`` progress."""
        buf, out, start = self._buf + data, [], 0
        if self._cut is not None:
            rest = b""
            for m in self._cut.finditer(buf):
                records, rest = _records(rest + buf[start : m.start()])
                out += records
                out.append((m.group().rstrip(b"\n").decode(errors="replace"), True))
                start = m.end()
            buf = rest + buf[start:]
        records, self._buf = _records(buf)
        out += records
        if len(self._buf) > _MAX_RECORD:
            out.append((self._buf.decode(errors="replace"), True))
            self._buf = b""
        return out

    def flush(self) -> list[tuple[str, bool]]:
        """The unfinished record at the end of the stream, as a line."""
        text, self._buf = self._buf.rstrip(b"\r").decode(errors="replace"), b""
        return [(text, True)] if text else []


def _records(buf: bytes) -> tuple[list[tuple[str, bool]], bytes]:
    """The records ``buf`` ends, and what is left of it unfinished."""
    out, start = [], 0
    for m in re.finditer(rb"\r\n|\n|\r", buf):
        if m.group() == b"\r" and m.end() == len(buf):
            break  # a "\r" that may start "\r\n": wait for the next byte
        record = buf[start : m.start()]
        if record or m.group() != b"\r":  # "\r" at a line's start ends nothing
            out.append((record.decode(errors="replace"), m.group() != b"\r"))
        start = m.end()
    return out, buf[start:]


class Console:
    """The agent's terminal or pipe, shared by every worker: one record at a time.

    On a terminal, one progress line may be open (drawn without a newline):
    any other line first erases it, and it is drawn again after that line.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: tuple[IO[str], int, str] | None = None  # (sink, rank, text)

    def line(self, sink: IO[str], rank: int | None, text: str) -> None:
        """Writes ``text`` and a newline; a rank's line ends its own progress bar."""
        with self._lock:
            reopen = self._erase()
            sink.write(text + "\n")
            if reopen is not None and reopen[1] != rank:
                self._draw(*reopen)
            sink.flush()

    def progress(self, sink: IO[str], rank: int, text: str) -> None:
        """Draws a progress line in place (on a terminal; elsewhere it is dropped)."""
        if not _isatty(sink):
            return
        with self._lock:
            self._erase()
            self._draw(sink, rank, text)

    def end(self) -> None:
        """Ends an open progress line with a newline (the workers are gone)."""
        with self._lock:
            if self._open is not None:
                self._open[0].write("\n")
                self._open[0].flush()
                self._open = None

    def _erase(self) -> tuple[IO[str], int, str] | None:
        was, self._open = self._open, None
        if was is not None:
            was[0].write(_CLEAR)
        return was

    def _draw(self, sink: IO[str], rank: int, text: str) -> None:
        sink.write(_CLEAR + text)
        sink.flush()
        self._open = (sink, rank, text)


CONSOLE = Console()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Output:
    """Where one worker's stdout and stderr go, and the last lines it wrote.

    Args:
      rank: the worker's global rank (its prefix ``[rank N] ``).
      log_path: a file for everything it writes (stdout and stderr merged), or None.
      stdout: the console stream for its stdout.
      stderr: the console stream for its stderr.
      console: whether its output also goes to the console (``--tee``, or no
        ``--log-dir``, and its rank among ``--console-ranks``).
      progress: whether its progress bars are drawn on a terminal.
      quiet: leave :data:`TRANSPORT_NOISE` off the console.
    """

    def __init__(
        self,
        rank: int,
        log_path: str | None,
        stdout: IO[str],
        stderr: IO[str],
        *,
        console: bool = True,
        progress: bool = True,
        quiet: bool = True,
    ):
        self.rank = rank
        self.log_path = log_path
        self._sinks = (stdout, stderr)
        self._console, self._progress, self._quiet = console, progress, quiet
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self._file: IO[bytes] | None = None
        self._file_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def _piped(self) -> bool:
        # Without the console, the worker writes straight into its log file: no
        # thread in between, and the file is complete even if the agent dies.
        return self._console or self.log_path is None

    def popen_kwargs(self) -> dict[str, Any]:
        """The ``stdout``/``stderr`` arguments for the worker's ``Popen``."""
        if self.log_path is not None:
            os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
            self._file = open(self.log_path, "wb")  # noqa: SIM115 (closed in close())
            if not self._piped:
                return {"stdout": self._file, "stderr": subprocess.STDOUT}
        return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}

    def attach(self, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        """Starts copying the worker's pipes (nothing to do when it writes to a file)."""
        for pipe, sink in ((stdout, self._sinks[0]), (stderr, self._sinks[1])):
            if pipe is None:
                continue
            thread = threading.Thread(target=self._copy, args=(pipe, sink), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _copy(self, pipe: IO[bytes], sink: IO[str]) -> None:
        prefix = f"[rank {self.rank}] "
        splitter, owed = Splitter(cut=GLOO_LINE), False
        with pipe:
            fd = pipe.fileno()
            while True:
                data = os.read(fd, 65536)
                if self._file is not None and data:
                    with self._file_lock:
                        if not self._file.closed:  # closed if close() timed out
                            self._file.write(data)
                            self._file.flush()
                records = splitter.feed(data) if data else splitter.flush()
                records, owed = self._unmix(records, owed)
                for text, is_line in records:
                    if not is_line:
                        if self._console and self._progress and text:
                            CONSOLE.progress(sink, self.rank, prefix + text)
                        continue
                    self._tail.append(text)
                    if self._console:
                        CONSOLE.line(sink, self.rank, prefix + text)
                if not data:
                    return

    def _unmix(
        self, records: list[tuple[str, bool]], owed: bool
    ) -> tuple[list[tuple[str, bool]], bool]:
        """Transport chatter on a line of its own, or left out when quiet.

        What came before the chatter on its line is still unfinished: progress.
        What came after a whole message is the worker's own; the message's newline
        then comes later (``owed``), as an empty line, which is left out.
        """
        out = []
        for text, is_line in records:
            if is_line and owed and not text:
                owed = False
                continue
            owed = owed and not is_line
            while True:
                before, noise, after = split_noise(text)
                if not noise:
                    out.append((text, is_line))
                    break
                out.append((before, False))
                if not self._quiet:
                    out.append((noise, True))
                if not after:
                    break
                text, owed = after, True
        return [(text, is_line) for text, is_line in out if text or is_line], owed

    def close(self, timeout: float = 5.0) -> None:
        """Waits for the copies to drain (the worker has ended) and closes the log file."""
        for thread in self._threads:
            thread.join(timeout)
        CONSOLE.end()
        if self._file is not None:
            with self._file_lock, contextlib.suppress(OSError):
                self._file.close()

    def tail(self) -> tuple[str, ...]:
        """The worker's last lines of output."""
        if self._piped:
            return tuple(self._tail)
        assert self.log_path is not None
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return ()
        return tuple(text.splitlines()[-_TAIL:])
