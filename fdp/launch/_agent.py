"""The agent: starts this host's workers, watches them, stops and restarts the group.

torchrun's elastic agent, without elasticity: the group is fixed. When any
worker fails, every other worker is stopped (SIGTERM to its process group,
SIGKILL after ``grace_period``), and the group restarts, up to
``max_restarts`` times. SIGINT, SIGTERM and SIGHUP sent to the agent are
forwarded to the workers, which are then stopped the same way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO

from fdp.launch import _env, _summary
from fdp.launch._config import LaunchConfig
from fdp.launch._output import Output

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
        self._round = 0

    def error_file(self, rank: int) -> str:
        """Where worker ``rank`` of this attempt writes its traceback."""
        return os.path.join(self.run_dir, f"attempt_{self.attempt}", f"rank_{rank}.error.json")

    def start(self, stdout: IO[str], stderr: IO[str]) -> None:
        """Starts every local worker, each in its own session (process group)."""
        cfg = self.cfg
        gpus = _env.detect_gpus(os.environ) if cfg.bind_gpus else []
        if 0 < len(gpus) < cfg.nproc_per_node:
            _log(stderr, f"{cfg.nproc_per_node} workers share {len(gpus)} GPU(s): {gpus}.")
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        command = _env.worker_command(cfg, sys.executable)
        os.makedirs(os.path.join(self.run_dir, f"attempt_{self.attempt}"), exist_ok=True)
        for local_rank in range(cfg.nproc_per_node):
            rank = cfg.node_rank * cfg.nproc_per_node + local_rank
            env = _env.worker_env(
                cfg,
                local_rank,
                port=self.port,
                restart_count=self.attempt,
                error_file=self.error_file(rank),
                base=os.environ,
                gpus=gpus,
                cpus=cpus,
            )
            log = None
            if self.log_dir is not None:
                log = os.path.join(self.log_dir, f"attempt_{self.attempt}", f"rank_{rank}.log")
            output = Output(rank, log, stdout, stderr)
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
    stream.write(f"fdp launch: {message}\n")
    stream.flush()


def _watch(group: WorkerGroup, received: list[int]) -> str:
    """Watches until the group succeeds, a worker fails, or the agent gets a signal."""
    while True:
        if received:
            return "signal"
        ended = group.poll()
        if any(w.exit is not None and w.exit.failed for w in ended):
            return "failed"
        if not group.running:
            return "succeeded"
        time.sleep(group.cfg.monitor_interval)


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
    run_dir = cfg.log_dir or tempfile.mkdtemp(prefix=f"fdp-launch-{cfg.run_id}-")
    try:
        with _signals_recorded() as received:
            for attempt in range(attempts):
                port = cfg.master_port or _env.free_port(cfg.master_addr)
                group = WorkerGroup(cfg, attempt, port, run_dir, cfg.log_dir)
                first = cfg.node_rank * cfg.nproc_per_node
                last = first + cfg.nproc_per_node - 1
                _log(
                    stderr,
                    f"starting ranks {first}..{last} of {cfg.world_size} (attempt {attempt + 1} of "
                    f"{attempts}, coordinator {cfg.master_addr}:{port}, run id {cfg.run_id})"
                    + (f", logs in {cfg.log_dir}/attempt_{attempt}" if cfg.log_dir else ""),
                )
                try:
                    group.start(stdout, stderr)
                    outcome = _watch(group, received)
                finally:
                    # Whatever happened (even an error in the agent), no worker survives.
                    if received:
                        group.stop(first=received[0])
                    else:
                        group.stop()
                if outcome == "succeeded":
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
                stderr.write(summary + "\n")
                stderr.flush()
                return 1
    finally:
        if cfg.log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 1
