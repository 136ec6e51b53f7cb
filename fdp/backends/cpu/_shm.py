"""A shared-memory sum across the CPU processes of one host, inside the compiled step.

XLA:CPU's all-reduce goes through gloo over TCP, with separate input and output
buffers, even when every process sits on the same machine. Here each process
maps its peers' shared-memory regions once (``/dev/shm``), and an XLA FFI call
(``_native/shm_sum.cc``, compiled with the host's C++ compiler at first use and
cached) sums a bucket in place: its gradients as they are (no packing into one
flat buffer), each scaled on the way (DDP's division by the world size): copy in,
sum this process's chunk, copy the other chunks out. The step stays one compiled
program; nothing here runs on GPU.

Part of fdp's CPU backend (:mod:`fdp.backends.cpu`): used by the ``shm_allreduce``
and ``shm_where_possible`` comm hooks (docs/performance.md). Every process must run
its sums of one program in the same order, and XLA could otherwise run two
independent ones at once: each sum takes an array computed before it (``after=``:
the bucket loop passes the previous bucket's reduced gradients) as an unread operand.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp._process import pid_alive
from fdp.collectives._axis import AxisName, axis_size

log = logging.getLogger(__name__)

TARGET = "fdp_shm_sum"
SOURCE = Path(__file__).with_name("_native") / "shm_sum.cc"
CAPACITY_ENV = "FDP_SHM_CAPACITY_MB"
# "0" (or false/off/no) in any process: the default hook keeps XLA's all-reduce everywhere.
ENABLE_ENV = "FDP_SHM_ALLREDUCE"
DEFAULT_CAPACITY_MB = 1024
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
SHM_DIR = "/dev/shm"
PREFIX = "fdp-shm-"  # then the owner's pid, a dash and mkstemp's letters
_HEADER = 64
_RECORD_BYTES = 64 * 1024  # a peer's set-up record is ~200 bytes of JSON
# No FMA contraction: x * scale + y must round as XLA's multiply-then-add does.
CXXFLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")

_lock = threading.Lock()
# This process's shared-memory group (set up once, at the first sum), or why not: the
# mapped regions of its peers, which live as long as the process.
_state: dict[str, Any] = {}


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
    """The compiled FFI library (built once per source, flags and JAX version; cached)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        include = jax.ffi.include_dir()
        key = hashlib.sha256(SOURCE.read_bytes() + include.encode() + jax.__version__.encode())
        key.update(" ".join(CXXFLAGS).encode())
        target = _cache_dir() / f"shm_sum-{key.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            cxx = _compiler()
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                cmd = [cxx, *CXXFLAGS, "-I", include]
                cmd += [str(SOURCE), "-o", str(built)]
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                except OSError as e:
                    raise RuntimeError(
                        f"comm_hook='shm_allreduce' could not run the C++ compiler {cxx!r} "
                        f"({e.strerror}); install g++ (or clang++) or set CXX."
                    ) from e
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
    capacity = int(mb * 2**20) // 64 * 64 if mb > 0 else 0
    if capacity <= 0:
        raise ValueError(f"{CAPACITY_ENV} must be a positive number of MiB, got {raw!r}.")
    return capacity


def _host_id() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{os.uname().nodename}/{boot.read_text().strip() if boot.exists() else ''}"


