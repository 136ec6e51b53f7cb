"""Building a train state straight into the layout a step keeps it in.

A large model's state must never exist whole on one device: built whole and then
placed, it needs the whole parameters and optimizer state on every device for a
moment, which is what ZeRO was meant to avoid. Instead the state's constructor
runs under ``jit`` with ``out_shardings`` set to the layout the step's own
placement gives each leaf, so XLA computes on each device only its share.

The layout is not written down here: the step places the constructor's
*abstract* output (``jax.eval_shape``) with the same code that places a real
state (placing a tree of ``jax.ShapeDtypeStruct`` only describes the result), and
the shardings are read off that description.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax


def shardings_of(abstract: Any) -> list[Any]:
    """The sharding of each leaf of a placed abstract tree, in leaf order.

    Raises:
      ValueError: a leaf has no sharding (the step did not place it).
    """
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    missing = [jax.tree_util.keystr(p) for p, x in leaves if getattr(x, "sharding", None) is None]
    if missing:  # never expected: every leaf of a prepared state is placed
        raise ValueError(f"no sharding for leaves {missing} of the abstract state.")
    return [x.sharding for _, x in leaves]


class FlatBuild:
    """``build(*args)``'s leaves, a list; the tree's structure is kept from the trace.

    ``jit``'s ``out_shardings`` must match the output's tree structure exactly,
    and a ``TrainState``'s static fields (its ``tx`` closures) are new objects on
    every call, so the shardings are given per leaf and the tree rebuilt after.
    """

    def __init__(self, build: Callable[..., Any]):
        self.build = build
        self.treedef: Any = None

    def __call__(self, *args: Any) -> list[Any]:
        leaves, self.treedef = jax.tree.flatten(self.build(*args))
        return leaves


def jit_build(build: Callable[..., Any], shardings: Sequence[Any]) -> tuple[Any, FlatBuild]:
    """``build`` jitted to return its leaves on ``shardings``, and its :class:`FlatBuild`.

    ``jitted.lower(*args).compile().memory_analysis()`` shows what each device
    holds while it runs.
    """
    flat = FlatBuild(build)
    return jax.jit(flat, out_shardings=list(shardings)), flat


def build_sharded(build: Callable[..., Any], args: Sequence[Any], shardings: Sequence[Any]) -> Any:
    """``build(*args)`` computed with its leaves landing on ``shardings``, never whole."""
    jitted, flat = jit_build(build, shardings)
    leaves = jitted(*args)
    return jax.tree.unflatten(flat.treedef, leaves)
