"""Each worker's environment: its ranks, the coordinator, and its share of the host."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from fdp.launch._config import LaunchConfig

# Thread-pool sizes read by the libraries a CPU worker may load.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def detect_gpus(environ: Mapping[str, str]) -> list[str]:
    """The NVIDIA GPUs this host lets us use, without importing JAX.

    ``CUDA_VISIBLE_DEVICES`` if set (its entries, in order); else the GPUs
    ``nvidia-smi -L`` lists; else the ``/dev/nvidiaN`` device files.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False
            ).stdout
            count = len(re.findall(r"^GPU \d+", out, re.M))
            if count:
                return [str(i) for i in range(count)]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        nodes = [n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)]
    except OSError:
        nodes = []
    return [str(i) for i in range(len(nodes))]


def split_evenly(items: Sequence[Any], parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous, nearly equal groups; round-robin if too few.

    Example:
      >>> split_evenly([0, 1, 2, 3, 4], 2), split_evenly([0, 1], 3)
      ([[0, 1, 2], [3, 4]], [[0], [1], [0]])
    """
    items = list(items)
    if len(items) < parts:
        return [[items[i % len(items)]] for i in range(parts)] if items else [[]] * parts
    base, extra = divmod(len(items), parts)
    groups, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        groups.append(items[start : start + size])
        start += size
    return groups


def worker_env(
    cfg: LaunchConfig,
    local_rank: int,
    *,
    port: int,
    restart_count: int,
    error_file: str,
    base: Mapping[str, str],
    gpus: Sequence[str],
    cpus: Sequence[int],
    heartbeat_file: str | None = None,
    stack_file: str | None = None,
) -> dict[str, str]:
    """The environment of local worker ``local_rank``.

    Sets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
    fdp's (``FDP_RESTART_COUNT``, ``FDP_MAX_RESTARTS``, ``FDP_RUN_ID``,
    ``FDP_ERROR_FILE``, ``FDP_AGENT_PID``, and for hang detection
    ``FDP_HEARTBEAT_FILE`` and ``FDP_STACK_FILE``), and the worker's share of the host:
    ``CUDA_VISIBLE_DEVICES`` with GPUs; without, ``FDP_CPU_AFFINITY`` (applied
    by the worker before anything starts threads) and matching thread counts.
    Variables the user set already (thread counts, ``PYTHONUNBUFFERED``) are kept.
    """
    n = cfg.nproc_per_node
    env = dict(base)
    env.update(
        RANK=str(cfg.node_rank * n + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(cfg.world_size),
        LOCAL_WORLD_SIZE=str(n),
        GROUP_RANK=str(cfg.node_rank),
        MASTER_ADDR=cfg.master_addr,
        MASTER_PORT=str(port),
        FDP_RESTART_COUNT=str(restart_count),
        FDP_MAX_RESTARTS=str(cfg.max_restarts),
        FDP_RUN_ID=cfg.run_id,
        FDP_ERROR_FILE=error_file,
        FDP_AGENT_PID=str(os.getpid()),
    )
    for var, path in (("FDP_HEARTBEAT_FILE", heartbeat_file), ("FDP_STACK_FILE", stack_file)):
        if path is not None:
            env[var] = path
        else:
            env.pop(var, None)  # never one inherited from a surrounding launch
    # Output reaches the console (or log file) as it is written, not when a crash loses it.
    env.setdefault("PYTHONUNBUFFERED", "1")
    if gpus and cfg.bind_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(split_evenly(gpus, n)[local_rank])
    elif not gpus and cfg.bind_cpus and n > 1 and cpus:
        share = split_evenly(cpus, n)[local_rank]
        env["FDP_CPU_AFFINITY"] = ",".join(str(c) for c in share)
        for var in _THREAD_VARS:
            env.setdefault(var, str(len(share)))
    elif n > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several workers
    return env


def worker_command(cfg: LaunchConfig, python: str) -> list[str]:
    """The command that starts one worker: fdp's bootstrap around the user's script."""
    bootstrap = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py")
    target = ["-m", cfg.script] if cfg.module else [cfg.script]
    return [python, bootstrap, *target, *cfg.script_args]
