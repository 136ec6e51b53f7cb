"""Bucket assignment: which gradients travel together, in which order.

This reproduces PyTorch DDP's ``_compute_bucket_assignment_by_size`` exactly
(see docs/bucketing.md): gradients are walked in ready order (the reverse of the
parameter order), each dtype fills its own open bucket, a bucket closes as soon as
its byte size reaches the current limit, the first bucket of every dtype has the
smaller ``first_bucket_cap``, and the buckets are finally ordered by the
earliest-ready gradient each contains.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

MiB = 1024 * 1024
_LARGEST_CAP_MB = 2.0**40  # 1 EiB: larger caps all mean "no limit"
WHOLE = P()  # the layout of a leaf whole on every non-data axis


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket: gradients of one dtype reduced as a single flat buffer.

    Attributes:
      index: position in reduce order; bucket 0 is reduced first.
      dtype: dtype of every gradient in the bucket.
      leaf_indices: indices into ``jax.tree.leaves(tree)``, in the order the
        gradients sit in the flat buffer (ready order).
      shapes: shape of each gradient.
      offsets: element offset of each gradient in the flat buffer.
      sizes: element count of each gradient.
      key_paths: ``jax.tree_util.keystr`` of each gradient's key path.
      layout: how every gradient in the bucket is split over the mesh's
        non-data axes (a ``PartitionSpec``; ``P()``: whole there). A bucket
        never mixes layouts, as DDP's never mixes devices; one split over a
        model axis is reduced leaf by leaf where it lies, never packed (packing
        would gather it over that axis).
    """

    index: int
    dtype: np.dtype
    leaf_indices: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    key_paths: tuple[str, ...]
    layout: P = dataclasses.field(default=WHOLE, kw_only=True)

    @property
    def size(self) -> int:
        """Number of elements in the flat buffer."""
        return sum(self.sizes)

    @property
    def nbytes(self) -> int:
        """Bytes in the flat buffer."""
        return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """A static, hashable bucket assignment for one pytree structure.

    Build it with :func:`plan_buckets`. Being hashable, a plan can be a static
    argument of ``jax.jit``.

    Attributes:
      buckets: the buckets, in reduce order.
      treedef: structure of the tree the plan was built for.
      leaf_shapes: shape of every leaf of that tree.
      leaf_dtypes: dtype of every leaf of that tree.
      leaf_key_paths: key path string of every leaf.
      excluded: indices of leaves that have no gradient (integer, boolean or
        float0 leaves, or leaves named in ``exclude``) and are in no bucket.
      bucket_cap_bytes: the cap of every bucket after a dtype's first.
      first_bucket_cap_bytes: the cap of each dtype's first bucket.
      leaf_layouts: every leaf's split over the mesh's non-data axes (empty:
        whole there, every leaf).
    """

    buckets: tuple[Bucket, ...]
    treedef: Any
    leaf_shapes: tuple[tuple[int, ...], ...]
    leaf_dtypes: tuple[np.dtype, ...]
    leaf_key_paths: tuple[str, ...]
    excluded: tuple[int, ...]
    bucket_cap_bytes: int
    first_bucket_cap_bytes: int
    leaf_layouts: tuple[P, ...] = dataclasses.field(default=(), kw_only=True)

    @property
    def excluded_key_paths(self) -> tuple[str, ...]:
        """Key paths of the leaves left out of every bucket."""
        return tuple(self.leaf_key_paths[i] for i in self.excluded)

    @property
    def nbytes(self) -> int:
        """Total bytes over all buckets."""
        return sum(b.nbytes for b in self.buckets)

    def leaf_structs(self) -> list[jax.ShapeDtypeStruct]:
        """Every leaf of the planned tree as a ``jax.ShapeDtypeStruct``, in leaf order."""
        return [
            jax.ShapeDtypeStruct(s, d)
            for s, d in zip(self.leaf_shapes, self.leaf_dtypes, strict=True)
        ]

    def as_lists(self) -> list[list[int]]:
        """Leaf indices of every bucket, in reduce order."""
        return [list(b.leaf_indices) for b in self.buckets]


def _cap_bytes(value_mb: float, name: str) -> int:
    # NumPy scalars (np.float32(25), a value read from a config array) are numbers too.
    if isinstance(value_mb, bool) or not isinstance(value_mb, numbers.Real):
        raise TypeError(f"{name} must be a number of MiB, got {value_mb!r}.")
    mb = float(value_mb)
    if not math.isfinite(mb) or mb <= 0:
        raise ValueError(f"{name} must be a positive number of MiB, got {value_mb!r}.")
    # DDP converts with int(mb * 1024 * 1024); a cap under one byte still means one, and a
    # cap past any model means one bucket per dtype (1e308 MiB overflowed the conversion).
    return max(1, int(min(mb, _LARGEST_CAP_MB) * MiB))


