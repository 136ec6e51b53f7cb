"""The one place fdp touches JAX internals: the coordination-service client.

``jax.distributed.initialize`` starts a coordination service (on process 0) and
connects a client to it from every process. That client carries a key-value
store and named barriers with timeouts, which is exactly what host-level
collectives need; JAX and Orbax use it for the same purpose
(``jax.experimental.multihost_utils.live_devices``,
``orbax.checkpoint.multihost.get_jax_distributed_client``). But JAX exposes
only ``initialize``, ``is_initialized`` and ``shutdown`` publicly, so the client
is reached through ``jax._src``. This module isolates that access in a single
function that checks what it finds, so a JAX release that moves the client fails
here with a clear message instead of deep inside a barrier.
"""

from __future__ import annotations

from typing import Any

import jax

# The client methods fdp calls (names and signatures read from jaxlib 0.10.2).
_METHODS = (
    "key_value_set_bytes",
    "key_value_try_get_bytes",
    "blocking_key_value_get_bytes",
    "key_value_dir_get_bytes",
    "key_value_delete",
    "key_value_increment",
    "wait_at_barrier",
)


def coordination_client() -> Any | None:
    """The coordination-service client of this process, or ``None`` before ``fdp.init``.

    Returns:
      The ``jaxlib`` ``DistributedRuntimeClient``, or ``None`` when
      ``jax.distributed`` is not initialised (a single process).

    Raises:
      RuntimeError: ``jax.distributed`` is initialised but the client is not
        where, or not what, this version of fdp expects (a newer JAX).
    """
    if not jax.distributed.is_initialized():
        return None
    # No public API exists for the client (see the module docstring).
    from jax._src import distributed

    client = getattr(getattr(distributed, "global_state", None), "client", None)
    missing = [m for m in _METHODS if not hasattr(client, m)]
    if client is None or missing:
        raise RuntimeError(
            "fdp's host collectives and key-value store use JAX's coordination-service "
            f"client, which jax {jax.__version__} does not provide as fdp expects "
            f"(missing: {missing or 'the client itself'}). Please report this with your "
            "jax and jaxlib versions."
        )
    return client


def is_timeout(error: BaseException) -> bool:
    """Whether a coordination-service error is a deadline that passed."""
    return "DEADLINE_EXCEEDED" in str(error)


def is_not_found(error: BaseException) -> bool:
    """Whether a coordination-service error says that a key does not exist."""
    return "NOT_FOUND" in str(error)


def is_already_exists(error: BaseException) -> bool:
    """Whether a coordination-service error says that a key exists already."""
    return "ALREADY_EXISTS" in str(error)


def first_line(error: BaseException) -> str:
    """The first line of a coordination-service error (the rest is gRPC detail)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