def _share(nbytes: int, world: int) -> int:
    """Bytes of one process's share of an ``nbytes`` buffer, rounded up to 64."""
    return (-(-nbytes // world) + 63) // 64 * 64


def _layout(capacity: int, world: int) -> tuple[int, int, int]:
    """(chunk capacity, bytes of one parity, file size) of one process's region."""
    chunk = _share(capacity, world)
    parity = capacity + chunk
    return chunk, parity, _HEADER + 2 * parity


def _switched_off() -> str:
    """Why this process's environment turns the default shared-memory sum off, or ''.

    Raises:
      ValueError: ``FDP_SHM_ALLREDUCE`` is neither on nor off.
    """
    raw = os.environ.get(ENABLE_ENV, "")
    value = raw.strip().lower()
    if value in ("", "1", "true", "on", "yes"):
        return ""
    if value in ("0", "false", "off", "no"):
        return f"{ENABLE_ENV}={raw}"
    raise ValueError(f"{ENABLE_ENV} must be 1 or 0 (true/false, on/off), got {raw!r}.")


def _install(timeout: float, *, want: int = 0, optional: bool = False) -> dict[str, Any] | None:
    """Maps every process's region (a collective: all processes call it once, in step).

    With ``optional`` (the default hook), every process first says what would stop it
    (``FDP_SHM_ALLREDUCE=0``, no compiler, no ``/dev/shm`` or no room in it for
    ``want`` bytes of buckets, another host, a peer's file it cannot open); if any
    process names anything, every process gets None and keeps XLA's all-reduce. Each
    process publishes its answer before it reads its peers', so none waits for one
    that stopped. Without ``optional`` those are errors, as
    ``comm_hook='shm_allreduce'`` asks for this path.
    """
    from fdp.runtime._store import Store

    rank, world = jax.process_index(), jax.process_count()
    capacity = _capacity()
    chunk, _, size = _layout(capacity, world)
    obstacle = _switched_off() if optional else ""
    lib = None
    if not obstacle:
        try:
            lib = library()
        except (RuntimeError, OSError) as e:
            if not optional:
                raise
            obstacle = str(e).splitlines()[0]
    if optional and not obstacle and want > capacity:
        obstacle = f"a bucket of {want / 2**20:.1f} MiB is over {CAPACITY_ENV}"
    mine: dict[str, Any] = {"capacity": capacity, "world": world, "rank": rank, "reserved": 0}
    store = Store("fdp-shm", timeout=timeout)
    if not obstacle:
        try:
            _open_region(mine, size)
            if optional:
                _reserve(mine, want)
        except (OSError, ValueError) as e:
            _close_region(mine)
            if not optional:
                raise
            obstacle = str(e).splitlines()[0]
    peers: list[mmap.mmap] = []  # the peers' regions mapped so far
    try:
        store.set(f"host/{rank}", json.dumps([capacity, _host_id(), obstacle, mine.get("path")]))
        seen = {q: _record(store.get(f"host/{q}"), q) for q in range(world)}
        sizes = {q: c for q, (c, _, _, _) in seen.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"{CAPACITY_ENV} must be the same in every process; got (rank: bytes) {sizes}."
            )
        others = sorted(q for q, (_, h, _, _) in seen.items() if h != seen[0][1])
        if others and not optional:
            raise ValueError(
                "comm_hook='shm_allreduce' needs every process on one host (shared memory); "
                f"ranks {others} are not on rank 0's host {seen[0][1]!r}. "
                "Use comm_hook='allreduce'."
            )
        obstacles = {q: o for q, (_, _, o, _) in seen.items() if o}
        obstacles.update({q: "not on rank 0's host" for q in others})
        if obstacles:
            _close_region(mine)
            return _decline(obstacles)
        for q in range(world):
            if q == rank:
                continue
            peer = seen[q][3]
            try:
                pfd = os.open(peer, os.O_RDWR)
                try:
                    peers.append(mmap.mmap(pfd, size))
                finally:
                    os.close(pfd)
            except OSError as e:
                if not optional:
                    raise ValueError(
                        f"comm_hook='shm_allreduce': rank {q}'s {peer} is not usable here "
                        f"({e.strerror}): the processes do not share /dev/shm (separate "
                        "containers?). Use comm_hook='allreduce'."
                    ) from e
                obstacle = f"rank {q}'s {peer} cannot be mapped here ({e.strerror})"
                break
        store.set(f"mapped/{rank}", obstacle or "ok")
        said = {q: store.get(f"mapped/{q}").decode() for q in range(world)}
    except BaseException:
        for m in peers:
            m.close()
        _close_region(mine)
        raise
    finally:
        _unlink(mine)  # every peer has it mapped (or the set-up ended): no file is left
    obstacles = {q: o for q, o in said.items() if o != "ok"}
    if obstacles:
        for m in peers:
            m.close()
        _close_region(mine)
        return _decline(obstacles)
    assert lib is not None
    maps = [*peers[:rank], mine["own"], *peers[rank:]]  # in rank order
    bases = (ctypes.c_void_p * world)(
        *[ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
    )
    lib.fdp_shm_install(rank, world, bases, capacity, chunk)
    if optional:
        log.info(
            "fdp: gradients are summed through shared memory by the %d processes of this "
            "host (%s=0 keeps XLA's all-reduce)",
            world,
            ENABLE_ENV,
        )
    return {**mine, "maps": maps}


def _record(raw: bytes, rank: int) -> list[Any]:
    """Rank ``rank``'s set-up record: ``[capacity, host id, obstacle, path]``."""
    try:
        if len(raw) > _RECORD_BYTES:
            raise ValueError(f"{len(raw)} bytes")
        record = json.loads(raw.decode())
        if not (isinstance(record, list) and len(record) == 4):
            raise ValueError(repr(record)[:80])
    except ValueError as e:  # JSON and Unicode errors are ValueErrors
        raise ValueError(
            f"fdp's shared-memory set-up: rank {rank}'s record in the store is not one "
            f"fdp wrote ({e}); does something else write under 'fdp/store/fdp-shm/'?"
        ) from None
    return record


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Removes the regions that processes killed during a set-up left behind.

    A region is unlinked as soon as every peer has mapped it, or when the set-up
    fails; only a process killed while it waits for its peers (``SIGKILL``, a
    signal with no handler) leaves its file, 24 KiB to 48 MiB of memory. A file is
    stale when the pid in its name is not alive and nobody holds the lock its
    owner takes for as long as it lives (so a process of another pid namespace,
    sharing ``/dev/shm``, keeps its file). Best effort: errors are ignored.

    Returns:
      The paths removed.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = name[len(PREFIX) :].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its owner lives
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    if removed:
        log.info(
            "fdp: removed %d shared-memory file(s) of dead processes: %s", len(removed), removed
        )
    return removed


def _open_region(mine: dict[str, Any], size: int) -> None:
    """Creates and maps this process's region (sparse) into ``mine``."""
    remove_stale()
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=SHM_DIR)
    mine["fd"], mine["path"] = fd, path
    fcntl.flock(fd, fcntl.LOCK_SH)  # held while this process lives: see remove_stale
    os.ftruncate(fd, size)  # sparse: pages are taken by _reserve, bucket by bucket
    mine["own"] = mmap.mmap(fd, size)


def _unlink(mine: dict[str, Any]) -> None:
    path = mine.pop("path", None)
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _close_region(mine: dict[str, Any]) -> None:
    """Undoes :func:`_open_region` as far as it got (the pages go with the last map)."""
    _unlink(mine)
    own = mine.pop("own", None)
    if own is not None:
        own.close()
    fd = mine.pop("fd", None)
    if fd is not None:
        os.close(fd)


def _decline(obstacles: dict[int, str]) -> None:
    """Logs why the default hook keeps XLA's all-reduce (the same on every process)."""
    why = "; ".join(f"rank {q}: {o}" for q, o in sorted(obstacles.items()))
    hosts = all(o == "not on rank 0's host" for o in obstacles.values())
    switched = all(o.startswith(ENABLE_ENV) for o in obstacles.values())
    level = logging.INFO if hosts or switched else logging.WARNING
    log.log(level, "fdp: gradients go through XLA's all-reduce, not shared memory (%s)", why)
    return None


def _reserve(group: dict[str, Any], nbytes: int) -> None:
    """Allocates this process's pages for buckets of ``nbytes`` (both slots, both parities).

    ``posix_fallocate`` writes nothing (a step still running keeps its data) and
    turns a full ``/dev/shm`` into an error here rather than a SIGBUS later.
    """
    if nbytes <= group["reserved"]:
        return
    world = group["world"]
    _, parity, _ = _layout(group["capacity"], world)
    share = _share(nbytes, world)
    try:
        for p in range(2):
            start = _HEADER + p * parity
            os.posix_fallocate(group["fd"], start, nbytes)
            os.posix_fallocate(group["fd"], start + group["capacity"], share)
    except OSError as e:
        raise ValueError(
            f"fdp's shared-memory all-reduce: /dev/shm could not hold this process's slots "
            f"for a {nbytes / 2**20:.1f} MiB bucket ({e.strerror}); in Docker raise "
            f"--shm-size, or use a smaller bucket_cap_mb, comm_hook='allreduce', or "
            f"{ENABLE_ENV}=0."
        ) from e
    group["reserved"] = nbytes


def group(nbytes: int, timeout: float) -> dict[str, Any]:
    """This process's group, set up at its first use, with room for ``nbytes``."""
    mine = _state.get("group")
    if mine is None:
        if "declined" in _state:
            raise RuntimeError(
                "comm_hook='shm_allreduce': an earlier step of this process kept XLA's "
                "all-reduce for the default hook (the log says why), and the processes "
                "set up shared memory once. Choose the hook in every step, or none."
            )
        mine = _install(timeout)
        assert mine is not None  # not optional: every obstacle was an error
        _state["group"] = mine
    capacity = mine["capacity"]
    if nbytes > capacity:
        raise ValueError(
            f"fdp's shared-memory all-reduce: a bucket of {nbytes / 2**20:.1f} MiB exceeds "
            f"the shared-memory capacity of {capacity / 2**20:.0f} MiB; set {CAPACITY_ENV} "
            f"higher (before the first step), use a smaller bucket_cap_mb, or {ENABLE_ENV}=0."
        )
    _reserve(mine, nbytes)
    return mine


def usable(axis_name: AxisName, timeout: float, nbytes: int = 0, *, largest: int = 0) -> bool:
    """Whether the default hook sums a bucket of ``nbytes`` through shared memory.

    Every process gets the same answer. The first call (at the first step's trace,
    on every process) is a collective that sets up the group, or finds what stops
    it on some process (then every later call says no). It reserves room for
    ``largest``, the bytes of the program's largest bucket
    (``GradBucket.largest_nbytes``), so a small ``/dev/shm`` (Docker's 64 MiB)
    keeps XLA's all-reduce rather than failing later. A later program's larger
    bucket is again agreed on (:func:`_grow`).
    """
    mine = _state.get("group")
    if mine is None:
        if "declined" in _state or jax.process_count() == 1:
            return False
        check_usable(axis_name)
        mine = _install(timeout, want=max(largest, nbytes), optional=True)
        if mine is None:
            _state["declined"] = True
            return False
        _state["group"] = mine
    if nbytes <= mine["reserved"]:
        return True
    return _grow(mine, nbytes, timeout)


def _grow(mine: dict[str, Any], nbytes: int, timeout: float) -> bool:
    """Reserves room for a larger bucket if every process can (a collective).

    Processes trace the same buckets in the same order, so the n-th growth of every
    process is the same bucket. A size some process could not hold is not asked
    for again: that bucket, and larger ones, go through XLA's all-reduce.
    """
    from fdp.runtime._store import Store

    if nbytes >= mine.get("refused", float("inf")):
        return False
    obstacle = ""
    if nbytes > mine["capacity"]:
        obstacle = f"a bucket of {nbytes:,} bytes is over {CAPACITY_ENV}"
    else:
        try:
            _reserve(mine, nbytes)
        except ValueError as e:
            obstacle = str(e).splitlines()[0]
    grown = mine["grown"] = mine.get("grown", 0) + 1
    store = Store("fdp-shm", timeout=timeout)
    store.set(f"grow/{grown}/{mine['rank']}", obstacle or "ok")
    said = {q: store.get(f"grow/{grown}/{q}").decode() for q in range(mine["world"])}
    obstacles = {q: o for q, o in said.items() if o != "ok"}
    if not obstacles:
        return True
    mine["refused"] = nbytes
    why = "; ".join(f"rank {q}: {o}" for q, o in sorted(obstacles.items()))
    log.warning(
        "fdp: buckets of %s bytes and more go through XLA's all-reduce, not shared memory (%s)",
        f"{nbytes:,}",
        why,
    )
    return False


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


def shm_sum(
    x: jax.Array, axis_name: AxisName, *, after: Any = None, timeout: float = 300.0
) -> jax.Array:
    """Sums ``x`` over ``axis_name`` through shared memory (inside ``shard_map``).

    ``x`` must be float32 or float64. One process: ``x`` itself. Each element's
    sum is formed once, in rank order, so every process gets the same bits.

    Args:
      x: this process's array.
      axis_name: the data axis: one device per process, every process on it.
      after: arrays (a pytree) the sum must wait for: the previous sum's result
        when one program sums several times (see :func:`shm_sum_bucket`).
      timeout: seconds to wait for a peer before the step fails naming it.
    """
    return shm_sum_bucket([x], axis_name, after=after, timeout=timeout)[0]


def _order_token(after: Any, dtype: np.dtype) -> jax.Array:
    """One element of ``after`` (zeros without one), cast to ``dtype``: an unread operand."""
    leaf = next((a for a in jax.tree.leaves(after) if getattr(a, "size", 0)), None)
    if leaf is None:
        return jnp.zeros(1, dtype)
    return jnp.ravel(leaf)[:1].astype(dtype)


def shm_sum_bucket(
    xs: Sequence[jax.Array],
    axis_name: AxisName,
    *,
    scale: float = 1.0,
    after: Any = None,
    timeout: float = 300.0,
) -> list[jax.Array]:
    """Sums ``x * scale`` for each array of one bucket over ``axis_name``, in one call.

    The arrays are read as one flat buffer, in order, but passed as they are: no
    copy packs them, and each result is written in place of its array. ``scale``
    rounds as XLA rounds ``x / world`` (a multiplication by the reciprocal, in the
    arrays' dtype), so ``scale=1 / world`` gives the bits of ``psum(x / world)``
    when the sum's order is the same (two processes).

    Every process must run the sums of one program in the same order, and XLA
    may run two independent calls at once: a program that sums several times
    passes each call the result of the one before (``after``), which the call
    takes as an operand it does not read. The bucket loop passes the previous
    bucket's reduced gradients (``GradBucket.after``).

    Args:
      xs: this process's arrays, all float32 or all float64.
      axis_name: the data axis: one device per process, every process on it.
      scale: the factor of every element before the sum (rounded to the dtype).
      after: arrays (a pytree) the call must wait for, or None.
      timeout: seconds to wait for a peer before the step fails naming it.

    Returns:
      The sums, one per array, with its shape.
    """
    check_usable(axis_name)
    dtypes = {jnp.dtype(x.dtype) for x in xs}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        got = ", ".join(sorted(str(d) for d in dtypes)) or "no arrays"
        raise TypeError(f"shm_sum: the arrays must be all float32 or all float64, got {got}.")
    dtype = next(iter(dtypes))
    factor = np.asarray(scale, dtype)
    if jax.process_count() == 1:
        return [x * factor if scale != 1 else x for x in xs]
    live = [i for i, x in enumerate(xs) if x.size]
    out = list(xs)  # the empty arrays stay as they are; the others are replaced below
    if not live:
        return out
    group(sum(xs[i].size for i in live) * dtype.itemsize, timeout)
    call = jax.ffi.ffi_call(
        TARGET,
        [jax.ShapeDtypeStruct(xs[i].shape, dtype) for i in live],
        input_output_aliases={k + 1: k for k in range(len(live))},
        has_side_effect=True,
    )
    # The first operand is not read: it orders this call after ``after``.
    summed = call(
        _order_token(after, dtype),
        *[xs[i] for i in live],
        scale=np.float64(factor),
        timeout_s=np.float64(timeout),
    )
    for i, total in zip(live, summed, strict=True):
        out[i] = total
    return out
