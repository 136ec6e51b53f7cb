"""A dropout key passed to every step unchanged: found at the second call, warned once.

DDP's ranks each draw from a random stream that advances by itself; a JAX step gets
its key as an argument, and a port that creates the key once and passes it every step
draws the same dropout masks at every step, silently (fdp folds in the device index,
so devices differ, but steps do not). The step compares the key of its second call
with its first's (the same object, or the same key data: one small transfer, once)
and warns when they are equal.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from fdp.step.grads._keys import is_key


class KeyReuse:
    """Watches a step's first two keys; :meth:`seen` warns once when they are equal."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._first: Any = None
        self._done = False

    @property
    def settled(self) -> bool:
        """Whether no later call needs :meth:`seen`: both keys compared, or none given yet.

        A call without a key has another signature than one with a key, so it never
        takes the program of one that had a key: it goes through :meth:`seen` again.
        """
        return self._done or self._first is None

    def seen(self, key: Any) -> None:
        """Records ``key`` (the first call's) or compares it with the first (the second's)."""
        if self._done or key is None:
            return
        if self._first is None:
            self._first = key
            return
        first, self._first, self._done = self._first, None, True
        if key is first or _same_data(first, key):
            warnings.warn(
                f"{self._kind}: the key passed to this call equals the previous call's, so "
                "every step draws the same random numbers (the same dropout masks). Pass a "
                "new key each step, e.g. jax.random.fold_in(key, step) (fdp folds in each "
                "device's index, not the step's).",
                UserWarning,
                stacklevel=4,
            )


def _same_data(a: Any, b: Any) -> bool:
    """Whether two keys (typed or raw) hold the same data; False when unreadable."""
    try:
        raw = [jax.random.key_data(k) if is_key(k) else k for k in (a, b)]
        x, y = (np.asarray(jax.device_get(r)) for r in raw)
    except Exception:  # a key not readable here (another process's shards): not judged
        return False
    return x.shape == y.shape and bool(np.array_equal(x, y))
