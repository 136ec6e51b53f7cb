"""Host-level collectives between processes: barriers and small Python values.

These run on the host, over JAX's coordination service (the gRPC service that
``jax.distributed.initialize`` starts on process 0), not on devices: use them
for control (agree on a value, wait for everyone, find who is missing), and
``fdp.collectives`` or a jitted step for arrays. Every process must call the
same host collectives in the same order, as with ``torch.distributed``; each
call carries its operation, purpose and sequence number, and processes at
different ones get an error naming each process's call, never each other's
values. In a single process each returns at once.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax

from fdp._validate import timeout_ms
from fdp.runtime import _client, _serialize
from fdp.runtime import _heartbeat as heartbeat

DEFAULT_TIMEOUT = 1800.0
"""Seconds a host collective waits by default (torch.distributed's default, 30 min)."""

# Every process numbers its host collectives the same way, so the n-th call
# on each process uses the same keys and barrier ids.
_SEQUENCE = itertools.count()


def _processes(ps: list[int]) -> str:
    return f"process {ps[0]}" if len(ps) == 1 else f"processes {ps}"


class _Call:
    """One host collective: its keys, and the marker that says which one this process is at.

    The marker holds what the call is (its operation and purpose) under the call's
    number. Every call first meets the others at a barrier of its number alone
    (:meth:`arrive`), then compares the markers: processes at different host
    collectives (a rows check here, a settings check there) get an error naming
    both, and no value is read before they agree.
    """

    def __init__(self, op: str, timeout: float, purpose: str | None = None):
        self.op, self.timeout = op, timeout
        self.what = f"{op} for {purpose}" if purpose else op
        self.ms = timeout_ms(timeout)
        self.client: Any = _client.coordination_client()  # None in a single process
        self.number = next(_SEQUENCE)
        self.base = f"fdp/host/{self.number}/{op}"
        # Under the call's number, not its name: a peer at another collective shows here.
        self.at = f"fdp/host/{self.number}/at/"

    def arrive(self) -> None:
        """Records this call, waits for every process's call of this number, and compares.

        Raises:
          RuntimeError: the processes are at different host collectives (naming
            each process's), or the coordination service failed.
          TimeoutError: some processes did not reach this call's number in time.
        """
        mine = f"{self.at}{jax.process_index()}"
        self.client.key_value_set_bytes(mine, self.what.encode())
        self._wait_at(f"fdp/host/{self.number}/arrived")  # this number's, whatever its kind
        # A process's marker is gone only once it found every marker equal to its own.
        where = {p: v.decode(errors="replace") for p, v in self.per_process(self.at).items()}
        if any(what != self.what for what in where.values()):
            raise self.crossed(where)
        self.client.key_value_delete(mine)

    def crossed(self, where: dict[int, str]) -> RuntimeError:
        """The error for processes at different host collectives: which called which."""
        by_what: dict[str, list[int]] = {}
        for p, what in sorted(where.items()):
            by_what.setdefault(what, []).append(p)
        called = ", ".join(f"{_processes(ps)} called {what}" for what, ps in by_what.items())
        return RuntimeError(
            f"fdp.runtime.{self.what}: host collective #{self.number} differs across "
            f"processes: {called} (every process must call the same host collectives in the "
            "same order; no value was exchanged)."
        )

    def per_process(self, prefix: str) -> dict[int, bytes]:
        """The values under ``prefix``, by process; raises on a key no process writes."""
        count, out = jax.process_count(), {}
        for key, value in self.client.key_value_dir_get_bytes(prefix):
            name = key.rsplit("/", 1)[-1]
            if not (name.isdigit() and int(name) < count):
                raise RuntimeError(
                    f"fdp.runtime.{self.op}: found the key {key!r} in the coordination service, "
                    f"where only {prefix}0 to {prefix}{count - 1} (one per process) are "
                    "expected; something other than fdp.runtime writes under 'fdp/host/'."
                )
            out[int(name)] = value
        return out

    def missing(self) -> TimeoutError:
        """The error for a barrier that timed out: who is elsewhere, and who never came."""
        me, count = jax.process_index(), jax.process_count()
        where = {p: v.decode(errors="replace") for p, v in self.per_process(self.at).items()}
        here = sorted(p for p, what in where.items() if what == self.what)
        elsewhere = {p: what for p, what in sorted(where.items()) if what != self.what}
        absent = sorted(set(range(count)) - set(where))
        parts = []
        if elsewhere:
            at = ", ".join(f"process {p} at {what}" for p, what in elsewhere.items())
            parts.append(
                f"{at} instead: host collective #{self.number} differs across processes "
                "(every process must call the same host collectives in the same order)"
            )
        if absent:
            parts.append(f"process(es) {absent} did not arrive within {self.timeout:g} s")
        if not parts:
            return TimeoutError(
                f"fdp.runtime.{self.op}: process {me} arrived after the barrier had "
                f"timed out (timeout={self.timeout:g} s) on another process."
            )
        return TimeoutError(f"fdp.runtime.{self.op}: " + "; ".join(parts) + f" (arrived: {here}).")

    def wait(self, name: str = "barrier") -> None:
        """Waits at this call's barrier ``name``; on a timeout, raises naming who is missing."""
        self._wait_at(f"{self.base}/{name}")

    def _wait_at(self, barrier: str) -> None:
        try:
            with heartbeat.waiting(f"fdp.runtime.{self.what}"):  # for fdp launch's hang detection
                self.client.wait_at_barrier(barrier, self.ms)
        except jax.errors.JaxRuntimeError as e:
            if not _client.is_timeout(e):
                raise _failed(self.op, e) from None
            raise self.missing() from None

    def decode(self, payload: bytes, key: str, peer: int) -> Any:
        try:
            return _serialize.loads(payload)
        except _serialize.SerializationError as e:
            raise _serialize.SerializationError(
                f"fdp.runtime.{self.op}: the value of process {peer} (key {key!r}) is not a "
                f"value fdp.runtime sent: {e}"
            ) from None


def _failed(what: str, error: Exception) -> RuntimeError:
    return RuntimeError(f"fdp.runtime.{what} failed: {_client.first_line(error)}")


def barrier(*, timeout: float = DEFAULT_TIMEOUT, purpose: str | None = None) -> None:
    """Waits until every process has called ``barrier`` (``torch.distributed.barrier``).

    Args:
      timeout: seconds to wait before raising (``inf``: as long as JAX allows, ~24 days).
      purpose: what the call is for, named to a process that calls another host
        collective in its place (as every host collective's ``purpose``).

    Raises:
      TimeoutError: not every process arrived in time; the message names the
        processes that did not.
      RuntimeError: a process called another host collective in its place (the
        message names each process's, with its purpose); the coordination service
        reported a failure (a process died).

    Example:
      >>> from fdp import runtime
      >>> runtime.barrier()  # one process: returns at once
    """
    call = _Call("barrier", timeout, purpose)
    if call.client is None:
        return
    call.arrive()  # every process at this call: the barrier


def monitored_barrier(timeout: float = DEFAULT_TIMEOUT, *, purpose: str | None = None) -> None:
    """A barrier that names the processes that did not arrive in time.

    ``torch.distributed.monitored_barrier``: each process records its arrival
    in the coordination service's key-value store before waiting, so on a
    timeout every waiting process can say who is missing.

    Args:
      timeout: seconds to wait.
      purpose: what the call is for (see :func:`barrier`).

    Raises:
      TimeoutError: some processes did not arrive within ``timeout``; the
        message lists them (``process(es) [1] did not arrive within 5 s``).
      RuntimeError: a process called another host collective in its place,
        named with its purpose; the coordination service reported a failure.

    Example:
      >>> from fdp import runtime
      >>> runtime.monitored_barrier(timeout=60)
    """
    call = _Call("monitored_barrier", timeout, purpose)
    if call.client is None:
        return
    call.arrive()


def broadcast_object(
    obj: Any, src: int = 0, *, timeout: float = DEFAULT_TIMEOUT, purpose: str | None = None
) -> Any:
    """Every process gets process ``src``'s ``obj`` (``broadcast_object_list``).

    ``obj`` is a small plain value (None, bool, int, float, str, bytes, list,
    tuple, dict, numpy arrays and scalars, nested freely): it travels through
    the coordination service MessagePack-encoded, never pickled, so no process
    runs code sent by another.

    Args:
      obj: the value; only ``src``'s matters.
      src: the process whose value everyone gets.
      timeout: seconds to wait for ``src`` and then for everyone to have read it.
      purpose: what the call is for (see :func:`barrier`).

    Returns:
      ``src``'s value, decoded on every process (``src`` included, so that
      every process holds the same types).

    Raises:
      TypeError: ``obj`` holds a type that cannot be sent.
      ValueError: ``src`` is not a process index.
      TimeoutError: ``src``'s value did not arrive within ``timeout``.
      RuntimeError: a process called another host collective in its place,
        named with its purpose (no value was read).

    Example:
      >>> from fdp import runtime
      >>> runtime.broadcast_object({"run": "a1", "lr": 0.1})
      {'run': 'a1', 'lr': 0.1}
    """
    call = _Call("broadcast_object", timeout, purpose)
    count, me = jax.process_count(), jax.process_index()
    if not (isinstance(src, int) and 0 <= src < count):
        raise ValueError(f"src must be a process index in 0..{count - 1}, got src={src!r}.")
    if call.client is None:
        return _serialize.loads(_serialize.dumps(obj))
    key = f"{call.base}/value"
    payload = b""
    if me == src:
        payload = _serialize.dumps(obj)
        call.client.key_value_set_bytes(key, payload)
    try:
        call.arrive()  # src's value is set by now, and read only if every process agrees
    except BaseException:
        if me == src:
            call.client.key_value_delete(key)
        raise
    if me != src:
        try:
            payload = call.client.blocking_key_value_get_bytes(key, call.ms)
        except jax.errors.JaxRuntimeError as e:
            if not _client.is_timeout(e):
                raise _failed("broadcast_object", e) from None
            raise TimeoutError(
                f"fdp.runtime.broadcast_object: process {src}'s value did not arrive "
                f"within {timeout:g} s."
            ) from None
    # Everyone has read the value once everyone is past this barrier.
    call.wait()
    if me == src:
        call.client.key_value_delete(key)
    return call.decode(payload, key, src)


def all_gather_object(
    obj: Any, *, timeout: float = DEFAULT_TIMEOUT, purpose: str | None = None
) -> list[Any]:
    """Every process gets the list of every process's ``obj``, in process order.

    ``torch.distributed.all_gather_object``, without pickle: ``obj`` is a small
    plain value, as for :func:`broadcast_object`.

    Args:
      obj: this process's value.
      timeout: seconds to wait for every process.
      purpose: what the call is for (see :func:`barrier`).

    Returns:
      ``[obj of process 0, obj of process 1, ...]``, decoded.

    Raises:
      TypeError: ``obj`` holds a type that cannot be sent.
      TimeoutError: some processes did not contribute within ``timeout``; the
        message names them.
      RuntimeError: a process called another host collective in its place,
        named with its purpose (no value was read).

    Example:
      >>> from fdp import runtime
      >>> runtime.all_gather_object({"host": "node0", "batches": 12})
      [{'host': 'node0', 'batches': 12}]
    """
    call = _Call("all_gather_object", timeout, purpose)
    payload = _serialize.dumps(obj)
    if call.client is None:
        return [_serialize.loads(payload)]
    prefix = f"{call.base}/in/"
    mine = f"{prefix}{jax.process_index()}"
    call.client.key_value_set_bytes(mine, payload)
    try:
        call.arrive()  # every value is set by now, and read only if every process agrees
    except BaseException:
        call.client.key_value_delete(mine)
        raise
    values = call.per_process(prefix)
    # A second barrier, so that no process deletes its value before all have read it.
    call.wait("read")
    call.client.key_value_delete(mine)
    return [call.decode(values[i], f"{prefix}{i}", i) for i in range(jax.process_count())]
