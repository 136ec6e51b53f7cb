"""How a worker ended, and the failure summary ``fdp launch`` prints."""

from __future__ import annotations

import dataclasses
import json
import signal

# A worker that JAX's coordination service stopped because another one died
# ends with this line: it is a consequence, not a root cause.
# Output or error messages of a worker that failed because a peer died first: JAX's
# coordination service stopping it, or a collective that lost its connection.
_SECONDARY = (
    "JAX distributed service detected fatal errors",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)
_TRACEBACK_LINES = 25


def describe_exit(returncode: int) -> str:
    """``'exit code 1'`` or ``'signal SIGKILL (9)'`` from a ``Popen.returncode``.

    Example:
      >>> describe_exit(3), describe_exit(-9)
      ('exit code 3', 'signal SIGKILL (9)')
    """
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "unknown signal"
    return f"signal {name} ({-returncode})"


def read_error_file(path: str) -> dict | None:
    """The record a worker's bootstrap wrote on an uncaught exception, if any."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclasses.dataclass
class WorkerExit:
    """One worker's end.

    Attributes:
      rank: its global rank.
      local_rank: its rank on this host.
      pid: its process id.
      returncode: ``Popen.returncode`` (negative: killed by that signal).
      elapsed: seconds from its start to when the agent saw it end.
      stopped: the agent had already signalled it to stop.
      order: the agent's poll round in which it was seen to end.
      error: its error file record, if it wrote one.
      tail: its last lines of output.
      hang: why the agent found it hung (:meth:`Hang.describe`), if it did.
      stack: its Python stack when it was found hung, if it could write it.
      hang_table: where every worker was when it was found hung (:attr:`Hang.table`).
    """

    rank: int
    local_rank: int
    pid: int
    returncode: int
    elapsed: float
    stopped: bool
    order: int
    error: dict | None = None
    tail: tuple[str, ...] = ()
    hang: str | None = None
    stack: str | None = None
    hang_table: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        """A non-zero end the agent did not cause, or a hang the agent ended."""
        return (self.returncode != 0 and not self.stopped) or self.hang is not None

    @property
    def secondary(self) -> bool:
        """Stopped by JAX, or failed in a collective, because another process died."""
        texts = [*self.tail]
        if self.error:
            texts += [str(self.error.get("message", "")), str(self.error.get("traceback", ""))]
        return any(marker in text for text in texts for marker in _SECONDARY)


def root_cause(exits: list[WorkerExit]) -> WorkerExit | None:
    """The failure to blame, as torchrun picks the first one.

    A worker the agent found hung, whose peers only waited for it; else the
    earliest failure seen; among those seen in the same poll round, one
    that did not fail because a peer died (a worker killed by a signal comes
    before its peer's lost-connection traceback), then one with a Python
    traceback, then the lowest rank. When that failure is an error every
    worker raises naming the rank at fault (``FDP_CHECK_FINITE``'s "first on
    process 1"), the named rank is blamed if it raised the same error, however
    late or after being stopped.
    """
    failed = [e for e in exits if e.failed]
    if not failed:
        return None
    first = min(
        failed, key=lambda e: (e.hang is None, e.order, e.secondary, e.error is None, e.rank)
    )
    return _named_by(first, exits) or first


def _named_by(cause: WorkerExit, exits: list[WorkerExit]) -> WorkerExit | None:
    """The worker ``cause``'s error names as the one at fault, if it raised that same error."""
    if cause.hang is not None or not cause.error:
        return None
    named = (cause.error.get("blames"), cause.error.get("type"))
    for e in exits:
        if e.error and e.rank == named[0] and (e.error.get("blames"), e.error.get("type")) == named:
            return e
    return None


def format_failure(exits: list[WorkerExit], *, attempt: int, attempts: int, run_id: str) -> str:
    """The summary of a failed attempt: the root cause with its traceback, then the rest."""
    cause = root_cause(exits)
    assert cause is not None
    lines = [
        f"fdp launch: the worker group failed (attempt {attempt + 1} of {attempts}, "
        f"run id {run_id}).",
    ]
    who = f"  root cause: rank {cause.rank} (local rank {cause.local_rank}, pid {cause.pid})"
    if cause.hang:
        lines.append(
            f"{who} {cause.hang}; fdp launch ended it ({describe_exit(cause.returncode)}) "
            f"after {cause.elapsed:.1f} s"
        )
    else:
        ended = describe_exit(cause.returncode)
        lines.append(f"{who} ended with {ended} after {cause.elapsed:.1f} s")
    if cause.hang and cause.stack:
        # The frames of the bootstrap and runpy under the script say nothing.
        body = [
            line
            for line in cause.stack.rstrip("\n").splitlines()
            if "<frozen runpy>" not in line and "fdp/launch/_bootstrap.py" not in line
        ]
        lines.append("  its Python stack when it hung (most recent call first):")
    elif cause.error and cause.error.get("traceback"):
        body = cause.error["traceback"].rstrip("\n").splitlines()
        lines.append("  its traceback (last lines):")
    else:
        body = list(cause.tail)
        lines.append("  its last output:" if body else "  it printed nothing.")
    lines += [f"    {line}" for line in body[-_TRACEBACK_LINES:]]
    if cause.hang_table:
        lines.append("  where every worker was when the hang was found:")
        lines += [f"    {line}" for line in cause.hang_table]
    others = [e for e in sorted(exits, key=lambda e: e.rank) if e is not cause]
    failed = [f"rank {e.rank} ({describe_exit(e.returncode)})" for e in others if e.failed]
    stopped = [
        f"rank {e.rank} ({describe_exit(e.returncode)})"
        for e in others
        if e.stopped and not e.failed
    ]
    if failed:
        lines.append("  other failures: " + ", ".join(failed))
    if stopped:
        lines.append("  stopped after the failure: " + ", ".join(stopped))
    lines += format_table(exits)
    return "\n".join(lines)


def format_success(exits: list[WorkerExit], attempt: int, attempts: int, run_id: str) -> str:
    """The summary of a successful attempt: a line, then :func:`format_table`.

    Example:
      >>> print(format_success([WorkerExit(0, 0, 41, 0, 7.25, False, 9)], 0, 1, "ab12"))
      all 1 worker(s) succeeded (attempt 1 of 1, run id ab12).
        rank  local rank  pid  result  ended with   after
        0     0           41   ok      exit code 0  7.2 s
    """
    head = (
        f"all {len(exits)} worker(s) succeeded (attempt {attempt + 1} of {attempts}, "
        f"run id {run_id})."
    )
    return "\n".join([head, *format_table(exits)])


def format_table(exits: list[WorkerExit]) -> list[str]:
    """One line per worker, by rank: how it ended, and after how long (indented by 2).

    ``result`` is ``ok``, ``root cause`` (:func:`root_cause`), ``failed``, or
    ``stopped`` (by the agent, after another worker failed).
    """
    cause = root_cause(exits)

    def result(e: WorkerExit) -> str:
        if e is cause:
            return "root cause"
        if e.failed:
            return "failed"
        return "stopped" if e.stopped and e.returncode != 0 else "ok"

    rows = [("rank", "local rank", "pid", "result", "ended with", "after")]
    rows += [
        (
            str(e.rank),
            str(e.local_rank),
            str(e.pid),
            result(e),
            describe_exit(e.returncode),
            f"{e.elapsed:.1f} s",
        )
        for e in sorted(exits, key=lambda e: e.rank)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def one_line(exits: list[WorkerExit]) -> str:
    """``'rank 1 ended with exit code 1: RuntimeError: boom'`` for the root cause."""
    cause = root_cause(exits)
    if cause is None:
        return "no worker failed"
    what = f"rank {cause.rank} ended with {describe_exit(cause.returncode)}"
    if cause.hang:
        what = f"rank {cause.rank} {cause.hang}"
    elif cause.error:
        what += f": {cause.error.get('type')}: {cause.error.get('message')}"
    return what
