"""Abstract states: ``jax.ShapeDtypeStruct`` trees that stand for arrays on a mesh.

A step is lowered for a mesh it cannot run on (the compile-only GPU devices of
:mod:`fdp.observe.gpu`) from shapes alone. Every function that places a state
(replicates it, shards it for ZeRO, stacks it per device, fills a hook's state)
then describes its result instead of computing it; nothing executes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def is_abstract(tree: Any) -> bool:
    """Whether ``tree`` holds a ``jax.ShapeDtypeStruct`` (so it cannot be computed on).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> is_abstract({"w": jax.ShapeDtypeStruct((2,), jnp.float32)}), is_abstract(jnp.ones(2))
      (True, False)
    """
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def placed_like(tree: Any, shardings: Any) -> Any:
    """``tree``'s shapes and dtypes with ``shardings`` (a sharding, or one per leaf)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def run_or_describe(fn: Callable[..., Any], *args: Any, out_sharding: Any = None) -> Any:
    """``fn(*args)``, or its output's description when an argument is abstract.

    Args:
      fn: a jitted function.
      *args: its arguments.
      out_sharding: the sharding of every output leaf, when ``fn``'s own
        description carries none (a ``shard_map`` without ``out_shardings``).
    """
    if not is_abstract(args):
        return fn(*args)
    out = jax.eval_shape(fn, *args)
    return out if out_sharding is None else placed_like(out, out_sharding)
