"""The first code an ``fdp launch`` worker runs, before the user's script.

Run as ``python _bootstrap.py script.py args...`` (or ``-m module args...``).
It uses the standard library only, so that nothing starts threads or JAX before
the script configures them. It

- dies with the agent: on Linux the kernel sends it SIGKILL if the agent
  process ends, so no worker outlives ``fdp launch``, even one killed by SIGKILL;
- writes the Python stack of every thread to ``FDP_STACK_FILE`` when it gets
  :data:`STACK_SIGNAL` (``faulthandler``), which the agent sends every worker
  when it finds a hang, or once a pause has lasted ``--hang-timeout``, to see
  who is stuck where (a host callback);
- pins itself to its share of CPU cores (``FDP_CPU_AFFINITY``) before any
  thread pool sizes itself from the core count;
- line-buffers C's ``stdout`` (:func:`_line_buffer_c_stdout`), so that a
  native library's line (gloo's) reaches the pipe in one write, never cut by
  the script's own lines;
- runs the script as ``python script.py`` would (``__main__``, ``sys.argv``,
  ``sys.path[0]``);
- records in the worker's heartbeat (if the script used fdp) that the script
  returned: the exit after the last step is never a hang;
- ends a worker that exits with status 0 after ``fdp.reached_preemption``
  returned True at once, as its checkpoint is saved and JAX's teardown would
  spend seconds of the agent's grace period;
- on an uncaught exception, prints the traceback, writes it to
  ``FDP_ERROR_FILE`` for the agent's failure summary (torchrun's error file;
  with the process an fdp error names as the one at fault, :data:`BLAMES_ATTR`),
  and exits at once with status 1, skipping ``atexit``: JAX's shutdown barrier
  would otherwise hold a failed worker for minutes, waiting for its peers;
- whenever it exits at once (``os._exit``), first removes process 0's
  coordinator claim, which ``fdp.init`` would remove at exit (``atexit``).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback
from types import TracebackType

_PR_SET_PDEATHSIG = 1
# The attribute by which an fdp error that every process raises names the process at
# fault (FDP_CHECK_FINITE's FloatingPointError: fdp.step.grads._finite.BLAMES_ATTR); the
# agent's summary blames that rank. Spelled out here: this file imports no fdp.
BLAMES_ATTR = "fdp_blames_process"

# A real-time signal, so that no handler of the script's (SIGUSR1...) is taken or run.
STACK_SIGNAL: int | None = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
_C_STDOUT_BUFFER = 8192  # C's BUFSIZ: a longer line goes out in more than one write
_c_stdout_buffer: list[ctypes.Array[ctypes.c_char]] = []  # C's stdout writes into it until exit
_stack_fd: list[int] = []  # kept open for faulthandler, which writes from a signal handler


def _die_with_agent() -> None:
    agent = os.environ.get("FDP_AGENT_PID")
    if not agent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(agent):  # the agent died before prctl took effect
        os._exit(1)


def _dump_stack_on_signal() -> None:
    path = os.environ.get("FDP_STACK_FILE")
    if not path or STACK_SIGNAL is None:
        return
    # A descriptor, not a file object: open for the life of the process, it is closed
    # by the exit itself (a file object would warn ResourceWarning at teardown).
    try:
        # O_APPEND: each dump starts where the agent truncated the file (it may ask twice).
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
    except OSError:
        return
    try:
        faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        os.close(fd)
        return
    _stack_fd.append(fd)


def _pin_cpus() -> None:
    cpus = os.environ.get("FDP_CPU_AFFINITY")
    if cpus and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def _c_stdio() -> tuple[ctypes.CDLL, ctypes.c_void_p] | None:
    """The C library and its ``stdout`` (a ``FILE *``), or None where they cannot be read."""
    try:
        libc = ctypes.CDLL(None)
        return libc, ctypes.c_void_p.in_dll(libc, "stdout")
    except (OSError, ValueError, AttributeError):
        return None


def _line_buffer_c_stdout() -> None:
    """Makes C's ``stdout`` line-buffered (``setvbuf(stdout, buf, _IOLBF, 8192)``).

    The agent sets ``PYTHONUNBUFFERED``, with which Python makes C's ``stdout``
    unbuffered too: a C++ ``std::cout << a << b << std::endl`` is then one
    ``write`` per piece (gloo's connection line is eight), and a line the script
    prints from Python lands between them on the pipe, glued to gloo's text. Line
    buffered, a C line is one ``write``, as on a terminal. Nothing has been
    written through C's ``stdout`` yet, so its buffer is empty.
    """
    found = _c_stdio()
    if found is not None:
        # glibc keeps an unbuffered stream's one-byte buffer when given none: give one.
        _c_stdout_buffer.append(ctypes.create_string_buffer(_C_STDOUT_BUFFER))
        with contextlib.suppress(OSError, AttributeError):
            found[0].setvbuf(found[1], _c_stdout_buffer[-1], 1, _C_STDOUT_BUFFER)  # _IOLBF


def _flush_c_stdio() -> None:
    """Writes what C's streams hold (a line not yet ended); ``os._exit`` would drop it."""
    found = _c_stdio()
    if found is not None:
        with contextlib.suppress(OSError, AttributeError):
            found[0].fflush(None)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    # Drop the frames of this file and of runpy, as `python script.py` shows none.
    own = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in own and os.path.abspath(name) not in own:
            break
        tb = tb.tb_next
    return tb


def _report(exc: BaseException, exit_code: int, *, echo: bool = True) -> None:
    text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
    if echo:
        sys.stderr.write(text)
    path = os.environ.get("FDP_ERROR_FILE")
    if path:
        record = {
            "rank": os.environ.get("RANK"),
            "pid": os.getpid(),
            "exit_code": exit_code,
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": text,
            "timestamp": time.time(),
        }
        blames = getattr(exc, BLAMES_ATTR, None)
        if isinstance(blames, int):
            record["blames"] = blames
        try:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except OSError as e:
            sys.stderr.write(f"fdp launch: could not write the error file {path}: {e}\n")


def _release_claim() -> None:
    """Removes process 0's coordinator claim (if the script ran ``fdp.init``).

    ``fdp.init`` removes it at exit (``atexit``), which ``os._exit`` skips.
    """
    module = sys.modules.get("fdp.runtime._claim")
    release = getattr(module, "release", None)
    if release is not None:
        with contextlib.suppress(Exception):
            release()


def _exit_now(code: int) -> None:
    _release_claim()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    _flush_c_stdio()
    os._exit(code)


def _preempted() -> bool:
    """Whether the script stopped for a preemption (``fdp.reached_preemption`` said so).

    Its checkpoint is written by then; the teardown of JAX and the libraries at
    exit takes seconds (more with ``jax.distributed``) of the agent's grace period.
    """
    module = sys.modules.get("fdp.runtime._preemption")
    return bool(getattr(module, "reached", False))


def _exiting() -> None:
    """Tells the agent (through the heartbeat, if the script used fdp) that the script returned.

    What follows, the teardown of JAX and the libraries, is the exit after the
    last step, which the agent never takes for a hang.
    """
    module = sys.modules.get("fdp.runtime._heartbeat")
    mark = getattr(module, "exiting", None)
    if mark is not None:
        with contextlib.suppress(Exception):
            mark()


def main(argv: list[str]) -> None:
    """Runs ``argv`` (``script args...`` or ``-m module args...``) as the worker."""
    _die_with_agent()
    _dump_stack_on_signal()
    _pin_cpus()
    _line_buffer_c_stdout()
    module = argv[1] if argv[:1] == ["-m"] else None
    target, args = (module, argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    # What `python -m module` and `python script.py` put first on the path.
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(target))
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        _exiting()
    except SystemExit as e:
        if e.code is None or e.code == 0:
            _exiting()
            if _preempted():
                _exit_now(0)
            raise
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            sys.stderr.write(f"{e.code}\n")
        _report(e, code, echo=False)  # like python: no traceback for sys.exit
        _exit_now(code)
    except BaseException as e:
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
        _report(e, code)
        _exit_now(code)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1:] == ["-m"]:
        sys.exit("usage: _bootstrap.py script.py [args...] | -m module [args...]")
    main(sys.argv[1:])
