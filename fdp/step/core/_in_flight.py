"""A bound on how many calls of a step wait in JAX's queue (jax 0.10's XLA:CPU needs one)."""

from __future__ import annotations

import collections
from typing import Any

import jax


class InFlight:
    """Holds one small output of each of the last ``limit`` calls; waits for the oldest.

    JAX returns from a call as soon as the step is queued. Past ``limit`` calls
    the host waits for the oldest one to finish before going on, so no more than
    ``limit`` steps are ever queued. Only the smallest array of what each call
    is given to hold is held (a loss, not the parameters). The caller gives
    outputs that no later call is given to donate (the metrics, not the state):
    a donated array is deleted, and there is nothing to wait for on it.

    Args:
      limit: how many calls may be queued.

    Example:
      >>> import jax.numpy as jnp
      >>> queue = InFlight(2)
      >>> for i in range(5):
      ...     queue.add({"loss": jnp.float32(i), "params": jnp.ones(3)})
      >>> [float(x) for x in queue.held]
      [3.0, 4.0]
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be a positive number of calls, got {limit!r}")
        self.limit = limit
        self.held: collections.deque[jax.Array] = collections.deque()

    def add(self, out: Any) -> None:
        """Holds the smallest array of ``out``; waits for the oldest held past the limit."""
        arrays = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
        if arrays:
            self.hold(min(arrays, key=lambda x: x.size))

    def hold(self, array: jax.Array) -> None:
        """Holds ``array`` (one output of a call); waits for the oldest held past the limit."""
        self.held.append(array)
        while len(self.held) > self.limit:
            oldest = self.held.popleft()
            if not oldest.is_deleted():
                oldest.block_until_ready()
