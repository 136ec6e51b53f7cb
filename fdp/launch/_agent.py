"""The agent: starts this host's workers, watches them, stops and restarts the group.

torchrun's elastic agent, without elasticity: the group is fixed. When any
worker fails, or hangs (:mod:`fdp.launch._watchdog`), every other worker is
stopped (SIGTERM to its process group, SIGKILL after ``grace_period``), and the
group restarts, up to ``max_restarts`` times. SIGINT, SIGTERM and SIGHUP sent
to the agent are forwarded to the workers, which are then stopped the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO

from fdp.launch import _env, _output, _summary
from fdp.launch._bootstrap import STACK_SIGNAL
from fdp.launch._config import LaunchConfig
from fdp.launch._output import Output
from fdp.launch._watchdog import Hang, Watchdog, process_state

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Worker:
    def __init__(self, local_rank: int, rank: int, proc: subprocess.Popen, output: Output):
        self.local_rank, self.rank, self.proc, self.output = local_rank, rank, proc, output
        self.started = time.monotonic()
        self.exit: _summary.WorkerExit | None = None


class WorkerGroup:
    """The workers of one attempt on this host."""

    def __init__(
        self, cfg: LaunchConfig, attempt: int, port: int, run_dir: str, log_dir: str | None
    ):
        self.cfg, self.attempt, self.port = cfg, attempt, port
        self.run_dir, self.log_dir = run_dir, log_dir
        self.workers: list[_Worker] = []
        self.stopping = False
        self.hang: Hang | None = None
        self._round = 0

    @property
    def dir_name(self) -> str:
        """``attempt_K``, counting from 1 as the banner does (``FDP_RESTART_COUNT`` is K - 1)."""
        return f"attempt_{self.attempt + 1}"

    def _file(self, rank: int, kind: str) -> str:
        return os.path.join(self.run_dir, self.dir_name, f"rank_{rank}.{kind}")

    def error_file(self, rank: int) -> str:
        """Where worker ``rank`` of this attempt writes its traceback."""
        return self._file(rank, "error.json")

    def watchdog(self) -> Watchdog | None:
        """The hang detector over this attempt's workers (None when turned off)."""
        if not self.cfg.hang_timeout:
            return None
        files = [(w.rank, w.proc.pid, self._file(w.rank, "heartbeat")) for w in self.workers]
        return Watchdog(self.cfg.hang_timeout, files, idle_timeout=self.cfg.idle_timeout)

    def dump_stacks(self, ranks: list[int], wait: float = 2.0) -> dict[int, str]:
        """Asks workers ``ranks`` for their Python stacks, all at once, and returns them.

        A stopped worker is continued to run the handler (a running one never
        gets SIGCONT: the watchdog also asks during a pause, to look for a host
        callback). Each one's dump replaces the last, and is read once written
        and no longer growing, or after ``wait`` seconds.
        """
        asked = []
        for w in self.workers:
            if w.rank not in ranks or STACK_SIGNAL is None or w.exit is not None:
                continue
            with contextlib.suppress(OSError):
                os.truncate(self._file(w.rank, "stack"), 0)  # the worker appends (O_APPEND)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(w.proc.pid, STACK_SIGNAL)
                if process_state(w.proc.pid) in ("T", "t"):
                    os.kill(w.proc.pid, signal.SIGCONT)  # a stopped process runs the handler
                asked.append(w.rank)
        sizes = {r: -1 for r in asked}
        deadline = time.monotonic() + wait
        while sizes and time.monotonic() < deadline:
            time.sleep(0.1)
            for r, size in list(sizes.items()):
                path = self._file(r, "stack")
                now = os.path.getsize(path) if os.path.exists(path) else 0
                if now and now == size:  # written, and no longer growing
                    del sizes[r]
                else:
                    sizes[r] = now
        return {r: _read_text(self._file(r, "stack")) or "" for r in ranks}

    def start(self, stdout: IO[str], stderr: IO[str]) -> None:
        """Starts every local worker, each in its own session (process group)."""
        cfg = self.cfg
        gpus = _env.detect_gpus(os.environ) if cfg.bind_gpus else []
        if 0 < len(gpus) < cfg.nproc_per_node:
            _log(stderr, f"{cfg.nproc_per_node} workers share {len(gpus)} GPU(s): {gpus}.")
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        command = _env.worker_command(cfg, sys.executable)
        os.makedirs(os.path.join(self.run_dir, self.dir_name), exist_ok=True)
        quiet = _output.quiet_transport(os.environ)
        shown = [
            r
            for r in range(
                cfg.node_rank * cfg.nproc_per_node, (cfg.node_rank + 1) * cfg.nproc_per_node
            )
            if cfg.console_ranks is None or r in cfg.console_ranks
        ]
        for local_rank in range(cfg.nproc_per_node):
            rank = cfg.node_rank * cfg.nproc_per_node + local_rank
            env = _env.worker_env(
                cfg,
                local_rank,
                port=self.port,
                restart_count=self.attempt,
                error_file=self.error_file(rank),
                heartbeat_file=self._file(rank, "heartbeat"),
                stack_file=self._file(rank, "stack"),
                base=os.environ,
                gpus=gpus,
                cpus=cpus,
            )
            log = None
            if self.log_dir is not None:
                log = os.path.join(self.log_dir, self.dir_name, f"rank_{rank}.log")
            output = Output(
                rank,
                log,
                stdout,
                stderr,
                console=(cfg.log_dir is None or cfg.tee) and rank in shown,
                progress=rank == shown[0] if shown else False,
                quiet=quiet,
            )
            # A new session per worker: signals reach the worker and whatever it
            # started (data loader processes...), and a Ctrl-C in the terminal
            # reaches only the agent, which decides what the workers get.
            proc = subprocess.Popen(
                command, env=env, start_new_session=True, **output.popen_kwargs()
            )
            output.attach(proc.stdout, proc.stderr)
            self.workers.append(_Worker(local_rank, rank, proc, output))

    def poll(self) -> list[_Worker]:
        """Records the workers that ended since the last poll, and returns them."""
        self._round += 1
        ended = []
        for w in self.workers:
            if w.exit is None and w.proc.poll() is not None:
                w.exit = _summary.WorkerExit(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    pid=w.proc.pid,
                    returncode=w.proc.returncode,
                    elapsed=time.monotonic() - w.started,
                    stopped=self.stopping,
                    order=self._round,
                )
                ended.append(w)
        return ended

    @property
    def running(self) -> list[_Worker]:
        """Workers not seen to end yet."""
        return [w for w in self.workers if w.exit is None]

    def send(self, sig: int) -> None:
        """Sends ``sig`` to every running worker's process group."""
        for w in self.running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, sig)

    def stop(self, first: int = signal.SIGTERM) -> None:
        """Stops every running worker: ``first``, then SIGKILL after the grace period."""
        self.stopping = True
        self.send(first)
        deadline = time.monotonic() + self.cfg.grace_period
        while self.running and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.02)
        if self.running:
            self.send(signal.SIGKILL)
        for w in self.workers:
            w.proc.wait()
            # The worker is gone; kill anything it left behind in its group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, signal.SIGKILL)
        self.poll()
        for w in self.workers:
            w.output.close()

    def exits(self) -> list[_summary.WorkerExit]:
        """How each worker ended, with its error file and last output."""
        out = []
        for w in self.workers:
            assert w.exit is not None
            w.exit.error = _summary.read_error_file(self.error_file(w.rank))
            w.exit.tail = w.output.tail()
            if self.hang is not None and self.hang.rank == w.rank:
                w.exit.hang = self.hang.describe()
                w.exit.hang_table = self.hang.table
                w.exit.stack = _read_text(self._file(w.rank, "stack"))
            out.append(w.exit)
        return out


