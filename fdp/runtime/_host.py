"""Host-level collectives between processes: barriers and small Python values.

These run on the host, over JAX's coordination service (the gRPC service that
``jax.distributed.initialize`` starts on process 0), not on devices: use them
for control (agree on a value, wait for everyone, find who is missing), and
``fdp.collectives`` or a jitted step for arrays. Every process must call the
same host collectives in the same order, as with ``torch.distributed``. In a
single process each returns at once.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax

from fdp.runtime import _client, _serialize

DEFAULT_TIMEOUT = 1800.0
"""Seconds a host collective waits by default (torch.distributed's default, 30 min)."""

# Every process numbers its host collectives the same way, so the n-th call
# on each process uses the same keys and barrier ids.
_SEQUENCE = itertools.count()


def _begin(op: str) -> tuple[Any, str]:
    client = _client.coordination_client()
    return client, f"fdp/host/{next(_SEQUENCE)}/{op}"


def _ms(timeout: float) -> int:
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got timeout={timeout!r}.")
    return max(1, round(timeout * 1000))


def _failed(what: str, error: Exception) -> RuntimeError:
    return RuntimeError(f"fdp.runtime.{what} failed: {_client.first_line(error)}")


def _wait_naming_missing(client: Any, base: str, timeout: float, what: str) -> None:
    """Waits until every process has written a key under ``base/in/``, or names who has not."""
    try:
        client.wait_at_barrier(f"{base}/barrier", _ms(timeout))
        return
    except jax.errors.JaxRuntimeError as e:
        if not _client.is_timeout(e):
            raise _failed(what, e) from None
    arrived = sorted(
        int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get_bytes(f"{base}/in/")
    )
    missing = sorted(set(range(jax.process_count())) - set(arrived))
    if not missing:
        raise TimeoutError(
            f"fdp.runtime.{what}: process {jax.process_index()} arrived after the barrier had "
            f"timed out (timeout={timeout:g} s) on another process."
        )
    raise TimeoutError(
        f"fdp.runtime.{what}: process(es) {missing} did not arrive within {timeout:g} s "
        f"(arrived: {arrived})."
    )


def barrier(*, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Waits until every process has called ``barrier`` (``torch.distributed.barrier``).

    Args:
      timeout: seconds to wait before raising.

    Raises:
      TimeoutError: not every process arrived in time. Use
        :func:`monitored_barrier` to learn which did not.
      RuntimeError: the coordination service reported a failure (a process died).

    Example:
      >>> from fdp import runtime
      >>> runtime.barrier()  # one process: returns at once
    """
    client, base = _begin("barrier")
    if client is None:
        _ms(timeout)
        return
    try:
        client.wait_at_barrier(base, _ms(timeout))
    except jax.errors.JaxRuntimeError as e:
        if _client.is_timeout(e):
            raise TimeoutError(
                f"fdp.runtime.barrier: not every process arrived within {timeout:g} s; "
                "fdp.runtime.monitored_barrier names the processes that did not."
            ) from None
        raise _failed("barrier", e) from None


def monitored_barrier(timeout: float = DEFAULT_TIMEOUT) -> None:
    """A barrier that names the processes that did not arrive in time.

    ``torch.distributed.monitored_barrier``: each process records its arrival
    in the coordination service's key-value store before waiting, so on a
    timeout every waiting process can say who is missing.

    Args:
      timeout: seconds to wait.

    Raises:
      TimeoutError: some processes did not arrive within ``timeout``; the
        message lists them (``process(es) [1] did not arrive within 5 s``).
      RuntimeError: the coordination service reported a failure.

    Example:
      >>> from fdp import runtime
      >>> runtime.monitored_barrier(timeout=60)
    """
    client, base = _begin("monitored_barrier")
    if client is None:
        _ms(timeout)
        return
    mine = f"{base}/in/{jax.process_index()}"
    client.key_value_set_bytes(mine, b"")
    _wait_naming_missing(client, base, timeout, "monitored_barrier")
    client.key_value_delete(mine)


def broadcast_object(obj: Any, src: int = 0, *, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Every process gets process ``src``'s ``obj`` (``broadcast_object_list``).

    ``obj`` is a small plain value (None, bool, int, float, str, bytes, list,
    tuple, dict, numpy arrays and scalars, nested freely): it travels through
    the coordination service MessagePack-encoded, never pickled, so no process
    runs code sent by another.

    Args:
      obj: the value; only ``src``'s matters.
      src: the process whose value everyone gets.
      timeout: seconds to wait for ``src`` and then for everyone to have read it.

    Returns:
      ``src``'s value, decoded on every process (``src`` included, so that
      every process holds the same types).

    Raises:
      TypeError: ``obj`` holds a type that cannot be sent.
      ValueError: ``src`` is not a process index.
      TimeoutError: ``src``'s value did not arrive within ``timeout``.

    Example:
      >>> from fdp import runtime
      >>> runtime.broadcast_object({"run": "a1", "lr": 0.1})
      {'run': 'a1', 'lr': 0.1}
    """
    client, base = _begin("broadcast_object")
    count = jax.process_count()
    if not (isinstance(src, int) and 0 <= src < count):
        raise ValueError(f"src must be a process index in 0..{count - 1}, got src={src!r}.")
    if client is None:
        return _serialize.loads(_serialize.dumps(obj))
    key = f"{base}/value"
    if jax.process_index() == src:
        payload = _serialize.dumps(obj)
        client.key_value_set_bytes(key, payload)
    else:
        try:
            payload = client.blocking_key_value_get_bytes(key, _ms(timeout))
        except jax.errors.JaxRuntimeError as e:
            if _client.is_timeout(e):
                raise TimeoutError(
                    f"fdp.runtime.broadcast_object: process {src}'s value did not arrive "
                    f"within {timeout:g} s."
                ) from None
            raise _failed("broadcast_object", e) from None
    # Everyone has read the value once everyone is past this barrier.
    client.key_value_set_bytes(f"{base}/in/{jax.process_index()}", b"")
    _wait_naming_missing(client, base, timeout, "broadcast_object")
    client.key_value_delete(f"{base}/in/{jax.process_index()}")
    if jax.process_index() == src:
        client.key_value_delete(key)
    return _serialize.loads(payload)


def all_gather_object(obj: Any, *, timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Every process gets the list of every process's ``obj``, in process order.

    ``torch.distributed.all_gather_object``, without pickle: ``obj`` is a small
    plain value, as for :func:`broadcast_object`.

    Args:
      obj: this process's value.
      timeout: seconds to wait for every process.

    Returns:
      ``[obj of process 0, obj of process 1, ...]``, decoded.

    Raises:
      TypeError: ``obj`` holds a type that cannot be sent.
      TimeoutError: some processes did not contribute within ``timeout``; the
        message names them.

    Example:
      >>> from fdp import runtime
      >>> runtime.all_gather_object({"host": "node0", "batches": 12})
      [{'host': 'node0', 'batches': 12}]
    """
    client, base = _begin("all_gather_object")
    payload = _serialize.dumps(obj)
    if client is None:
        return [_serialize.loads(payload)]
    mine = f"{base}/in/{jax.process_index()}"
    client.key_value_set_bytes(mine, payload)
    _wait_naming_missing(client, base, timeout, "all_gather_object")
    items = client.key_value_dir_get_bytes(f"{base}/in/")
    values = {int(k.rsplit("/", 1)[1]): v for k, v in items}
    # A second barrier, so that no process deletes its value before all have read it.
    done = f"{base}/read"
    try:
        client.wait_at_barrier(done, _ms(timeout))
    except jax.errors.JaxRuntimeError as e:
        raise _failed("all_gather_object", e) from None
    client.key_value_delete(mine)
    return [_serialize.loads(values[i]) for i in range(jax.process_count())]
