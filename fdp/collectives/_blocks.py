"""Data-axis collectives on each device's block of a value split over other mesh axes.

Inside a step's ``jax.shard_map`` (manual over the data axis), a value split over a
model axis is still one global array to XLA's partitioner there. Gathering or
scattering it over the data axis along another dimension makes the partitioner
first gather it whole over the model axis (measured on jax 0.10.2 and 0.12.0.1: an
all-gather of the whole ``[8, 16]`` kernel over 'model' before a reduce-scatter
over 'data'). Run on each device's block instead, inside a ``shard_map`` manual
over the value's model axes too, the collective moves only the block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P


def spec_axes(spec: P) -> tuple[str, ...]:
    """The mesh axes ``spec`` names, in order.

    Example:
      >>> spec_axes(P(None, ("data", "model"), "x"))
      ('data', 'model', 'x')
    """
    named: list[str] = []
    for part in spec:
        if isinstance(part, str):
            named.append(part)
        elif isinstance(part, tuple):
            named.extend(part)
    return tuple(named)


def on_blocks(
    fn: Callable[[Any], Any], layout: P, axes: Sequence[str] = ()
) -> Callable[[Any], Any]:
    """``fn`` run on each device's block of a value laid out as ``layout``.

    ``layout`` is the value's split over mesh axes other than the data axis
    (``P()``: none, and ``fn`` is returned as it is). Call the result inside a
    ``shard_map`` manual over the data axis, on a value whose data-axis
    collective ``fn`` runs along a dimension ``layout`` leaves whole; it
    returns the value laid out as ``layout`` again. ``axes``: more mesh axes
    to run manual over, the value whole (replicated) on them, so that XLA's
    partitioner handles none of its collectives there (it leaves a bfloat16
    all-reduce that XLA:CPU aborts on, inside a ``shard_map`` manual over the
    data axis alone).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import AxisType, NamedSharding
      >>> mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
      >>> w = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P(None, "model")))
      >>> scatter = on_blocks(lambda x: jax.lax.psum_scatter(x, "data", tiled=True),
      ...                     P(None, "model"))
      >>> f = jax.shard_map(scatter, mesh=mesh, in_specs=P(), out_specs=P("data"),
      ...                   axis_names={"data"})
      >>> jax.jit(f)(w).shape
      (4, 2)
    """
    manual = set(spec_axes(layout)) | set(axes)
    if not manual:
        return fn
    return jax.shard_map(fn, in_specs=layout, out_specs=layout, axis_names=manual)
