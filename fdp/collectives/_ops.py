"""Rooted, gathering, scattering and point-to-point collectives over pytrees.

Each function runs inside ``jax.shard_map`` (or ``jax.pmap``) and names its mesh
axis with ``axis_name``. They are the functional forms of torch.distributed's
collectives: a rooted op returns on every device what that device would hold
afterwards, instead of writing into a buffer in place.

Typed PRNG keys (``jax.random.key``) move as their raw data: XLA's reductions
take no key dtype, and JAX 0.10 cannot lower an ``all_gather`` of keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fdp._extended import from_raw, impl_of, to_raw
from fdp.collectives._all_reduce import ReduceOp, all_reduce, as_reduce_op, check_dtype
from fdp.collectives._axis import AxisName, axis_size, check_rank


def _is_rank(rank: Any, axis_name: AxisName) -> jax.Array:
    return jax.lax.axis_index(axis_name) == rank


def _masked_sum(x: jax.Array, keep: jax.Array, axis_name: AxisName, **kw: Any) -> jax.Array:
    # Adding zeros is exact, so summing the one kept value moves it bit for bit.
    # psum does not take bools; move them as uint8, and typed keys as their raw data.
    impl = impl_of(x)
    x = to_raw(x)
    dtype = x.dtype
    if dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    masked = jnp.where(keep, x, jnp.zeros_like(x))
    out = jax.lax.psum_scatter(masked, axis_name, **kw) if kw else jax.lax.psum(masked, axis_name)
    return from_raw(out.astype(dtype), impl)


def broadcast(x: Any, src: int = 0, *, axis_name: AxisName = "data") -> Any:
    """Every device gets device ``src``'s value of each leaf.

    Args:
      x: a pytree of arrays.
      src: the source rank along ``axis_name``.
      axis_name: the mesh axis.

    Returns:
      ``x`` as held by ``src``, on every device (replicated).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))
      >>> jax.shard_map(lambda x: broadcast(x, 3), mesh=mesh,
      ...               in_specs=P("data"), out_specs=P())(x).tolist()
      [3.0]
    """
    src = check_rank(src, axis_name, "src")
    return jax.tree.map(
        lambda leaf: _masked_sum(jnp.asarray(leaf), _is_rank(src, axis_name), axis_name), x
    )


def all_gather(x: Any, *, axis_name: AxisName = "data", axis: int = 0, tiled: bool = False) -> Any:
    """Every device gets every device's value, stacked (or concatenated) on ``axis``.

    Args:
      x: a pytree of arrays.
      axis_name: the mesh axis.
      axis: where the new device dimension goes in each leaf.
      tiled: concatenate along ``axis`` instead of stacking a new dimension.

    Returns:
      A pytree whose leaves have a leading (or ``axis``) dimension of the axis
      size, in rank order.
    """
    axis_size(axis_name)

    def leaf_fn(leaf: jax.Array) -> jax.Array:
        impl = impl_of(leaf)
        # A key's raw data has one more (trailing) dimension: count a negative axis
        # from the key's own last dimension.
        at = axis + jnp.ndim(leaf) + (0 if tiled else 1) if axis < 0 and impl else axis
        return from_raw(jax.lax.all_gather(to_raw(leaf), axis_name, axis=at, tiled=tiled), impl)

    return jax.tree.map(leaf_fn, x)


def reduce_scatter(
    x: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    axis_name: AxisName = "data",
    scatter_dimension: int = 0,
    tiled: bool = True,
) -> Any:
    """Reduces over ``axis_name`` and leaves each device its own chunk.

    Args:
      x: a pytree of arrays whose ``scatter_dimension`` is divisible by the axis
        size (or, with ``tiled=False``, equal to it).
      op: the reduction (see :class:`ReduceOp`). SUM and AVG use XLA's
        reduce-scatter; the others reduce fully and then slice.
      axis_name: the mesh axis.
      scatter_dimension: the dimension split into per-device chunks.
      tiled: keep the chunk's dimension (True) or drop it (False).

    Returns:
      On device ``i``, chunk ``i`` of the reduction.

    Raises:
      ValueError: the dimension does not split evenly.
    """
    op = as_reduce_op(op)
    n = axis_size(axis_name)

    def leaf_fn(leaf: jax.Array) -> jax.Array:
        leaf = jnp.asarray(leaf)
        check_dtype(op, leaf.dtype)
        dim = leaf.shape[scatter_dimension] if leaf.ndim else None
        if dim is None or (dim % n if tiled else dim != n):
            want = f"divisible by {n}" if tiled else f"equal to {n}"
            raise ValueError(
                f"reduce_scatter needs dimension {scatter_dimension} of each leaf to be "
                f"{want} (the size of axis {axis_name!r}); got shape {leaf.shape}."
            )
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            out = jax.lax.psum_scatter(
                leaf, axis_name, scatter_dimension=scatter_dimension, tiled=tiled
            )
            return out / n if op is ReduceOp.AVG else out
        out = own_chunk(all_reduce(leaf, op, axis_name=axis_name), axis_name, scatter_dimension)
        return out if tiled else jnp.squeeze(out, scatter_dimension)

    return jax.tree.map(leaf_fn, x)


def own_chunk(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    """Chunk ``i`` of ``x`` split evenly along ``dim``, on device ``i`` of ``axis_name``.

    What a tiled reduce-scatter leaves each device, taken from a value every
    device holds whole. Call it inside ``jax.shard_map``.
    """
    size = x.shape[dim] // axis_size(axis_name)
    start = jax.lax.axis_index(axis_name) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=dim)


def all_to_all(
    x: Any, *, axis_name: AxisName = "data", split_axis: int = 0, concat_axis: int = 0
) -> Any:
    """Device ``i`` sends chunk ``j`` of ``split_axis`` to device ``j``.

    Args:
      x: a pytree of arrays whose ``split_axis`` is divisible by the axis size.
      axis_name: the mesh axis.
      split_axis: the dimension cut into one chunk per device.
      concat_axis: the dimension along which received chunks are concatenated,
        in rank order.

    Returns:
      The exchanged pytree.
    """
    n = axis_size(axis_name)

    def leaf_fn(leaf: jax.Array) -> jax.Array:
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[split_axis] % n:
            raise ValueError(
                f"all_to_all needs dimension {split_axis} of each leaf to be divisible by "
                f"{n} (the size of axis {axis_name!r}); got shape {jnp.shape(leaf)}."
            )
        return jax.lax.all_to_all(leaf, axis_name, split_axis, concat_axis, tiled=True)

    return jax.tree.map(leaf_fn, x)


def reduce(
    x: Any, dst: int = 0, op: ReduceOp | str = ReduceOp.SUM, *, axis_name: AxisName = "data"
) -> Any:
    """Device ``dst`` gets the reduction; every other device keeps its input.

    Args:
      x: a pytree of arrays.
      dst: the destination rank.
      op: the reduction.
      axis_name: the mesh axis.

    Returns:
      The reduction on ``dst``, ``x`` unchanged elsewhere (as torch leaves
      non-destination tensors).
    """
    dst = check_rank(dst, axis_name, "dst")
    reduced = all_reduce(x, op, axis_name=axis_name)
    keep = _is_rank(dst, axis_name)
    return jax.tree.map(lambda r, v: jnp.where(keep, r, v), reduced, x)


def gather(x: Any, dst: int = 0, *, axis_name: AxisName = "data") -> Any:
    """Device ``dst`` gets every device's value stacked in rank order.

    Args:
      x: a pytree of arrays.
      dst: the destination rank.
      axis_name: the mesh axis.

    Returns:
      On ``dst``, leaves of shape ``(axis_size, *leaf.shape)``; zeros of that
      shape on every other device (shapes are static in a compiled program).
    """
    dst = check_rank(dst, axis_name, "dst")
    keep = _is_rank(dst, axis_name)
    stacked = all_gather(x, axis_name=axis_name)

    def leaf_fn(s: jax.Array) -> jax.Array:
        raw = to_raw(s)
        return from_raw(jnp.where(keep, raw, jnp.zeros_like(raw)), impl_of(s))

    return jax.tree.map(leaf_fn, stacked)


def scatter(x: Any, src: int = 0, *, axis_name: AxisName = "data") -> Any:
    """Device ``i`` gets slice ``i`` of device ``src``'s value.

    Args:
      x: a pytree of arrays whose leading dimension equals the axis size; only
        ``src``'s values are used.
      src: the source rank.
      axis_name: the mesh axis.

    Returns:
      On device ``i``, ``x_src[i]``.
    """
    src = check_rank(src, axis_name, "src")
    n = axis_size(axis_name)

    def leaf_fn(leaf: jax.Array) -> jax.Array:
        leaf = jnp.asarray(leaf)
        if leaf.ndim == 0 or leaf.shape[0] != n:
            raise ValueError(
                f"scatter needs each leaf's leading dimension to equal {n} (the size of "
                f"axis {axis_name!r}); got shape {leaf.shape}."
            )
        # A reduce-scatter of src's value and everyone else's zeros delivers
        # chunk i of src's value to device i, exactly and in one collective.
        return _masked_sum(
            leaf, _is_rank(src, axis_name), axis_name, scatter_dimension=0, tiled=False
        )

    return jax.tree.map(leaf_fn, x)


def permute(x: Any, perm: Sequence[tuple[int, int]], *, axis_name: AxisName = "data") -> Any:
    """Point-to-point send/recv: for each ``(src, dst)`` pair, ``src`` sends to ``dst``.

    Args:
      x: a pytree of arrays.
      perm: ``(source, destination)`` rank pairs; each rank sends at most once
        and receives at most once.
      axis_name: the mesh axis.

    Returns:
      On each destination, the source's value; zeros on ranks that receive
      nothing.

    Raises:
      ValueError: a rank is out of range or sends or receives twice.
    """
    pairs = []
    for pair in perm:
        if len(pair) != 2:
            raise ValueError(f"perm must hold (src, dst) pairs, got {pair!r}.")
        pairs.append((check_rank(pair[0], axis_name, "src"), check_rank(pair[1], axis_name, "dst")))
    for side, name in ((0, "sends"), (1, "receives")):
        ranks = [p[side] for p in pairs]
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        if dup:
            raise ValueError(f"perm: rank(s) {dup} {name} more than once in {pairs}.")
    return jax.tree.map(lambda leaf: jax.lax.ppermute(leaf, axis_name, pairs), x)


def shift(x: Any, offset: int = 1, *, axis_name: AxisName = "data", wrap: bool = True) -> Any:
    """Every rank ``i`` sends to rank ``i + offset`` (a ring when ``wrap``).

    Args:
      x: a pytree of arrays.
      offset: how far along the axis to send; negative sends backwards.
      axis_name: the mesh axis.
      wrap: wrap around the ends; otherwise ranks with no sender get zeros.

    Returns:
      On rank ``i``, the value of rank ``i - offset``.
    """
    n = axis_size(axis_name)
    pairs = [(i, (i + offset) % n) for i in range(n) if wrap or 0 <= i + offset < n]
    return jax.tree.map(lambda leaf: jax.lax.ppermute(leaf, axis_name, pairs), x)


def barrier(x: Any = None, *, axis_name: AxisName = "data") -> Any:
    """A synchronisation point over ``axis_name``.

    Args:
      x: an optional pytree to tie to the barrier: its returned values are
        only available once every device reached the barrier.
      axis_name: the mesh axis.

    Returns:
      ``x`` (unchanged values), or the axis size as a scalar when ``x`` is None.
    """
    axis_size(axis_name)
    token = jax.lax.psum(jnp.ones((), jnp.int32), axis_name)
    if x is None:
        return token
    return jax.lax.optimization_barrier((x, token))[0]