def cap_limits(bucket_cap_mb: float, first_bucket_cap_mb: float) -> tuple[int, ...]:
    """The byte limits DDP walks through: ``(first, cap)``, or ``(cap,)``.

    Raises:
      TypeError: a cap is not a number.
      ValueError: a cap is not a positive finite number.

    Example:
      >>> cap_limits(25.0, 1.0)
      (1048576, 26214400)
      >>> cap_limits(1.0, 4.0)
      (1048576,)
    """
    cap = _cap_bytes(bucket_cap_mb, "bucket_cap_mb")
    first = _cap_bytes(first_bucket_cap_mb, "first_bucket_cap_mb")
    return (first, cap) if first < cap else (cap,)


def has_gradient(dtype: Any) -> bool:
    """Whether leaves of ``dtype`` get a gradient (floating or complex)."""
    dtype = np.dtype(dtype)
    # jnp.issubdtype knows the ml_dtypes floats (bfloat16, float8_*); numpy does not.
    return dtype != jax.dtypes.float0 and bool(jnp.issubdtype(dtype, jnp.inexact))


def _leaf_meta(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    shape = tuple(int(d) for d in np.shape(leaf))
    dtype = getattr(leaf, "dtype", None)
    dtype = np.dtype(dtype) if dtype is not None else np.asarray(leaf).dtype
    return shape, dtype


def assign_buckets(
    sizes_bytes: Sequence[int],
    dtypes: Sequence[Any],
    limits: Sequence[int],
    order: Sequence[int],
) -> list[list[int]]:
    """DDP's bucket assignment over abstract gradients.

    Args:
      sizes_bytes: byte size of each gradient, by index.
      dtypes: dtype (any hashable key) of each gradient, by index.
      limits: size limits; a dtype's n-th bucket uses ``limits[min(n, -1)]``.
      order: gradient indices in ready order (only these are assigned).

    Returns:
      Buckets as lists of gradient indices (in ready order within a bucket),
      ordered by each bucket's earliest-ready gradient.

    Example:
      >>> assign_buckets([8, 8, 8], ["f32"] * 3, [10], order=[2, 1, 0])
      [[2, 1], [0]]
    """
    if not limits:
        raise ValueError("limits must hold at least one size limit.")
    open_buckets: dict[Any, list[int]] = {}
    open_bytes: dict[Any, int] = {}
    limit_pos: dict[Any, int] = {}
    closed: list[list[int]] = []
    for i in order:
        key = dtypes[i]
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + sizes_bytes[i]
        pos = limit_pos.get(key, 0)
        if open_bytes[key] >= limits[min(pos, len(limits) - 1)]:
            closed.append(open_buckets.pop(key))
            open_bytes[key] = 0
            limit_pos[key] = pos + 1
    closed.extend(b for b in open_buckets.values() if b)
    ready_pos = {i: p for p, i in enumerate(order)}
    closed.sort(key=lambda bucket: min(ready_pos[i] for i in bucket))
    return closed


def plan_buckets(
    tree: Any,
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    order: Sequence[int] | None = None,
    exclude: Sequence[int] = (),
    layouts: Sequence[P] = (),
) -> BucketPlan:
    """Plans DDP's gradient buckets for a pytree of arrays.

    Args:
      tree: a pytree of arrays or ``jax.ShapeDtypeStruct`` (parameters or
        gradients); only shapes and dtypes are read.
      bucket_cap_mb: cap of every bucket after a dtype's first, in MiB.
      first_bucket_cap_mb: cap of each dtype's first bucket, in MiB. If not
        smaller than ``bucket_cap_mb``, only ``bucket_cap_mb`` is used.
      order: leaf indices in gradient-ready order. Defaults to the reverse of
        ``jax.tree.leaves(tree)``, which is the order backprop produces them for
        a model whose parameters are listed input-to-output.
      exclude: leaf indices to leave out of every bucket (for example
        parameters known to be unused).
      layouts: per leaf, its split over the mesh's non-data axes
        (:mod:`fdp.data._model_axes`); empty: every leaf whole there. Buckets
        are keyed by dtype and layout, as DDP keys them by dtype and device.

    Returns:
      A hashable :class:`BucketPlan` whose ``buckets`` are in reduce order.

    Raises:
      ValueError: a cap is not positive, or ``order``/``exclude`` name leaves
        that do not exist or repeat.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"w": jnp.zeros((512, 512)), "b": jnp.zeros((512,))}
      >>> plan = plan_buckets(params, bucket_cap_mb=25.0)
      >>> # Leaves are sorted by key (b is 0, w is 1). w alone fills the 1 MiB first
      >>> # bucket, so b opens the next one.
      >>> plan.as_lists()
      [[1], [0]]
      >>> [b.nbytes for b in plan.buckets]
      [1048576, 2048]
    """
    limits = cap_limits(bucket_cap_mb, first_bucket_cap_mb)

    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    key_paths = tuple(jax.tree_util.keystr(p) for p, _ in paths_leaves)
    metas = [_leaf_meta(leaf) for _, leaf in paths_leaves]
    shapes = tuple(s for s, _ in metas)
    dtypes = tuple(d for _, d in metas)
    n = len(metas)

    exclude_set = _check_indices(exclude, n, "exclude")
    if order is None:
        order = range(n - 1, -1, -1)
    else:
        _check_indices(order, n, "order")
        missing = sorted(set(range(n)) - set(order))
        if missing:
            raise ValueError(
                f"order must name every leaf once; leaves {missing} are missing "
                f"(the tree has {n} leaves)."
            )
    grad_order = [i for i in order if i not in exclude_set and has_gradient(dtypes[i])]
    in_buckets = set(grad_order)
    excluded = tuple(i for i in range(n) if i not in in_buckets)
    sizes_bytes = [math.prod(s) * d.itemsize for s, d in metas]
    layouts = tuple(layouts)
    if layouts and len(layouts) != n:
        raise ValueError(f"layouts must name every leaf's layout: {len(layouts)} for {n} leaves.")
    if not any(len(spec) for spec in layouts):
        layouts = ()  # whole on every other axis: the plan of a 1-D mesh
    keys = [(d, layouts[i] if layouts else WHOLE) for i, d in enumerate(dtypes)]

    buckets = []
    for index, leaf_ids in enumerate(assign_buckets(sizes_bytes, keys, limits, grad_order)):
        sizes = tuple(math.prod(shapes[i]) for i in leaf_ids)
        offsets = tuple(int(o) for o in np.cumsum((0, *sizes[:-1])))
        buckets.append(
            Bucket(
                index=index,
                dtype=dtypes[leaf_ids[0]],
                leaf_indices=tuple(leaf_ids),
                shapes=tuple(shapes[i] for i in leaf_ids),
                offsets=offsets,
                sizes=sizes,
                key_paths=tuple(key_paths[i] for i in leaf_ids),
                layout=keys[leaf_ids[0]][1],
            )
        )
    return BucketPlan(
        buckets=tuple(buckets),
        treedef=treedef,
        leaf_shapes=shapes,
        leaf_dtypes=dtypes,
        leaf_key_paths=key_paths,
        excluded=excluded,
        bucket_cap_bytes=limits[-1],
        first_bucket_cap_bytes=limits[0],
        leaf_layouts=layouts,
    )


@functools.lru_cache(maxsize=256)
def _cached_plan(
    treedef: Any,
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[np.dtype, ...],
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    exclude: tuple[int, ...],
    order: tuple[int, ...] | None,
    layouts: tuple[P, ...],
) -> BucketPlan:
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    return plan_buckets(
        jax.tree.unflatten(treedef, structs),
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        exclude=exclude,
        order=order,
        layouts=layouts,
    )


def plan_for(
    tree: Any,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    exclude: Sequence[int] = (),
    *,
    order: Sequence[int] | None = None,
    layouts: Sequence[P] = (),
) -> BucketPlan:
    """:func:`plan_buckets` memoised on the tree's structure, shapes, dtypes, order and layouts.

    Steps call it at trace time; equal trees share one plan object.
    """
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(int(d) for d in np.shape(x)) for x in leaves)
    dtypes = tuple(_leaf_meta(x)[1] for x in leaves)
    return _cached_plan(
        treedef,
        shapes,
        dtypes,
        bucket_cap_mb,
        first_bucket_cap_mb,
        tuple(exclude),
        None if order is None else tuple(int(i) for i in order),
        tuple(layouts),
    )


def _check_indices(indices: Sequence[int], n: int, name: str) -> set[int]:
    seen: set[int] = set()
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int | np.integer) or not 0 <= i < n:
            raise ValueError(f"{name} must hold leaf indices in [0, {n}), got {i!r}.")
        if i in seen:
            raise ValueError(f"{name} names leaf {i} twice.")
        seen.add(int(i))
    return seen
