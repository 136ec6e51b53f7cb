"""What a platform's backend decides: one small frozen value per platform."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from jax.sharding import Mesh


def _xla_mean(mesh: Mesh, data_size: int) -> Any:
    """The generic default: the default mean stays XLA's all-reduce."""
    del mesh, data_size
    return None


def _unbounded(mesh: Mesh) -> int | None:
    """The generic default: steps queue as JAX queues them."""
    del mesh
    return None


class Backend(NamedTuple):
    """The accelerations one platform turns on by default.

    Attributes:
      name: the backend's name (``"cpu"``, ``"generic"``).
      default_mean_hook: ``fn(mesh, data_size) -> CommHook | None``: the hook
        the default mean (``comm_hook=None``) is bound to on this mesh, or None
        to keep :func:`fdp.hooks.allreduce` (XLA's all-reduce). Called by
        ``StepConfig.bind`` only where nothing else asks for XLA's collectives
        (no ZeRO, hierarchy, reduce dtype or model averager).
      fold_dots: what ``fold_dots=None`` means on this platform.
      tune_malloc: what ``fdp.init(tune_malloc=None)`` means on a host of this
        platform.
      steps_in_flight: ``fn(mesh) -> int | None``: how many calls of a step on
        ``mesh`` may wait in JAX's queue before the host waits for the oldest;
        None leaves the queue to JAX.

    Example:
      >>> GENERIC.name, GENERIC.fold_dots, GENERIC.tune_malloc
      ('generic', False, False)
    """

    name: str
    default_mean_hook: Callable[[Mesh, int], Any] = _xla_mean
    fold_dots: bool = False
    tune_malloc: bool = False
    steps_in_flight: Callable[[Mesh], int | None] = _unbounded


GENERIC = Backend("generic")
"""Every platform without a backend of its own (GPUs, TPUs): XLA's collectives, as traced."""
