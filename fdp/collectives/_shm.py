"""A shared-memory sum across the CPU processes of one host, inside the compiled step.

XLA:CPU's all-reduce goes through gloo over TCP, with separate input and output
buffers, even when every process sits on the same machine. Here each process
maps its peers' shared-memory regions once (``/dev/shm``), and an XLA FFI call
(``_native/shm_sum.cc``, compiled with the host's C++ compiler at first use and
cached) sums a buffer in place: copy in, sum this process's chunk, copy the
other chunks out. The step stays one compiled program; nothing here runs on GPU.

Used by the ``shm_allreduce`` comm hook (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import logging
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp.collectives._axis import AxisName, axis_size

log = logging.getLogger(__name__)

TARGET = "fdp_shm_sum"
SOURCE = Path(__file__).with_name("_native") / "shm_sum.cc"
CAPACITY_ENV = "FDP_SHM_CAPACITY_MB"
DEFAULT_CAPACITY_MB = 1024
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_HEADER = 64

_lock = threading.Lock()
_state: dict[str, Any] = {}
# The previous shared-memory sum of the program being traced (see ordered()).
_chain: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "fdp_shm_chain", default=None
)


def _cache_dir() -> Path:
    root = os.environ.get("FDP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fdp"
    )
    return Path(root) / "native"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError(
            "comm_hook='shm_allreduce' compiles a small C++ file at first use and needs a "
            "C++ compiler: install g++ (or clang++) or set CXX; none was found on PATH."
        )
    return cxx


def library() -> ctypes.CDLL:
    """The compiled FFI library (built once per source and JAX version, then cached)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        include = jax.ffi.include_dir()
        key = hashlib.sha256(SOURCE.read_bytes() + include.encode() + jax.__version__.encode())
        target = _cache_dir() / f"shm_sum-{key.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            cxx = _compiler()
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-I", include]
                cmd += [str(SOURCE), "-o", str(built)]
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise RuntimeError(
                        f"comm_hook='shm_allreduce': compiling {SOURCE.name} with {cxx} failed "
                        f"(exit {done.returncode}):\n{done.stderr[-2000:]}"
                    )
                os.replace(built, target)  # atomic: concurrent processes agree on one file
            log.info("fdp: compiled the shared-memory all-reduce into %s", target)
        lib = ctypes.CDLL(str(target))
        lib.fdp_shm_install.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int64,
            ctypes.c_int64,
        ]
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.FdpShmSum), platform="cpu")
        _state["lib"] = lib
        return lib


def _capacity() -> int:
    raw = os.environ.get(CAPACITY_ENV, str(DEFAULT_CAPACITY_MB))
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise ValueError(f"{CAPACITY_ENV} must be a positive number of MiB, got {raw!r}.")
    return int(mb * 2**20) // 64 * 64


def _host_id() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{os.uname().nodename}/{boot.read_text().strip() if boot.exists() else ''}"


