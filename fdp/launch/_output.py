"""Workers' output: prefixed on the agent's console, or written to one file per rank."""

from __future__ import annotations

import collections
import os
import subprocess
import threading
from typing import IO, Any

_TAIL = 40  # lines kept per worker for the failure summary
_LOCK = threading.Lock()  # one line at a time on the agent's console


class Output:
    """Where one worker's stdout and stderr go, and the last lines it wrote.

    With ``log_path`` the worker writes straight into that file (stderr
    merged into stdout); else two threads copy its pipes to the agent's
    stdout and stderr, each line prefixed with ``[rank N] ``.
    """

    def __init__(self, rank: int, log_path: str | None, stdout: IO[str], stderr: IO[str]):
        self.rank = rank
        self.log_path = log_path
        self._sinks = (stdout, stderr)
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self._file: IO[bytes] | None = None
        self._threads: list[threading.Thread] = []

    def popen_kwargs(self) -> dict[str, Any]:
        """The ``stdout``/``stderr`` arguments for the worker's ``Popen``."""
        if self.log_path is not None:
            os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
            self._file = open(self.log_path, "wb")  # noqa: SIM115 (closed in close())
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
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace").rstrip("\r\n")
                self._tail.append(line)
                with _LOCK:
                    sink.write(prefix + line + "\n")
                    sink.flush()

    def close(self, timeout: float = 5.0) -> None:
        """Waits for the copies to drain (the worker has ended) and closes the log file."""
        for thread in self._threads:
            thread.join(timeout)
        if self._file is not None:
            self._file.close()

    def tail(self) -> tuple[str, ...]:
        """The worker's last lines of output."""
        if self.log_path is None:
            return tuple(self._tail)
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return ()
        return tuple(text.splitlines()[-_TAIL:])
