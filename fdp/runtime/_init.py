"""``fdp.init``: join the processes of a run, as ``torch.distributed.init_process_group``."""

from __future__ import annotations

import errno
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from types import TracebackType

import jax

from fdp import backends
from fdp._compat import config_value
from fdp._validate import MAX_TIMEOUT_MS, check_number
from fdp.runtime import _claim, _config

# What init learnt about this host, for local_rank() and local_world_size().
_LOCAL: dict[str, int | None] = {}

_LOCAL_RANK_VARS = ("FDP_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE_VARS = (
    "FDP_LOCAL_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)


def init(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    coordinator_bind_address: str | None = None,
    initialization_timeout: float = 300.0,
    heartbeat_timeout: float = 100.0,
    shutdown_timeout: float = 300.0,
    cluster_detection: bool = True,
    fail_fast: bool = True,
    tune_malloc: bool | None = None,
) -> None:
    """Joins this process to the run's other processes, if any, and tunes host malloc.

    The settings come from the arguments, else fdp's variables
    (``FDP_COORDINATOR_ADDRESS``, ``FDP_NUM_PROCESSES``, ``FDP_PROCESS_ID``,
    ``FDP_LOCAL_RANK``, ``FDP_LOCAL_WORLD_SIZE``), else torchrun's
    (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, which ``fdp launch`` sets), else a cluster JAX
    detects (Slurm, Open MPI, Kubernetes). With several processes it turns on
    gloo for CPU collectives and calls ``jax.distributed.initialize``. With
    one process and none of these variables it joins nothing; in every case it
    sets up the host allocator (``tune_malloc``) unless told not to.

    Call it first, before anything starts JAX's backend (``jax.devices()``, a
    computation, ``fdp.data_mesh()``); configure JAX (``jax_num_cpu_devices``)
    before it too.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator.
      num_processes: the number of processes.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      local_rank: this process's index on its host (for :func:`local_rank`).
      local_world_size: processes on this host (for :func:`local_world_size`).
      local_device_ids: the local devices this process may use (JAX's argument).
      coordinator_bind_address: where process 0's coordinator listens. By
        default the coordinator's own address when that is a loopback address
        (``fdp launch`` on one host), else every interface.
      initialization_timeout: seconds to wait for the coordinator and every
        process; a coordinator that cannot be reached in time is an error that
        names its address.
      heartbeat_timeout: seconds after which JAX declares a silent process dead
        and stops the others.
      shutdown_timeout: seconds a finishing process waits for the others.
      cluster_detection: let JAX detect Slurm, Open MPI or Kubernetes when no
        variables are set.
      fail_fast: with several processes, an uncaught exception ends this
        process at once (traceback printed, exit status 1) instead of waiting
        up to ``shutdown_timeout`` in JAX's shutdown barrier for peers that are
        still running; the peers then stop too (``fdp launch`` stops them at
        once, JAX within ``heartbeat_timeout``).
      tune_malloc: make glibc keep freed host memory for reuse (``mallopt``:
        no ``mmap`` for large blocks, no heap trimming below 1 GiB, one arena),
        so that XLA:CPU's per-step buffers stop faulting their pages in again
        every step; on CPU this makes steps faster (the gloo all-reduce
        markedly, one process's compute too), at the cost of keeping the peak
        host working set resident. ``None`` reads ``FDP_MALLOC_TUNING``: ``0``
        turns it off, ``1`` on; unset, it is on where JAX runs on CPUs and off
        on GPU hosts (``JAX_PLATFORMS``, ``CUDA_VISIBLE_DEVICES`` or GPU device
        files say which), where it was never measured. Does nothing, with a
        debug log, where the C library is not glibc.

    Raises:
      ValueError: variables or arguments are malformed, contradictory or
        incomplete; the message names them and their values.
      TimeoutError: the coordinator was not reachable within
        ``initialization_timeout``.
      OSError: process 0 cannot listen on the coordinator's port.
      RuntimeError: the coordinator on this host belongs to another run
        (another ``FDP_RUN_ID``); joining would abort that run.
      RuntimeError: called after JAX's backend started.

    Example:
      >>> import fdp
      >>> fdp.init()  # one process, no variables: no peers to join
      >>> fdp.process_index(), fdp.process_count(), fdp.local_rank()
      (0, 1, 0)
    """
    timeouts = {
        name: check_number(value, name, allow_inf=True)
        for name, value in (
            ("initialization_timeout", initialization_timeout),
            ("heartbeat_timeout", heartbeat_timeout),
            ("shutdown_timeout", shutdown_timeout),
        )
    }
    initialization_timeout = timeouts["initialization_timeout"]
    settings = _config.resolve(
        coordinator_address,
        num_processes,
        process_id,
        local_rank,
        local_world_size,
        os.environ,
        cluster_detection=cluster_detection,
    )
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "fdp.init() was called twice (or after jax.distributed.initialize()); call it "
            "once, at the start of the program."
        )
    _LOCAL.update(local_rank=settings.local_rank, local_world_size=settings.local_world_size)
    # The host's backend decides (malloc tuning: on CPU hosts, where it was measured).
    backends.prepare_host(tune_malloc, os.environ)
    if not settings.multi_process:
        return
    # Shared-memory files of processes killed in an earlier run's set-up (the set-up
    # removes them too, but a run that never sets it up would leave them).
    backends.remove_stale_files()
    if config_value("jax_cpu_collectives_implementation") in (None, "none"):
        # Without it, CPU computations that span processes fail to compile.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + initialization_timeout
    kwargs: dict = {}
    if settings.cluster is None:
        address = settings.coordinator_address
        assert address is not None and settings.process_id is not None
        bind = _config.bind_address(address, coordinator_bind_address, os.environ)
        host, port = _config.split_address("coordinator_address", address)
        run_id = os.environ.get(_claim.RUN_ID_VAR) or None
        if settings.process_id == 0:
            _check_can_listen(bind or f"0.0.0.0:{port}")
            _claim.claim(port, run_id)
        else:
            _wait_for_coordinator(address, initialization_timeout, settings)
            _claim.check(address, host, port, run_id)
        kwargs = dict(
            coordinator_address=address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            coordinator_bind_address=bind,
        )
    try:
        jax.distributed.initialize(
            **kwargs,
            local_device_ids=local_device_ids,
            initialization_timeout=_seconds(deadline - time.monotonic()),
            heartbeat_timeout_seconds=_seconds(timeouts["heartbeat_timeout"]),
            shutdown_timeout_seconds=_seconds(timeouts["shutdown_timeout"]),
        )
    except RuntimeError as e:
        if "before any JAX calls" in str(e):
            raise RuntimeError(
                "fdp.init() must be called before any JAX calls that might initialise the XLA "
                "backend (jax.devices(), a computation, fdp.data_mesh(), fdp.replicate()...). "
                "Call it first, right after configuring JAX."
            ) from e
        raise
    if fail_fast:
        sys.excepthook = _exit_on_uncaught


