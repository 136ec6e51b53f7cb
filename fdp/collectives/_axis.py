"""Checks shared by the collectives: the axis is bound, ranks are in range."""

from __future__ import annotations

from typing import Any

import jax

from fdp._compat import varying_axes

# One mesh axis, or several taken together (outer first), as JAX's collectives accept.
AxisName = str | tuple[str, ...]


def _names(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def axis_size(axis_name: AxisName) -> int:
    """Size of a bound mapped axis, with an error that says how to bind it.

    Args:
      axis_name: a mesh axis name bound by an enclosing ``jax.shard_map`` (or a
        ``jax.pmap`` axis name).

    Returns:
      The number of devices along ``axis_name``.

    Raises:
      NameError: ``axis_name`` is not bound here.
    """
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as err:
        raise NameError(
            f"axis_name={axis_name!r} is not a bound mesh axis here. fdp collectives "
            "run inside jax.shard_map (or jax.pmap) over a mesh with that axis; pass "
            "the data axis name of your mesh, e.g. axis_name='data'."
        ) from err


def check_rank(rank: int, axis_name: AxisName, name: str) -> int:
    """Validates a static rank along ``axis_name``.

    Args:
      rank: the rank (index along the axis) to validate.
      axis_name: the mapped axis.
      name: the argument's name, for the message.

    Returns:
      ``rank`` as an ``int``.

    Raises:
      TypeError: ``rank`` is not a Python integer.
      ValueError: ``rank`` is outside ``[0, axis size)``.
    """
    size = axis_size(axis_name)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{name} must be a Python int rank, got {rank!r}.")
    if not 0 <= rank < size:
        raise ValueError(
            f"{name}={rank} is out of range for axis {axis_name!r} of size {size}; "
            f"expected 0 <= {name} < {size}."
        )
    return rank


def sum_over(x: Any, axis_name: AxisName) -> Any:
    """``psum`` over ``axis_name``, or ``x`` itself on an untracked axis of size 1.

    XLA:CPU runs an all-reduce with a single participant as a full reduction
    pass (measured: about 30 ms for 34 MB); the sum over one device is the
    value itself. Where JAX tracks replication (``check_vma=True``) the psum
    stays, since it is what types the result as replicated.
    """
    if axis_size(axis_name) == 1 and is_varying(jax.lax.axis_index(axis_name), axis_name) is None:
        return x
    return jax.lax.psum(x, axis_name)


def mean_over(x: Any, axis_name: AxisName) -> Any:
    """``pmean`` over ``axis_name``; ``x`` itself on an untracked axis of size 1."""
    if axis_size(axis_name) == 1 and is_varying(jax.lax.axis_index(axis_name), axis_name) is None:
        return x
    return jax.lax.pmean(x, axis_name)


def is_varying(x: jax.Array, axis_name: AxisName) -> bool | None:
    """Whether ``x`` varies along ``axis_name``; ``None`` when JAX does not track it.

    ``jax.shard_map(check_vma=True)`` records in each value's type the axes it
    varies over. Under ``check_vma=False`` or ``pmap`` nothing is recorded, which
    we recognise because even ``axis_index`` then carries no axis.
    """
    names = _names(axis_name)
    if not set(names) <= varying_axes(jax.lax.axis_index(axis_name)):
        return None
    return set(names) <= varying_axes(x)


def vary(tree: Any, axis_name: AxisName) -> Any:
    """Types every leaf of ``tree`` device-varying over ``axis_name`` (leaves that are stay).

    Parameters are made per-device before ``jax.grad`` so that the gradient is
    per-device and fdp's bucketed reduction is the only one (the double-reduction
    trap in docs/design.md). Hook state and scan carries that change per device
    are typed varying from the start, so both branches of a ``lax.cond`` and both
    ends of a loop agree on types. Without replication tracking (``check_vma=False``
    or ``pmap``) it returns ``tree`` as it is.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> seen = []
      >>> def f(w):
      ...     seen.append((is_varying(w, "data"), is_varying(vary(w, "data"), "data")))
      ...     return w
      >>> _ = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(jnp.ones(()))
      >>> seen
      [(False, True)]
    """

    def leaf(x: Any) -> Any:
        if is_varying(x, axis_name) is False:
            # Only the axes it does not vary over yet: under hybrid sharding a
            # parameter shard varies over the inner axis already, and pcast
            # refuses an axis the value varies over.
            missing = tuple(a for a in _names(axis_name) if a not in varying_axes(x))
            return jax.lax.pcast(x, missing, to="varying")
        return x

    return jax.tree.map(leaf, tree)
