"""A key-value store shared by every process: ``torch.distributed.Store`` for fdp.

With several processes the store lives in JAX's coordination service, on
process 0, and needs no port or server of its own. In a single process it is a
dictionary with the same behaviour, so code that uses it runs unchanged.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote

import jax

from fdp._validate import check_number, timeout_ms
from fdp.runtime import _client
from fdp.runtime import _heartbeat as heartbeat

DEFAULT_STORE_TIMEOUT = 300.0
"""Seconds a store operation waits by default (torch's store default)."""


class _Coordination:
    """The primitives, on JAX's coordination service."""

    def __init__(self, client: Any):
        self.client = client

    def set(self, key: str, value: bytes, *, overwrite: bool) -> bool:
        try:
            self.client.key_value_set_bytes(key, value, allow_overwrite=overwrite)
            return True
        except jax.errors.JaxRuntimeError as e:
            if _client.is_already_exists(e):
                return False
            raise

    def try_get(self, key: str) -> bytes | None:
        try:
            return self.client.key_value_try_get_bytes(key)
        except jax.errors.JaxRuntimeError as e:
            if _client.is_not_found(e):
                return None
            raise

    def get(self, key: str, timeout: float) -> bytes | None:
        try:
            return self.client.blocking_key_value_get_bytes(key, timeout_ms(timeout))
        except jax.errors.JaxRuntimeError as e:
            if _client.is_timeout(e):
                return None
            raise

    def delete(self, key: str) -> None:
        self.client.key_value_delete(key)

    def increment(self, key: str, amount: int) -> int:
        return self.client.key_value_increment(key, amount)

    def keys(self, prefix: str) -> list[str]:
        return [k for k, _ in self.client.key_value_dir_get_bytes(prefix)]


class _Local:
    """The same primitives in one process, for runs without ``jax.distributed``."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def set(self, key: str, value: bytes, *, overwrite: bool) -> bool:
        with self.changed:
            if key in self.data and not overwrite:
                return False
            self.data[key] = value
            self.changed.notify_all()
            return True

    def try_get(self, key: str) -> bytes | None:
        with self.changed:
            return self.data.get(key)

    def get(self, key: str, timeout: float) -> bytes | None:
        with self.changed:
            self.changed.wait_for(lambda: key in self.data, min(timeout, threading.TIMEOUT_MAX))
            return self.data.get(key)

    def delete(self, key: str) -> None:
        with self.changed:
            self.data.pop(key, None)

    def increment(self, key: str, amount: int) -> int:
        with self.changed:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            self.changed.notify_all()
            return value

    def keys(self, prefix: str) -> list[str]:
        with self.changed:
            return [k for k in self.data if k.startswith(prefix)]


_LOCAL = _Local()


def _as_bytes(name: str, value: str | bytes) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    raise TypeError(f"{name} must be str or bytes, got {type(value).__name__}.")


class Store:
    """A key-value store shared by every process of the run.

    The methods follow ``torch.distributed.Store``: values are bytes (``str``
    is accepted and stored UTF-8 encoded); ``get`` and ``wait`` block until the
    keys exist; ``add`` keeps a decimal counter; ``compare_set`` is atomic.
    Stores with different ``name`` s do not share keys. Updates
    (``set``, ``add``, ``compare_set``, ``delete``) take a per-key lock in the
    store, so a process that dies while holding one blocks that key's updates
    until their timeout, and the error then names the holder.

    Args:
      name: the store's namespace.
      timeout: default seconds for blocking operations (``inf``: as long as
        JAX's coordination service allows, ~24 days).

    Raises:
      ValueError: ``timeout`` is not a positive number (NaN, 0 and -1 are not).

    Example:
      >>> from fdp import runtime
      >>> store = runtime.Store("example")
      >>> store.set("epoch", "3")
      >>> store.get("epoch"), store.add("seen", 5), store.add("seen", 1)
      (b'3', 5, 6)
      >>> store.compare_set("leader", "", "process-0")
      b'process-0'
      >>> store.delete("epoch"), store.check(["epoch"])
      (True, False)
    """

    def __init__(self, name: str = "default", *, timeout: float = DEFAULT_STORE_TIMEOUT):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got name={name!r}.")
        self.timeout = check_number(timeout, "timeout", allow_inf=True)
        self._space = quote(name, safe="")
        client = _client.coordination_client()
        self._backend: _Coordination | _Local = _LOCAL if client is None else _Coordination(client)

    def _key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got key={key!r}.")
        # Quoting keeps keys flat: the service treats '/' as a directory separator.
        return f"fdp/store/{self._space}/{quote(key, safe='')}"

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        return check_number(timeout, "timeout", allow_inf=True)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        lock = f"fdp/store-lock/{self._space}/{quote(key, safe='')}"
        me = f"process {jax.process_index()} (pid {os.getpid()})".encode()
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while not self._backend.set(lock, me, overwrite=False):
            if time.monotonic() > deadline:
                # The holder's record is written by fdp; anything else is shown, not trusted.
                raw = self._backend.try_get(lock)
                holder = "?" if raw is None else raw.decode(errors="replace")
                raise TimeoutError(
                    f"Store: key {key!r} stayed locked by {holder!r} (lock key {lock!r}) for "
                    f"{self.timeout:g} s; did that process die during an update?"
                )
            time.sleep(pause)
            pause = min(0.05, pause * 2)
        try:
            yield
        finally:
            self._backend.delete(lock)

    def set(self, key: str, value: str | bytes) -> None:
        """Sets ``key`` to ``value``, replacing any value it had."""
        full, data = self._key(key), _as_bytes("value", value)
        with self._locked(key):
            self._backend.set(full, data, overwrite=True)

    def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set.

        Raises:
          TimeoutError: ``key`` was not set in time.
        """
        timeout = self._timeout(timeout)
        with heartbeat.waiting(f"store key {key!r}"):  # for fdp launch's hang detection
            value = self._backend.get(self._key(key), timeout)
        if value is None:
            raise TimeoutError(f"Store.get: key {key!r} was not set within {timeout:g} s.")
        return value

    def add(self, key: str, amount: int = 1) -> int:
        """Adds ``amount`` to the counter ``key`` (created at 0) and returns the new value.

        Raises:
          ValueError: ``key`` holds a value that is not a decimal integer.
        """
        if not isinstance(amount, int):
            raise TypeError(f"amount must be an int, got amount={amount!r}.")
        full = self._key(key)
        with self._locked(key):
            try:
                return self._backend.increment(full, amount)
            except (ValueError, jax.errors.JaxRuntimeError) as e:
                if not isinstance(e, ValueError) and "FAILED_PRECONDITION" not in str(e):
                    raise
                raise ValueError(
                    f"Store.add: key {key!r} does not hold a decimal integer "
                    f"({_client.first_line(e)})."
                ) from None

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Sets ``key`` to ``desired`` if it holds ``expected``, atomically.

        As in torch: a missing key counts as holding ``b''``.

        Returns:
          The value of ``key`` after the operation (``desired`` if it was
          set; the current value otherwise, or ``expected`` if the key is missing).
        """
        full = self._key(key)
        want, new = _as_bytes("expected", expected), _as_bytes("desired", desired)
        with self._locked(key):
            current = self._backend.try_get(full)
            if current == want or (current is None and want == b""):
                self._backend.set(full, new, overwrite=True)
                return new
            return want if current is None else current

    def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Waits until every key in ``keys`` is set.

        Raises:
          TimeoutError: some keys were not set in time; the message lists them.
        """
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        missing = []
        for key in _key_list(keys):
            left = deadline - time.monotonic()
            with heartbeat.waiting(f"store key {key!r}"):
                if left <= 0 or self._backend.get(self._key(key), left) is None:
                    missing.append(key)
        if missing:
            raise TimeoutError(f"Store.wait: keys {missing} were not set within {timeout:g} s.")

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set, without waiting."""
        return all(self._backend.try_get(self._key(k)) is not None for k in _key_list(keys))

    def delete(self, key: str) -> bool:
        """Deletes ``key``; returns whether it existed."""
        full = self._key(key)
        with self._locked(key):
            existed = self._backend.try_get(full) is not None
            self._backend.delete(full)
            return existed

    def num_keys(self) -> int:
        """The number of keys set in this store."""
        return len(self._backend.keys(f"fdp/store/{self._space}/"))


def _key_list(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str):
        raise TypeError(f"keys must be a list of keys, got the string {keys!r}; use [{keys!r}].")
    return list(keys)
