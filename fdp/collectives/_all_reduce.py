"""All-reduce with every torch.distributed ``ReduceOp``, over pytrees."""

from __future__ import annotations

import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp

from fdp.collectives._axis import AxisName, axis_size, is_varying


class ReduceOp(enum.Enum):
    """Reduction operators, named as in ``torch.distributed.ReduceOp``."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    PREMUL_SUM = "premul_sum"


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_FLOAT_ONLY = (ReduceOp.AVG, ReduceOp.PREMUL_SUM)
_BOOL_OK = (ReduceOp.MIN, ReduceOp.MAX, *_BITWISE)
_LOCAL = {
    ReduceOp.PRODUCT: jnp.prod,
    ReduceOp.BAND: functools.partial(functools.reduce, jnp.bitwise_and),
    ReduceOp.BOR: functools.partial(functools.reduce, jnp.bitwise_or),
    ReduceOp.BXOR: functools.partial(functools.reduce, jnp.bitwise_xor),
}


def as_reduce_op(op: ReduceOp | str) -> ReduceOp:
    """Converts ``op`` (a :class:`ReduceOp` or its name) to a :class:`ReduceOp`.

    Raises:
      ValueError: ``op`` names no reduce op.

    Example:
      >>> as_reduce_op("avg")
      <ReduceOp.AVG: 'avg'>
    """
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    valid = ", ".join(o.name for o in ReduceOp)
    raise ValueError(f"op must be a ReduceOp or one of its names ({valid}), got {op!r}.")


def check_dtype(op: ReduceOp, dtype: Any) -> None:
    """Raises ``TypeError`` when ``op`` is not defined for ``dtype``."""
    dtype = jnp.dtype(dtype)
    is_bool = dtype == jnp.bool_
    if op in _BITWISE and not (is_bool or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(
            f"ReduceOp.{op.name} is a bitwise op and needs integer or bool arrays, got "
            f"{dtype}. Use MIN/MAX/SUM for floating values."
        )
    if op in _FLOAT_ONLY and not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(
            f"ReduceOp.{op.name} needs floating arrays, got {dtype}; cast first or use SUM."
        )
    if is_bool and op not in _BOOL_OK:
        raise TypeError(
            f"ReduceOp.{op.name} is not defined for bool arrays; use MIN (all), MAX (any), "
            "BAND, BOR or BXOR, or cast to an integer dtype."
        )


def converge(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Marks a value that is already equal on every device as replicated.

    The shard_map type system only turns a device-varying value into a
    replicated one through a collective. ``pmax`` over identical values returns
    them unchanged, bit for bit, so it is used where tracking is on.
    """
    if is_varying(x, axis_name):
        return jax.lax.pmax(x, axis_name)
    return x


def _all_reduce_leaf(x: Any, op: ReduceOp, axis_name: AxisName, factor: Any) -> jax.Array:
    x = jnp.asarray(x)
    check_dtype(op, x.dtype)
    if op is ReduceOp.SUM:
        return jax.lax.psum(x, axis_name)
    if op is ReduceOp.AVG:
        return jax.lax.pmean(x, axis_name)
    if op is ReduceOp.PREMUL_SUM:
        return jax.lax.psum(x * jnp.asarray(factor, x.dtype), axis_name)
    if op is ReduceOp.MIN:
        return jax.lax.pmin(x, axis_name)
    if op is ReduceOp.MAX:
        return jax.lax.pmax(x, axis_name)
    # PRODUCT and the bitwise ops have no XLA all-reduce that jax exposes: gather
    # the per-device values and reduce them locally, in rank order.
    stacked = jax.lax.all_gather(x, axis_name)
    if op is ReduceOp.PRODUCT:
        out = jnp.prod(stacked, axis=0).astype(x.dtype)
    else:
        out = _LOCAL[op](list(stacked))
    return converge(out, axis_name)


def all_reduce(
    x: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    axis_name: AxisName = "data",
    factor: Any = None,
) -> Any:
    """Reduces every leaf of ``x`` over ``axis_name``; every device gets the result.

    Args:
      x: a pytree of arrays (the per-device values).
      op: a :class:`ReduceOp` or its name. ``AVG`` and ``PREMUL_SUM`` need
        floating arrays; ``BAND``/``BOR``/``BXOR`` need integer or bool arrays.
      axis_name: the mesh axis to reduce over.
      factor: the scalar each value is multiplied by before summing; required
        for ``PREMUL_SUM`` and rejected otherwise.

    Returns:
      A pytree like ``x`` holding the reduced values.

    Raises:
      ValueError: unknown ``op``, or ``factor`` given or missing wrongly.
      TypeError: ``op`` is not defined for a leaf's dtype.
      NameError: ``axis_name`` is not bound.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))
      >>> f = jax.shard_map(lambda x: all_reduce(x, "max"), mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> f(x).tolist()
      [7.0]
    """
    op = as_reduce_op(op)
    if op is ReduceOp.PREMUL_SUM and factor is None:
        raise ValueError("ReduceOp.PREMUL_SUM needs factor=, the scalar to multiply by.")
    if op is not ReduceOp.PREMUL_SUM and factor is not None:
        raise ValueError(f"factor= is only used with ReduceOp.PREMUL_SUM, not {op.name}.")
    if factor is not None and jnp.ndim(factor) != 0:
        raise ValueError(f"factor must be a scalar, got shape {jnp.shape(factor)}.")
    axis_size(axis_name)
    return jax.tree.map(lambda leaf: _all_reduce_leaf(leaf, op, axis_name, factor), x)
