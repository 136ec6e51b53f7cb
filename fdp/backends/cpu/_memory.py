"""How a training process's host allocator keeps memory between steps (glibc ``mallopt``).

XLA:CPU allocates each execution's temporary buffers and outputs afresh. glibc serves
blocks above its mmap threshold with ``mmap`` and returns them with ``munmap`` (and
trims the top of its heap), so every step of a multi-process CPU run maps its whole
working set again and takes one page fault per 4 KiB page when it first touches it:
for the 34 MB MLP of ``benchmarks/multiprocess.py`` about 15,000 faults per step,
most of them in gloo's all-reduce, which writes into a freshly allocated output.
PyTorch's CPU caching keeps its buffers, and faults about half as often.

:func:`tune_malloc` asks glibc to keep freed memory for reuse instead: no ``mmap``
for large blocks (``M_MMAP_MAX=0``), no trimming below 1 GiB of free heap top
(``M_TRIM_THRESHOLD``), and one arena (``M_ARENA_MAX=1``) so that the threads of
XLA's pool and gloo reuse the same freed blocks. The cost is resident memory: the
process keeps its peak working set mapped. ``fdp.init`` calls it (:func:`prepare_malloc`,
through :func:`fdp.backends.prepare_host`), in one process as in several, on hosts
whose JAX runs on CPUs (:func:`fdp.backends.gpu_host` is False), unless
``FDP_MALLOC_TUNING=0`` (or ``init(tune_malloc=False)``) says otherwise; on a GPU
host, where XLA keeps its buffers in GPU memory and the tuning was never measured,
only when asked (``FDP_MALLOC_TUNING=1`` or ``init(tune_malloc=True)``). One CPU
process faults as much (the 4-layer transformer of ``benchmarks/multiprocess.py``:
about 38,000 faults and 58 ms of system time per step), and its compute pays for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Mapping

from fdp.observe._debug import logger

# glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

ENV_VAR = "FDP_MALLOC_TUNING"
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")

# What tune_malloc last did (for tests and fdp's logging data).
applied: dict[str, int] = {}


def wanted(argument: bool | None, environ: Mapping[str, str]) -> bool | None:
    """Whether to tune: the argument if given, else ``FDP_MALLOC_TUNING``.

    Returns:
      ``True`` (asked for), ``False`` (never), or ``None`` (nothing said:
      ``fdp.init`` tunes).

    Raises:
      ValueError: ``FDP_MALLOC_TUNING`` is neither a yes nor a no.
    """
    if argument is not None:
        return bool(argument)
    value = environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{ENV_VAR}={environ[ENV_VAR]!r} is not understood: expected 1 (keep freed host "
        "memory for reuse, the default) or 0 (leave glibc's allocator as it is)."
    )


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def release_free_memory() -> bool:
    """Gives freed host memory back to the system now (glibc ``malloc_trim(0)``).

    With :func:`tune_malloc` glibc keeps freed blocks for reuse; after a one-off peak
    (``fdp.tune`` timing a dozen candidate steps on copies of the state) that would
    keep the peak resident for the rest of the run. Does nothing off glibc.

    Returns:
      Whether glibc released any memory.
    """
    libc = _glibc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return bool(trim(0))


def tune_malloc(*, trim_threshold: int = 1 << 30, mmap_max: int = 0, arena_max: int = 1) -> bool:
    """Makes glibc keep freed host memory for the next step, instead of unmapping it.

    A no-op (with a debug log) where the C library is not glibc (macOS, musl) or has no
    ``mallopt``.

    Args:
      trim_threshold: bytes of free memory at the top of the heap kept before glibc
        gives it back (``M_TRIM_THRESHOLD``).
      mmap_max: how many blocks glibc may serve with their own ``mmap``
        (``M_MMAP_MAX``); 0 serves every block from the heap, where freed blocks are
        reused.
      arena_max: how many malloc arenas threads share (``M_ARENA_MAX``); one arena
        lets every thread reuse every freed block.

    Returns:
      Whether glibc accepted every setting.
    """
    libc_name, _ = platform.libc_ver()
    if platform.system() != "Linux" or libc_name != "glibc":
        logger.debug(
            "fdp: host malloc tuning skipped: the C library is %r on %s, not glibc",
            libc_name or "unknown",
            platform.system(),
        )
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError) as e:
        logger.debug("fdp: host malloc tuning skipped: glibc's mallopt unavailable (%s)", e)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = {
        "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)),
        "M_MMAP_MAX": (M_MMAP_MAX, mmap_max),
        "M_ARENA_MAX": (M_ARENA_MAX, arena_max),
    }
    ok = True
    for name, (param, value) in settings.items():
        if mallopt(param, value) == 1:
            applied[name] = value
        else:
            ok = False
            logger.debug("fdp: mallopt(%s, %d) was refused", name, value)
    logger.debug("fdp: host malloc tuned (pid %d): %s", os.getpid(), applied)
    return ok


def prepare_malloc(argument: bool | None, environ: Mapping[str, str], *, measured: bool) -> None:
    """``fdp.init``'s malloc tuning: on if asked, else on where it was ``measured``.

    Args:
      argument: ``fdp.init(tune_malloc=...)``.
      environ: the process's environment (``FDP_MALLOC_TUNING``).
      measured: whether the host's backend was measured with it (CPU hosts).
    """
    want = wanted(argument, environ)
    if want or (want is None and measured):
        tune_malloc()
    elif want is None:
        logger.debug("fdp: host malloc left as it is on a GPU host (FDP_MALLOC_TUNING=1 tunes)")
