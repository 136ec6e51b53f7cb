"""ZeRO padding: sharding the optimizer state of leaves that ``N`` does not divide.

:func:`fdp.step.layout._zero.shard_dim` splits a leaf along a dimension the number of
devices ``N`` divides. A leaf with no such dimension (a ``7 x 5`` kernel, a bias
of 10 on 8 devices) would stay whole on every device, and so would its Adam
moments. FSDP2 shards every parameter on dim 0 with ``torch.chunk``, padding the
last chunk; fdp does the same for the optimizer state: such a leaf's state is
kept padded with zeros to a multiple of ``N`` along one dimension
(:func:`pad_dim`, the one that leaves each device the fewest elements) and
sharded along it. Leaves of fewer than ``N`` elements stay whole: padding them
would cost more than it saves.

JAX has no uneven shardings (a ``(7, 5)`` array cannot be split 8 ways:
``IndivisibleError``), so a padded leaf has the padded shape. The parameters the
user sees keep their own shapes; only the optimizer state, which the user rarely
reads, holds padded leaves. The update pads the parameters and gradients with
zeros to the same shapes, runs the optimizer on them, and cuts the padding off the
new parameters (:func:`unpad_like`), so the padding is never read back into a
parameter. With zero gradients and zero parameters in the padding, Adam's moments
stay zero there, weight decay adds zero, and ``clip_by_global_norm`` counts
nothing extra.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp.data._placement import unsplit

Taken = frozenset[int]  # dimensions split over a model axis, which ZeRO leaves alone
NONE_TAKEN: Taken = frozenset()


def taken_dims(layout: Any) -> Taken:
    """The dimensions a leaf's model-axis ``PartitionSpec`` splits (ZeRO uses the others).

    Example:
      >>> from jax.sharding import PartitionSpec as P
      >>> sorted(taken_dims(P(None, "model"))), sorted(taken_dims(P()))
      ([1], [])
    """
    return frozenset(d for d, part in enumerate(layout) if part is not None)


def layouts_of(tree: Any, layouts: Sequence[Any]) -> list[Taken]:
    """Per leaf of ``tree``, its taken dimensions (``layouts`` empty: none taken)."""
    n = len(jax.tree.leaves(tree))
    if not layouts:
        return [NONE_TAKEN] * n
    if len(layouts) != n:
        raise ValueError(f"{len(layouts)} layouts for a tree of {n} leaves.")
    return [taken_dims(layout) for layout in layouts]


def _divisible(shape: Sequence[int], n: int, taken: Taken = NONE_TAKEN) -> bool:
    return any(size % n == 0 and size >= n for d, size in enumerate(shape) if d not in taken)


def pad_dim(shape: Sequence[int], n: int, taken: Taken = NONE_TAKEN) -> int | None:
    """The dimension a leaf of ``shape`` is padded along over ``n`` devices, or None.

    None when no padding is needed (a dimension ``n`` divides) or worth it
    (fewer than ``n`` elements). Otherwise the dimension whose padding leaves
    each device the fewest elements, the first on ties. Dimensions in ``taken``
    (split over a model axis) are neither read nor padded.

    Example:
      >>> pad_dim((7, 5), 8), pad_dim((1, 1001), 8), pad_dim((3,), 8), pad_dim((16, 5), 8)
      (0, 1, None, None)
    """
    shape = tuple(shape)
    free = [d for d in range(len(shape)) if d not in taken]
    if n <= 1 or not free or math.prod(shape) < n or _divisible(shape, n, taken):
        return None
    total = math.prod(shape)
    return min(free, key=lambda d: (-(-shape[d] // n) * (total // shape[d]), d))


def padded_shape(shape: Sequence[int], n: int, taken: Taken = NONE_TAKEN) -> tuple[int, ...]:
    """``shape`` padded as :func:`pad_dim` says (unchanged where it says None).

    Example:
      >>> padded_shape((7, 5), 8), padded_shape((10,), 8), padded_shape((3,), 8)
      ((8, 5), (16,), (3,))
    """
    shape = tuple(shape)
    d = pad_dim(shape, n, taken)
    if d is None:
        return shape
    return (*shape[:d], -(-shape[d] // n) * n, *shape[d + 1 :])


def pad_leaf(x: Any, n: int, taken: Taken = NONE_TAKEN) -> Any:
    """``x`` padded with zeros at the end of its :func:`pad_dim` (as it is where None)."""
    shape = tuple(np.shape(x))
    target = padded_shape(shape, n, taken)
    if target == shape:
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(shape, target, strict=True)])


def pad_tree(tree: Any, n: int, layouts: Sequence[Any] = ()) -> Any:
    """Every leaf of ``tree`` padded for ``n`` devices (:func:`pad_leaf`).

    ``layouts``: per leaf, its model-axis ``PartitionSpec`` (empty: none).
    """
    leaves, treedef = jax.tree.flatten(tree)
    taken = layouts_of(tree, layouts)
    return jax.tree.unflatten(
        treedef, [pad_leaf(x, n, t) for x, t in zip(leaves, taken, strict=True)]
    )


def pad_struct(x: Any, n: int, taken: Taken = NONE_TAKEN) -> Any:
    """A ``jax.ShapeDtypeStruct`` with its :func:`padded_shape` (for abstract placing)."""
    return jax.ShapeDtypeStruct(padded_shape(np.shape(x), n, taken), x.dtype)


def unpad_like(tree: Any, like: Any) -> Any:
    """``tree`` with each leaf cut to the shape of ``like``'s leaf (padding dropped)."""

    def cut(x: Any, ref: Any) -> Any:
        shape = tuple(np.shape(ref))
        if tuple(np.shape(x)) == shape:
            return x
        # A padded leaf is split on an Explicit axis (jax.make_mesh's default) where
        # no dimension of its own shape is: made whole, as the update lays it out next.
        return unsplit(x)[tuple(slice(0, s) for s in shape)]

    return jax.tree.map(cut, tree, like)


def needs_padding(tree: Any, n: int, layouts: Sequence[Any] = ()) -> bool:
    """Whether some leaf of ``tree`` is not yet padded for ``n`` devices."""
    if n <= 1:
        return False
    return any(
        _pad_dim_of(tuple(np.shape(x)), n, t) is not None
        for x, t in zip(jax.tree.leaves(tree), layouts_of(tree, layouts), strict=True)
    )


@functools.lru_cache(maxsize=1024)
def _pad_dim_of(shape: tuple[int, ...], n: int, taken: Taken) -> int | None:
    """:func:`pad_dim`, cached: every ZeRO step checks its state's leaves."""
    return pad_dim(shape, n, taken)


def padding_bytes(shape: Sequence[int], dtype: Any, n: int, taken: Taken = NONE_TAKEN) -> int:
    """The bytes :func:`pad_leaf` adds to a leaf of ``shape`` in all (0 if none)."""
    extra = math.prod(padded_shape(shape, n, taken)) - math.prod(tuple(shape))
    return extra * np.dtype(dtype).itemsize
