"""``fdp.data_parallel``: DataParallel for inference, uneven batches allowed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp.collectives._axis import AxisName
from fdp.data._placement import (
    DATA_AXIS,
    axis_names_of,
    check_axis,
    constrain_to,
    default_mesh,
    unsplit,
)
from fdp.data._rows import leading_size, pad_rows


def data_parallel(
    fn: Callable[..., Any], *, mesh: Mesh | None = None, axis_name: AxisName = DATA_AXIS
) -> Callable[..., Any]:
    """Applies ``fn(params, batch, *rest)`` to a large batch across devices (DataParallel).

    The batch is split along its leading axis over the data axis (padded by
    repeating its last row when it does not split evenly), ``fn`` runs on every
    device's share with the same ``params``, and the outputs are gathered back
    in order with the padding dropped. ``fn`` must work row by row: each output
    leaf has the batch's leading axis.

    Args:
      fn: ``fn(params, local_batch, *rest) -> outputs``; ``rest`` (a
        temperature, a lookup table) is passed whole to every device, as
        ``params`` is. For a step that updates a per-row state (a decode
        cache), use :func:`fdp.ddp`, which returns it.
      mesh: the mesh (default: all devices on one ``'data'`` axis).
      axis_name: its data axis.

    Returns:
      A jitted ``apply(params, batch, *rest) -> outputs``. Like ``jax.jit``,
      building it touches no device: the mesh is made at the first call.

    Example:
      >>> import jax.numpy as jnp
      >>> apply = data_parallel(lambda w, x: x @ w)
      >>> apply(jnp.ones((3, 2)), jnp.ones((13, 3))).shape
      (13, 2)
    """
    if mesh is not None:
        check_axis(mesh, axis_name)
    else:
        axis_names_of(axis_name)  # a name or a tuple of names
    # Built at the first call, like jax.jit: making `apply` (at module level, say)
    # starts no backend, so jax.config.update('jax_num_cpu_devices', ...) still works.
    mapped: dict[int, tuple[Any, int, NamedSharding]] = {}

    def build(rest: int) -> tuple[Any, int, NamedSharding]:
        """The shard_map of ``fn`` with ``rest`` replicated arguments after the batch."""
        if rest not in mapped:
            m = default_mesh(axis_name) if mesh is None else mesh
            fn_mapped = jax.shard_map(
                fn,
                mesh=m,
                in_specs=(P(), P(axis_name), *([P()] * rest)),
                out_specs=P(axis_name),
                axis_names=set(axis_names_of(axis_name)),
            )
            split = NamedSharding(m, P(axis_name))
            mapped[rest] = (fn_mapped, check_axis(m, axis_name), split)
        return mapped[rest]

    @jax.jit
    def apply(params: Any, batch: Any, *rest: Any) -> Any:
        fn_mapped, n, split = build(len(rest))
        size = leading_size(batch) or 0
        # Split over the data axis before shard_map, whose in_specs must match the
        # type of an input on an Explicit axis (jax.make_mesh's default).
        padded = constrain_to(pad_rows(batch, size + (-size % n)), split)
        # Rows cut off an output split on an Explicit axis: gathered whole first.
        return jax.tree.map(
            lambda y: (y if y.shape[0] == size else unsplit(y))[:size],
            fn_mapped(params, padded, *rest),
        )

    return apply
