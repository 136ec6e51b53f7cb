"""Preemption: notice SIGTERM, and stop every process at the same step to save."""

from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils

_received = threading.Event()
_installed: list[bool] = []
# Set once reached_preemption returned True: fdp launch's bootstrap reads it (by
# this module's name) to end a worker that then exits with status 0 at once,
# skipping JAX's and the libraries' teardown, which takes seconds of the grace period.
reached = False


def _on_sigterm(signum: int, frame: object) -> None:
    del signum, frame
    _received.set()


def _install() -> None:
    """Records SIGTERM instead of dying of it (once, from the main thread)."""
    if _installed:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "fdp.reached_preemption must first be called from the main thread (it installs "
            "a SIGTERM handler there); got a call from thread "
            f"{threading.current_thread().name!r}. Call it in the training loop."
        )
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed.append(True)


def reached_preemption(step: int) -> bool:
    """Whether to save and stop now because the run got SIGTERM (a preemption notice).

    Call it at every step boundary, with the step number, on every process.
    With several processes (``jax.distributed``, which ``fdp.init`` starts) it
    is JAX's preemption sync point: when any process gets SIGTERM, all of them
    agree on one step after it and return True there together, so that each
    saves its part of the same checkpoint. Alone, the first call installs a
    SIGTERM handler and it returns True at the first step after the signal.
    ``fdp launch`` forwards a SIGTERM it gets to every worker and waits
    ``--grace-period`` seconds (5 by default) before SIGKILL: save (and wait for
    the save) within that time, then exit; under ``fdp launch`` a worker that
    exits with status 0 after this returned True ends at once, without the
    seconds of JAX's teardown.

    Args:
      step: the step just finished; must increase by one each call, from the
        same value on every process.

    Returns:
      True on every process at the same step, once some process got SIGTERM.

    Example (a training loop under ``fdp launch``)::

        for step in range(start, steps):
            state, metrics = train(state, next_batch())
            if fdp.reached_preemption(step + 1):
                ckpt.save(step + 1, state, data_position=sampler.position(...))
                ckpt.close()  # waits for the (background) save
                sys.exit(0)
    """
    global reached
    if jax.distributed.is_initialized():
        try:
            if multihost_utils.reached_preemption_sync_point(step):
                reached = True
            return reached
        except RuntimeError:  # jax_enable_preemption_service off: SIGTERM is ours
            pass
    _install()
    reached = reached or _received.is_set()
    return reached
