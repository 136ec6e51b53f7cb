"""A leaf's split over the mesh's other axes: the model-parallel layout fdp keeps.

fdp's step is manual over the data axis only (``jax.shard_map(axis_names=...)``);
every other mesh axis (``'model'``, ``'tensor'``) stays with XLA's partitioner,
which runs the user's tensor-parallel program as plain ``jit`` would. What fdp
owns is each leaf's placement over the data axis (replicated for DDP, split for
ZeRO); what it keeps is the rest of the leaf's sharding, its *model spec*:

- a leaf already on the step's mesh keeps the non-data part of its spec (the way
  a user places a Megatron-style model, or Flax's examples place their state
  with ``nn.logical_to_mesh_sharding``);
- a leaf elsewhere takes what Flax's metadata declares for it: ``nn.Partitioned``
  and ``nn.LogicallyPartitioned`` boxes (logical names mapped through the box's
  rules, else the ``nn.logical_axis_rules`` in force), and ``nnx.Variable``
  ``sharding`` metadata (``nnx.with_partitioning``);
- else it is whole on the other axes.

Data axes named in a spec are dropped: DDP replicates over them, ZeRO splits
over them its own way. PyTorch's ``fully_shard(mesh=..., dp_mesh_dims=...)`` does
the same with DTensors: the other dimensions' placements stay, the data
dimensions are fdp's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.core import meta
from flax.linen import spmd as linen_spmd
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp.collectives._axis import AxisName
from fdp.collectives._blocks import spec_axes
from fdp.data._abstract import is_abstract, placed_like
from fdp.data._placement import replicate

Specs = tuple[P, ...]


def drop_axes(spec: P, axes: Collection[str]) -> P:
    """``spec`` without the mesh axes ``axes`` (trailing ``None`` trimmed).

    Example:
      >>> drop_axes(P("data", "model"), {"data"}) == P(None, "model")
      True
      >>> drop_axes(P(("data", "model")), {"data"}) == P("model"), drop_axes(P("data"), {"data"})
      (True, P())
    """
    parts: list[Any] = []
    for part in spec:
        if isinstance(part, str):
            part = None if part in axes else part
        elif isinstance(part, tuple):
            kept = tuple(a for a in part if a not in axes)
            part = None if not kept else kept[0] if len(kept) == 1 else kept
        parts.append(part)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def is_box(x: Any) -> bool:
    """Whether ``x`` is a Flax box that may declare a sharding (Linen or NNX)."""
    return isinstance(x, meta.AxisMetadata | nnx.Variable)


def _declared(box: Any) -> P | None:
    """The mesh spec a Flax box declares, or None where it declares none."""
    if isinstance(box, nn.LogicallyPartitioned):
        return linen_spmd.logical_to_mesh_axes(box.names, box.rules)
    if isinstance(box, meta.Partitioned):
        return box.get_partition_spec()
    if isinstance(box, nnx.Variable):
        spec = nnx.get_partition_spec(box)
        value = spec.get_value() if hasattr(spec, "get_value") else spec.value
        return value if isinstance(value, P) and len(value) else None
    return None


def _placed_spec(x: Any, mesh: Mesh) -> P | None:
    """The spec of ``x``'s sharding where it lies on ``mesh`` (an array or a struct)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding.spec
    return None


def _check_spec(spec: P, shape: tuple[int, ...], mesh: Mesh, where: str) -> None:
    unknown = [a for a in spec_axes(spec) if a not in mesh.shape]
    if unknown:
        raise ValueError(
            f"{where} declares the sharding {spec}, which names {unknown}: not axes of "
            f"the step's mesh, whose axes are {dict(mesh.shape)}. Map its logical axes "
            "to mesh axes (nn.logical_axis_rules) or give the mesh those axes."
        )
    if len(spec) > len(shape):
        raise ValueError(
            f"{where} declares the sharding {spec} for an array of shape {shape}: more "
            "dimensions than the array has."
        )
    for dim, part in enumerate(spec):
        names = (part,) if isinstance(part, str) else part or ()
        size = math.prod(int(mesh.shape[a]) for a in names)
        if shape[dim] % size:
            raise ValueError(
                f"{where} declares the sharding {spec}: dimension {dim} of its shape "
                f"{shape} does not divide over {names} ({size} devices)."
            )


def model_specs(tree: Any, mesh: Mesh, axis_name: AxisName) -> Specs:
    """Per leaf of ``tree`` (``jax.tree.leaves`` order), its spec over the non-data axes.

    A leaf on ``mesh`` keeps its own spec; a leaf elsewhere inside a Flax box
    takes the box's declared spec; else ``P()``. Data axes are dropped.

    Raises:
      ValueError: a declared spec names an axis ``mesh`` lacks, or a dimension
        it does not divide (naming the leaf).

    Example:
      >>> import jax, numpy as np
      >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
      >>> w = jax.device_put(np.ones((4, 2)), NamedSharding(mesh, P("data", "model")))
      >>> model_specs({"w": w, "b": np.ones(2)}, mesh, "data") == (P(), P(None, "model"))
      True
    """
    data = {axis_name} if isinstance(axis_name, str) else set(axis_name)
    out: list[P] = []
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
    for path, node in flat:
        declared = _declared(node) if is_box(node) else None
        for x in jax.tree.leaves(node):
            spec = _placed_spec(x, mesh)
            if spec is None and declared is not None:
                where = f"the leaf {jax.tree_util.keystr(path)}"
                _check_spec(declared, tuple(np.shape(x)), mesh, where)
                spec = declared
            out.append(P() if spec is None else drop_axes(spec, data))
    return tuple(out)


def has_model_axes(specs: Specs) -> bool:
    """Whether any leaf is split over a non-data axis."""
    return any(len(s) for s in specs)


def kept_shardings(tree: Any, mesh: Mesh, specs: Specs) -> Any:
    """``tree`` with each leaf replaced by ``NamedSharding(mesh, its spec)``."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(specs):
        raise ValueError(f"{len(specs)} specs for a tree of {len(leaves)} leaves.")
    return jax.tree.unflatten(treedef, [_named(mesh, s) for s in specs])


@functools.lru_cache(maxsize=1024)
def _named(mesh: Mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, spec)


@functools.lru_cache(maxsize=32)
def _place_jit(treedef: Any, targets: tuple[NamedSharding, ...]) -> Any:
    return jax.jit(lambda tree: tree, out_shardings=jax.tree.unflatten(treedef, targets))


def place_kept(tree: Any, mesh: Mesh, specs: Specs) -> Any:
    """``tree`` replicated over the data axis, each leaf split over the others as ``specs``.

    Leaves not yet on ``mesh`` go through :func:`fdp.replicate` first (process
    0's values everywhere); leaves on the mesh
    are resharded in place, never gathered whole. A jitted copy: the caller's
    buffers are never aliased (a donating step would delete them).
    """
    leaves, treedef = jax.tree.flatten(tree)
    targets = tuple(_named(mesh, s) for s in specs)
    if is_abstract(tree):
        return placed_like(tree, jax.tree.unflatten(treedef, targets))
    elsewhere = [i for i, x in enumerate(leaves) if _placed_spec(x, mesh) is None]
    if elsewhere:
        moved = replicate([leaves[i] for i in elsewhere], mesh)
        for i, x in zip(elsewhere, moved, strict=True):
            leaves[i] = x
    return _place_jit(treedef, targets)(jax.tree.unflatten(treedef, leaves))
