"""The global norm of the reduced gradient, as ``optax.clip_by_global_norm`` sees it.

A step made with ``reduction=fdp.Reduction(grad_norm=True)`` reports it in
``metrics['grad_norm']``: the L2 norm over all leaves of
the averaged gradient the update receives (``optax.global_norm`` of the
single-device full-batch gradient). Where the gradients are whole on every
device (DDP, ZeRO stage 1 with a hook that all-reduces) it is a local reduction;
where each device holds its share of a leaf (ZeRO stages 2 and 3, and stage 1
with the default hook) the shares' squares are summed over the data axis: one
all-reduce of a scalar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fdp.collectives import sum_over
from fdp.collectives._axis import AxisName


def _squares(leaves: Sequence[Any]) -> jax.Array:
    """The sum of squares of every floating leaf, in float32 (or wider)."""
    total = jnp.zeros((), jnp.float32)
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
            total = total + jnp.sum(jnp.real(x * jnp.conj(x))).astype(jnp.float32)
    return total


def global_norm(
    grads: Any, shard_dims: Sequence[int | None] | None, axis_name: AxisName
) -> jax.Array:
    """Inside the step's ``shard_map``: the global L2 norm of the reduced gradients.

    Args:
      grads: the reduced gradients on this device (a pytree).
      shard_dims: per leaf, the dimension it is split along over the data axis
        (None: whole on every device); None when no leaf is split.
      axis_name: the data axis.

    Returns:
      A float32 scalar, the same on every device.
    """
    leaves = jax.tree.leaves(grads)
    dims = shard_dims if shard_dims is not None else (None,) * len(leaves)
    whole = _squares([x for x, d in zip(leaves, dims, strict=True) if d is None])
    shares = [x for x, d in zip(leaves, dims, strict=True) if d is not None]
    if shares:  # one all-reduce of a scalar: each device holds a share of these leaves
        whole = whole + sum_over(_squares(shares), axis_name)
    return jnp.sqrt(whole)
