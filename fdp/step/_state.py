"""``fdp.TrainState``: Flax's ``TrainState`` with a place for comm-hook state."""

from __future__ import annotations

from typing import Any

from flax.training import train_state


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus ``comm_state`` and ``batch_stats``.

    ``comm_state`` holds the comm hook's state (PowerSGD's error feedback and Q
    matrices, iteration counters), one copy per device, stacked along a leading
    device axis sharded over the data axis. It is ``None`` until the first step
    initialises it from the parameters, and it travels with the rest of the
    state through ``jit``, donation and checkpoints.

    ``batch_stats`` holds Flax's mutable ``batch_stats`` collection (BatchNorm
    running statistics) when the model has one; the step then passes it to the
    loss function and keeps it in step across devices (``buffers=``).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)},
      ...                           tx=optax.sgd(0.1))
      >>> state.comm_state is None
      True
    """

    comm_state: Any = None
    batch_stats: Any = None