def _seconds(timeout: float) -> int:
    """Whole seconds for JAX, at least 1; ``inf`` becomes the longest wait JAX takes."""
    return max(1, round(min(timeout, MAX_TIMEOUT_MS // 1000)))


def _wait_for_coordinator(address: str, timeout: float, settings: _config.Settings) -> None:
    # JAX's client aborts the whole process (a C++ fatal error, no Python
    # exception) when it cannot reach the coordinator, so fdp checks first.
    host, port = _config.split_address("coordinator_address", address)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(0.2, left))
    raise TimeoutError(
        f"fdp.init: the coordinator at {address} could not be reached within "
        f"initialization_timeout={timeout:g} s (this is process {settings.process_id} of "
        f"{settings.num_processes}, settings from {settings.source}). Check that process 0 is "
        "running and that the address and port (MASTER_ADDR/MASTER_PORT or "
        "FDP_COORDINATOR_ADDRESS) point at it and are not blocked by a firewall."
    )


def _check_can_listen(address: str) -> None:
    host, port = _config.split_address("coordinator_address", address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if host in ("::", "0.0.0.0") else host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(
                    e.errno,
                    f"fdp.init: process 0 cannot start the coordinator on {address}: the port "
                    f"is in use (another run?). Choose another MASTER_PORT or "
                    f"FDP_COORDINATOR_ADDRESS.",
                ) from None
            raise


def _exit_on_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    traceback.print_exception(exc_type, exc, tb)
    _claim.release()  # os._exit runs no atexit handler
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip atexit: JAX's shutdown barrier would wait for the peers that are
    # still running (up to shutdown_timeout) before this process could exit.
    os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)


def process_index() -> int:
    """This process's index among all processes, from 0 (DDP's rank, counted in processes)."""
    return jax.process_index()


def process_count() -> int:
    """The number of processes (DDP's world size counts devices; this counts processes)."""
    return jax.process_count()


def _local(name: str, variables: Sequence[str], default: int) -> int:
    value = _LOCAL.get(name)
    if value is not None:
        return int(value)
    for var in variables:
        value = os.environ.get(var, "")
        if value.strip().isdigit():
            return int(value)
    return default


def local_rank() -> int:
    """This process's index among the processes of its host (0 when it runs alone).

    Set by :func:`init`, else read from ``FDP_LOCAL_RANK``, ``LOCAL_RANK``,
    ``SLURM_LOCALID`` or ``OMPI_COMM_WORLD_LOCAL_RANK``.
    """
    return _local("local_rank", _LOCAL_RANK_VARS, 0)


def local_world_size() -> int:
    """The number of processes on this host (1 when nothing says otherwise).

    Set by :func:`init`, else read from ``FDP_LOCAL_WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE`` or
    ``OMPI_COMM_WORLD_LOCAL_SIZE``.
    """
    return _local("local_world_size", _LOCAL_SIZE_VARS, 1)