@contextlib.contextmanager
def _signals_recorded() -> Iterator[list[int]]:
    received: list[int] = []
    previous = {}
    for sig in _FORWARDED:
        previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _log(stream: IO[str], message: str) -> None:
    _output.CONSOLE.line(stream, None, f"fdp launch: {message}")


def _read_text(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read() or None
    except OSError:
        return None


def _watch(group: WorkerGroup, received: list[int], stderr: IO[str]) -> str:
    """Watches until the group succeeds, a worker fails or hangs, or the agent gets a signal."""
    watchdog = group.watchdog()
    while True:
        if received:
            return "signal"
        ended = group.poll()
        if any(w.exit is not None and w.exit.failed for w in ended):
            return "failed"
        if not group.running:
            return "succeeded"
        hang = watchdog and watchdog.check({w.rank for w in group.running}, group.dump_stacks)
        if hang:
            group.hang = hang
            table = "".join(f"\n  {line}" for line in hang.table)
            _log(stderr, f"rank {hang.rank} {hang.describe()}; stopping the workers.{table}")
            return "failed"
        time.sleep(group.cfg.monitor_interval)


def _check_port_free(cfg: LaunchConfig, port: int) -> str | None:
    """Why this host cannot run the coordinator on ``port`` (None: it can, or is not its host).

    Checked before any worker starts: a second run on a busy port must fail
    here, not send workers to join the first run's coordinator (which aborts that run).
    """
    if cfg.node_rank != 0:
        return None
    family = socket.AF_INET6 if ":" in cfg.master_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((cfg.master_addr, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (
                    f"the coordinator port {cfg.master_addr}:{port} is in use (another run?); "
                    "no worker was started. Choose another --master-port, or leave it out on "
                    "one host to get a free one."
                )
    return None  # free, or an address of another host (EADDRNOTAVAIL): not ours to check


_RUN_DIR = re.compile(r"fdp-launch-pid(\d{1,7})-")


def _remove_stale_run_dirs(root: str) -> None:
    """Removes run directories left by agents that were killed (SIGKILL skips cleanup)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = _RUN_DIR.match(entry.name)
            if not (match and entry.is_dir(follow_symlinks=False)):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
            try:
                os.kill(int(match.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(entry.path, ignore_errors=True)
            except PermissionError:
                pass  # alive, under another user


def launch(
    cfg: LaunchConfig, *, stdout: IO[str] | None = None, stderr: IO[str] | None = None
) -> int:
    """Runs ``cfg``'s workers on this host until they succeed or the restarts run out.

    Returns:
      0 when every worker of an attempt exited 0; 1 when the last allowed
      attempt failed (after printing the failure summary); 128 + the signal
      number when the agent was interrupted.
    """
    out: IO[str] = stdout or sys.stdout
    err: IO[str] = stderr or sys.stderr
    stdout, stderr = out, err
    attempts = cfg.max_restarts + 1
    if cfg.log_dir is None:
        _remove_stale_run_dirs(tempfile.gettempdir())
    # The agent's pid in the name tells a later agent whether this one is still alive.
    run_dir = cfg.log_dir or tempfile.mkdtemp(prefix=f"fdp-launch-pid{os.getpid()}-{cfg.run_id}-")
    try:
        with _signals_recorded() as received:
            for attempt in range(attempts):
                port = cfg.master_port or _env.free_port(cfg.master_addr)
                busy = _check_port_free(cfg, port) if cfg.master_port else None
                if busy:
                    _log(stderr, busy)
                    return 1
                group = WorkerGroup(cfg, attempt, port, run_dir, cfg.log_dir)
                first = cfg.node_rank * cfg.nproc_per_node
                last = first + cfg.nproc_per_node - 1
                _log(
                    stderr,
                    f"starting ranks {first}..{last} of {cfg.world_size} (attempt {attempt + 1} of "
                    f"{attempts}, coordinator {cfg.master_addr}:{port}, run id {cfg.run_id})"
                    + (
                        f", logs in {os.path.join(cfg.log_dir, group.dir_name)}"
                        if cfg.log_dir
                        else ""
                    ),
                )
                try:
                    group.start(stdout, stderr)
                    outcome = _watch(group, received, stderr)
                finally:
                    # Whatever happened (even an error in the agent), no worker survives.
                    if received:
                        group.stop(first=received[0])
                    else:
                        group.stop()
                if outcome == "succeeded":
                    _log(
                        stderr,
                        _summary.format_success(group.exits(), attempt, attempts, cfg.run_id),
                    )
                    return 0
                if outcome == "signal":
                    sig = received[0]
                    _log(stderr, f"received {signal.Signals(sig).name}; stopped the workers.")
                    return 128 + sig
                exits = group.exits()
                if attempt + 1 < attempts:
                    _log(
                        stderr,
                        f"attempt {attempt + 1} of {attempts} failed: {_summary.one_line(exits)}; "
                        f"restarting the group (restart {attempt + 1} of {cfg.max_restarts}).",
                    )
                    continue
                summary = _summary.format_failure(
                    exits, attempt=attempt, attempts=attempts, run_id=cfg.run_id
                )
                _output.CONSOLE.line(stderr, None, summary)
                return 1
    finally:
        if cfg.log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 1