def _layout(capacity: int, world: int) -> tuple[int, int, int]:
    """(chunk capacity, bytes of one parity, file size) of one process's region."""
    chunk = (-(-capacity // world) + 63) // 64 * 64
    parity = capacity + chunk
    return chunk, parity, _HEADER + 2 * parity


def _install(timeout: float) -> dict[str, Any]:
    """Maps every process's region (a collective: all processes call it once, in step)."""
    from fdp.runtime import Store

    lib = library()
    rank, world = jax.process_index(), jax.process_count()
    capacity = _capacity()
    chunk, _, size = _layout(capacity, world)
    store = Store("fdp-shm", timeout=timeout)
    store.set(f"host/{rank}", _host_id())
    hosts = {q: store.get(f"host/{q}").decode() for q in range(world)}
    others = sorted(q for q, h in hosts.items() if h != hosts[0])
    if others:
        raise ValueError(
            "comm_hook='shm_allreduce' needs every process on one host (shared memory); "
            f"ranks {others} are not on rank 0's host {hosts[0]!r}. Use comm_hook='allreduce'."
        )
    fd, path = tempfile.mkstemp(prefix=f"fdp-shm-{os.getpid()}-", dir="/dev/shm")
    try:
        os.ftruncate(fd, size)  # sparse: pages are taken when a bucket first touches them
        mine = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    store.set(f"path/{rank}", path)
    maps: list[mmap.mmap] = []
    try:
        for q in range(world):
            if q == rank:
                maps.append(mine)
                continue
            peer = store.get(f"path/{q}").decode()
            pfd = os.open(peer, os.O_RDWR)
            try:
                maps.append(mmap.mmap(pfd, size))
            finally:
                os.close(pfd)
        store.set(f"mapped/{rank}", "1")
        store.wait([f"mapped/{q}" for q in range(world)])
    finally:
        os.unlink(path)  # every peer has it mapped (or the set-up failed): no file is left
    bases = (ctypes.c_void_p * world)(
        *[ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
    )
    lib.fdp_shm_install(rank, world, bases, capacity, chunk)
    return {"maps": maps, "capacity": capacity, "world": world, "rank": rank, "reserved": 0}


def _reserve(group: dict[str, Any], nbytes: int) -> None:
    """Takes this process's pages for ``nbytes`` now, so a full ``/dev/shm`` is an error here."""
    if nbytes <= group["reserved"]:
        return
    _, parity, _ = _layout(group["capacity"], group["world"])
    mine = group["maps"][group["rank"]]
    try:
        for p in range(2):
            start = _HEADER + p * parity
            view = np.frombuffer(mine, np.uint8, count=nbytes, offset=start)
            view[:: mmap.PAGESIZE] = 0  # touch each page once (tmpfs allocates on touch)
    except Exception as e:  # pragma: no cover - SIGBUS kills rather than raises
        raise RuntimeError(f"/dev/shm could not hold {nbytes} bytes: {e}") from e
    group["reserved"] = nbytes


def _check_space(nbytes: int, world: int) -> None:
    stat = os.statvfs("/dev/shm")
    free = stat.f_bavail * stat.f_frsize
    need = 2 * (nbytes + -(-nbytes // world)) * world
    if need > free:
        raise ValueError(
            f"comm_hook='shm_allreduce': a {nbytes / 2**20:.1f} MiB bucket needs "
            f"{need / 2**20:.1f} MiB of /dev/shm across {world} processes, and /dev/shm has "
            f"{free / 2**20:.1f} MiB free (in Docker: --shm-size). Use smaller buckets "
            "(bucket_cap_mb) or comm_hook='allreduce'."
        )


def group(nbytes: int, timeout: float) -> dict[str, Any]:
    """This process's group, set up at its first use, with room for ``nbytes``."""
    with_group = _state.get("group")
    if with_group is None:
        with_group = _state["group"] = _install(timeout)
    capacity = with_group["capacity"]
    if nbytes > capacity:
        raise ValueError(
            f"comm_hook='shm_allreduce': a bucket of {nbytes / 2**20:.1f} MiB exceeds the "
            f"shared-memory capacity of {capacity / 2**20:.0f} MiB; set {CAPACITY_ENV} "
            "higher (before the first step) or use a smaller bucket_cap_mb."
        )
    if nbytes > with_group["reserved"]:
        _check_space(nbytes, with_group["world"])
        _reserve(with_group, nbytes)
    return with_group


@contextlib.contextmanager
def ordered() -> Iterator[None]:
    """Chains the shared-memory sums traced inside it, so each waits for the one before.

    Every process must run its sums in the same order; XLA could otherwise run
    two independent ones at once.
    """
    token = _chain.set([None])
    try:
        yield
    finally:
        _chain.reset(token)


def check_usable(axis_name: AxisName) -> None:
    """Raises unless the shared-memory sum can serve ``axis_name`` here."""
    platform = jax.devices()[0].platform
    if platform != "cpu":
        raise ValueError(
            f"comm_hook='shm_allreduce' is for CPU processes; this run's devices are "
            f"{platform!r}. Use comm_hook='allreduce' (XLA's collectives, NCCL on GPU)."
        )
    n, processes = axis_size(axis_name), jax.process_count()
    if n != processes or jax.local_device_count() != 1:
        raise ValueError(
            "comm_hook='shm_allreduce' needs one device per process and a data axis over "
            f"every process; got axis {axis_name!r} of size {n} over {processes} processes "
            f"with {jax.local_device_count()} local devices each. Run one CPU device per "
            "process (fdp launch does) or use comm_hook='allreduce'."
        )


def shm_sum(x: jax.Array, axis_name: AxisName, *, timeout: float = 300.0) -> jax.Array:
    """Sums ``x`` over ``axis_name`` through shared memory (inside ``shard_map``).

    ``x`` must be float32 or float64. One process: ``x`` itself. Each element's
    sum is formed once, in rank order, so every process gets the same bits.

    Args:
      x: this process's array.
      axis_name: the data axis: one device per process, every process on it.
      timeout: seconds to wait for a peer before the step fails naming it.
    """
    check_usable(axis_name)
    if jnp.dtype(x.dtype) not in DTYPES:
        raise TypeError(f"shm_sum sums float32 and float64 arrays, got {x.dtype}.")
    if jax.process_count() == 1:
        return x
    group(x.size * x.dtype.itemsize, timeout)
    chain = _chain.get()
    after = chain[0] if chain is not None and chain[0] is not None else jnp.zeros(1, x.dtype)
    call = jax.ffi.ffi_call(
        TARGET,
        jax.ShapeDtypeStruct((x.size,), x.dtype),
        input_output_aliases={0: 0},
        has_side_effect=True,
    )
    # ``after`` is not read: it orders this call after the previous one.
    out = call(x.reshape(-1), after.astype(x.dtype), timeout_s=np.float64(timeout))
    if chain is not None:
        chain[0] = out[:1]
    return out.reshape(x.shape)
