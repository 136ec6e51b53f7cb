"""ZeRO padding: sharding the optimizer state of leaves that ``N`` does not divide.

:func:`fdp.step._zero.shard_dim` splits a leaf along a dimension the number of
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


def _divisible(shape: Sequence[int], n: int) -> bool:
    return any(size % n == 0 and size >= n for size in shape)


def pad_dim(shape: Sequence[int], n: int) -> int | None:
    """The dimension a leaf of ``shape`` is padded along over ``n`` devices, or None.

    None when no padding is needed (a dimension ``n`` divides) or worth it
    (fewer than ``n`` elements). Otherwise the dimension whose padding leaves
    each device the fewest elements, the first on ties.

    Example:
      >>> pad_dim((7, 5), 8), pad_dim((1, 1001), 8), pad_dim((3,), 8), pad_dim((16, 5), 8)
      (0, 1, None, None)
    """
    shape = tuple(shape)
    if n <= 1 or not shape or math.prod(shape) < n or _divisible(shape, n):
        return None
    total = math.prod(shape)
    return min(range(len(shape)), key=lambda d: (-(-shape[d] // n) * (total // shape[d]), d))


def padded_shape(shape: Sequence[int], n: int) -> tuple[int, ...]:
    """``shape`` padded as :func:`pad_dim` says (unchanged where it says None).

    Example:
      >>> padded_shape((7, 5), 8), padded_shape((10,), 8), padded_shape((3,), 8)
      ((8, 5), (16,), (3,))
    """
    shape = tuple(shape)
    d = pad_dim(shape, n)
    if d is None:
        return shape
    return (*shape[:d], -(-shape[d] // n) * n, *shape[d + 1 :])


def pad_leaf(x: Any, n: int) -> Any:
    """``x`` padded with zeros at the end of its :func:`pad_dim` (as it is where None)."""
    shape = tuple(np.shape(x))
    target = padded_shape(shape, n)
    if target == shape:
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(shape, target, strict=True)])


def pad_tree(tree: Any, n: int) -> Any:
    """Every leaf of ``tree`` padded for ``n`` devices (:func:`pad_leaf`)."""
    return jax.tree.map(lambda x: pad_leaf(x, n), tree)


def pad_struct(x: Any, n: int) -> Any:
    """A ``jax.ShapeDtypeStruct`` with its :func:`padded_shape` (for abstract placing)."""
    return jax.ShapeDtypeStruct(padded_shape(np.shape(x), n), x.dtype)


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


def needs_padding(tree: Any, n: int) -> bool:
    """Whether some leaf of ``tree`` is not yet padded for ``n`` devices."""
    if n <= 1:
        return False
    return any(_pad_dim_of(tuple(np.shape(x)), n) is not None for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=1024)
def _pad_dim_of(shape: tuple[int, ...], n: int) -> int | None:
    """:func:`pad_dim`, cached: every ZeRO step checks its state's leaves."""
    return pad_dim(shape, n)


def padding_bytes(shape: Sequence[int], dtype: Any, n: int) -> int:
    """The bytes :func:`pad_leaf` adds to a leaf of ``shape`` in all (0 if none)."""
    extra = math.prod(padded_shape(shape, n)) - math.prod(tuple(shape))
    return extra * np.dtype(dtype).itemsize
