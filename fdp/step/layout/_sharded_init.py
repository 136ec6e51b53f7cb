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

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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
    With ``shardings``, leaves the step keeps padded are padded here (:func:`pad_to`).
    """

    def __init__(self, build: Callable[..., Any], shardings: Sequence[Any] | None = None):
        self.build = build
        self.shardings = shardings
        self.treedef: Any = None

    def __call__(self, *args: Any) -> list[Any]:
        leaves, self.treedef = jax.tree.flatten(self.build(*args))
        if self.shardings is not None:
            leaves = [pad_to(x, s) for x, s in zip(leaves, self.shardings, strict=True)]
        return leaves


def pad_to(x: Any, sharding: Any) -> Any:
    """``x`` padded with zeros so that ``sharding`` splits it evenly (as the step pads).

    A leaf that no dimension of the number of devices divides is kept padded
    (:mod:`fdp.step.layout._padding`); its sharding names the padded dimension.
    """
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return x
    pads = []
    names_per_dim = tuple(spec) + (None,) * (np.ndim(x) - len(spec))
    for size, names in zip(np.shape(x), names_per_dim, strict=True):
        names = () if names is None else (names if isinstance(names, tuple) else (names,))
        parts = math.prod(sharding.mesh.shape[a] for a in names)
        pads.append((0, -size % parts))
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def jit_build(build: Callable[..., Any], shardings: Sequence[Any]) -> tuple[Any, FlatBuild]:
    """``build`` jitted to return its leaves on ``shardings``, and its :class:`FlatBuild`.

    ``jitted.lower(*args).compile().memory_analysis()`` shows what each device
    holds while it runs.
    """
    flat = FlatBuild(build, list(shardings))
    return jax.jit(flat, out_shardings=list(shardings)), flat


def build_sharded(build: Callable[..., Any], args: Sequence[Any], shardings: Sequence[Any]) -> Any:
    """``build(*args)`` computed with its leaves landing on ``shardings``, never whole."""
    jitted, flat = jit_build(build, shardings)
    leaves = jitted(*args)
    return jax.tree.unflatten(flat.treedef, leaves)
