"""ZeRO: which arrays a step keeps sharded over the data axis, and how.

One rule decides every leaf, from its shape alone: a leaf is split along its
first dimension that the number of devices ``N`` divides (past the leading one
of a leaf of three or more dimensions, a layer stack's layer axis, where a
later one qualifies: :func:`shard_dim`); a leaf with no such
dimension (a scalar, a bias of 10 on 8 devices) stays whole on every device,
except in the optimizer state, where a leaf of at least ``N`` elements is kept
padded with zeros and split (:mod:`fdp.step.layout._padding`).
Because the rule reads only the shape, a parameter, its gradient and the
optimizer state that mirrors it (Adam's ``mu`` and ``nu``) are always split the
same way, whatever the optimizer's state looks like, so the update needs no
communication between them.

The update itself is written on globally-shaped arrays under ``jit`` with these
shardings as constraints: XLA's partitioner runs each elementwise step on the
local 1/N, and turns what looks across leaves (``clip_by_global_norm``'s norm)
into a partial sum and an all-reduce of a scalar. optax never sees a local slice,
so every transform keeps its meaning.

Stages (DeepSpeed's): 1 shards the optimizer state; 2 also the reduced
gradients (each bucket is reduce-scattered); 3 also the parameters between
steps (gathered where they are used: :mod:`fdp.step.grads._per_use`; or bucket by bucket
at the start of a step, :func:`gather_params`). Stage 1 reduce-scatters
too when the comm hook can (the default can): the update reads only each
device's share, and a reduce-scatter plus the all-gather of the new parameters
move the bytes of DDP's all-reduce. With a hook that needs whole gradients
(PowerSGD, quantization) stage 1 all-reduces and each device slices its share.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp.bucketing import BucketPlan
from fdp.bucketing._plan import WHOLE
from fdp.collectives._axis import AxisName
from fdp.collectives._blocks import on_blocks
from fdp.data._abstract import is_abstract, placed_like
from fdp.data._model_axes import drop_axes, model_specs
from fdp.data._placement import axis_names_of, check_axis, constrain_to
from fdp.step.layout._padding import (
    NONE_TAKEN,
    Taken,
    needs_padding,
    pad_dim,
    pad_struct,
    pad_tree,
    padding_bytes,
    taken_dims,
)

STAGES = (0, 1, 2, 3)


def check_stage(stage: Any) -> int:
    """``stage`` if it is one of ZeRO's stages 0-3, else a clear error."""
    if isinstance(stage, bool) or not isinstance(stage, int | np.integer):
        raise TypeError(f"zero_stage must be an int in {STAGES}, got {stage!r}.")
    if int(stage) not in STAGES:
        raise ValueError(
            f"zero_stage must be one of {STAGES} (0: DDP, 1: optimizer state sharded, "
            f"2: also gradients, 3: also parameters), got {stage}."
        )
    return int(stage)


def shard_dim(shape: Sequence[int], n: int, taken: Taken = NONE_TAKEN) -> int | None:
    """The dimension a leaf of ``shape`` is split along over ``n`` devices, or None.

    The first dimension ``n`` divides, except that a leaf of three or more
    dimensions skips its leading one where a later one qualifies: a layer stack
    (``nn.scan``/``nnx.scan``, ``[L, d_in, d_out]``) then holds a share of every
    layer, so a loop over it gathers one layer per trip from the state as it is
    (split along the layer axis, each device would hold whole layers, and the
    step would first re-split the stack into a second copy). Dimensions in
    ``taken`` (split over a model axis: :func:`fdp.step.layout._padding.taken_dims`)
    are left to it: the data axis goes on another.

    Example:
      >>> shard_dim((10, 16), 8), shard_dim((10,), 8), shard_dim((), 8)
      (1, None, None)
      >>> shard_dim((8, 512, 2048), 8), shard_dim((8, 3, 5), 8), shard_dim((16, 24), 8)
      (1, 0, 0)
    """
    if n <= 1:
        return None
    fits = [d for d, size in enumerate(shape) if size % n == 0 and size >= n and d not in taken]
    if len(shape) >= 3 and any(d > 0 for d in fits):
        return next(d for d in fits if d > 0)
    return fits[0] if fits else None


def spec(shape: Sequence[int], n: int, axis_name: AxisName, layout: P = WHOLE) -> P:
    """The data-axis ``PartitionSpec`` of a leaf of ``shape`` sharded over ``axis_name``.

    Only the data axis (what a ``shard_map`` manual over it names); ``layout``,
    the leaf's split over the mesh's model axes, says which dimensions are taken.
    """
    d = shard_dim(shape, n, taken_dims(layout))
    if d is None:
        return P()
    return P(*([None] * d), axis_name)


def full_spec(shape: Sequence[int], n: int, axis_name: AxisName, layout: P = WHOLE) -> P:
    """The whole ``PartitionSpec`` of a ZeRO-sharded leaf: ``layout`` plus the data axis.

    Example:
      >>> full_spec((8, 16), 4, "data", P(None, "model")) == P("data", "model")
      True
      >>> full_spec((16, 4), 4, "data", P("model")) == P("model", "data")
      True
    """
    d = shard_dim(shape, n, taken_dims(layout))
    if d is None:
        return layout
    parts = list(layout) + [None] * (len(shape) - len(layout))
    parts[d] = axis_name
    return drop_axes(P(*parts), ())


def _per_leaf(tree: Any, layouts: Sequence[P], fn: Any) -> Any:
    """``tree`` with each leaf ``x`` replaced by ``fn(x, its layout)``."""
    leaves, treedef = jax.tree.flatten(tree)
    if layouts and len(layouts) != len(leaves):
        raise ValueError(f"{len(layouts)} layouts for a tree of {len(leaves)} leaves.")
    laid = layouts or (WHOLE,) * len(leaves)
    return jax.tree.unflatten(treedef, [fn(x, lay) for x, lay in zip(leaves, laid, strict=True)])


def specs(tree: Any, n: int, axis_name: AxisName, layouts: Sequence[P] = ()) -> Any:
    """``tree`` with each array leaf replaced by its data-axis ``PartitionSpec``.

    ``layouts``: per leaf, its split over the model axes (empty: none).
    """
    return _per_leaf(tree, layouts, lambda x, lay: spec(np.shape(x), n, axis_name, lay))


def shardings(tree: Any, mesh: Mesh, axis_name: AxisName, layouts: Sequence[P] = ()) -> Any:
    """``tree`` with each array leaf replaced by its ``NamedSharding`` on ``mesh``."""
    n = check_axis(mesh, axis_name)

    def one(x: Any, layout: P) -> NamedSharding:
        return NamedSharding(mesh, full_spec(np.shape(x), n, axis_name, layout))

    return _per_leaf(tree, layouts, one)


def replicated(tree: Any, mesh: Mesh, layouts: Sequence[P] = ()) -> Any:
    """``tree`` with each leaf replaced by its sharding whole over the data axis."""
    return _per_leaf(tree, layouts, lambda _, layout: NamedSharding(mesh, layout))


def constrain(tree: Any, mesh: Mesh, axis_name: AxisName, layouts: Sequence[P] = ()) -> Any:
    """Inside ``jit``: ``tree`` constrained to its ZeRO shardings (resharded on Explicit axes)."""
    return constrain_to(tree, shardings(tree, mesh, axis_name, layouts))


def constrain_replicated(tree: Any, mesh: Mesh, layouts: Sequence[P] = ()) -> Any:
    """Inside ``jit``: ``tree`` constrained to be whole over the data axis."""
    return constrain_to(tree, replicated(tree, mesh, layouts))


@functools.lru_cache(maxsize=64)
def bucket_shard_dims(plan: BucketPlan, n: int) -> tuple[int | None, ...]:
    """Per parameter leaf of ``plan``, its shard dimension over ``n`` devices."""
    layouts = plan.leaf_layouts or (WHOLE,) * len(plan.leaf_shapes)
    return tuple(
        shard_dim(s, n, taken_dims(lay)) for s, lay in zip(plan.leaf_shapes, layouts, strict=True)
    )


def gather(
    leaves: Sequence[jax.Array],
    dims: Sequence[int | None],
    axis_name: AxisName,
    layouts: Sequence[P] = (),
) -> list:
    """Inside ``shard_map``: whole arrays from this device's shards (stage 3).

    ``layouts``: per leaf, its split over the model axes; such a leaf is
    gathered on its block (:func:`fdp.collectives._blocks.on_blocks`).
    """
    laid = layouts or (WHOLE,) * len(leaves)
    return [
        x if d is None else gather_leaf(x, d, axis_name, lay)
        for x, d, lay in zip(leaves, dims, laid, strict=True)
    ]


def gather_leaf(x: jax.Array, dim: int, axis_name: AxisName, layout: P = WHOLE) -> jax.Array:
    """Inside ``shard_map``: ``x`` all-gathered along ``dim`` over the data axis.

    On each device's block of its ``layout`` (its split over the model axes:
    :func:`fdp.collectives._blocks.on_blocks`), so neither the gather nor its
    transpose, the gradient's reduce-scatter, moves the leaf over a model axis.
    """
    return on_blocks(functools.partial(_gather_along, dim, axis_name), layout)(x)


def _gather_along(dim: int, axis_name: AxisName, x: jax.Array) -> jax.Array:
    return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)


def gather_bucket(
    shards: Sequence[jax.Array], dims: Sequence[int | None], axis_name: AxisName, n: int
) -> list[jax.Array]:
    """Inside ``shard_map``: a bucket's parameters made whole by one all-gather.

    The shards of one dtype are packed into one flat buffer, gathered once
    (``[n, size]``: device ``d``'s buffer in row ``d``) and unpacked, so the
    bucket is one collective in the program, as DDP's bucket is one
    all-reduce; leaves kept whole (no shard dimension) pass through.
    """
    split = [i for i, d in enumerate(dims) if d is not None]
    out = list(shards)
    if not split:
        return out
    if len(split) == 1:  # nothing to pack: gather the leaf itself
        i = split[0]
        out[i] = jax.lax.all_gather(shards[i], axis_name, axis=cast(int, dims[i]), tiled=True)
        return out
    flat = jnp.concatenate([shards[i].reshape(-1) for i in split])
    rows = jax.lax.all_gather(flat, axis_name)  # [n, size]
    offset = 0
    for i in split:
        shape, d = shards[i].shape, cast(int, dims[i])
        piece = rows[:, offset : offset + shards[i].size].reshape(n, *shape)
        offset += shards[i].size
        # [n, ..., s_d, ...] -> [..., n * s_d, ...]: device k's shard is block k along d.
        piece = jnp.moveaxis(piece, 0, d)
        out[i] = piece.reshape(*shape[:d], n * shape[d], *shape[d + 1 :])
    return out


def gather_params(params: Any, plan: BucketPlan, axis_name: AxisName, n: int) -> Any:
    """Inside ``shard_map``: stage 3's sharded parameters made whole, bucket by bucket.

    One all-gather per bucket (:func:`gather_bucket`), from the last bucket to
    the first (the forward pass's order: buckets hold gradients in ready order,
    the reverse), and leaves in no bucket last, so the compiler can start the
    forward pass on the first layers while later ones are still in flight.
    """
    leaves, treedef = jax.tree.flatten(params)
    dims = bucket_shard_dims(plan, n)
    out = list(leaves)
    groups = [tuple(reversed(b.leaf_indices)) for b in reversed(plan.buckets)]
    bucketed = {i for g in groups for i in g}
    names = [f"fdp_bucket_{b.index}" for b in reversed(plan.buckets)]
    layouts = [b.layout for b in reversed(plan.buckets)]
    for name, group, layout in zip(names, groups, layouts, strict=True):
        shards, shard_dims = [leaves[i] for i in group], [dims[i] for i in group]
        with jax.named_scope(name):
            # A bucket split over a model axis is gathered block by block, never packed
            # (packing would gather it over the model axis first).
            if len(layout):
                whole = gather(shards, shard_dims, axis_name, [layout] * len(group))
            else:
                whole = gather_bucket(shards, shard_dims, axis_name, n)
        for i, x in zip(group, whole, strict=True):
            out[i] = x
    rest = [i for i in range(len(leaves)) if i not in bucketed]
    laid = plan.leaf_layouts
    whole = gather(
        [leaves[i] for i in rest],
        [dims[i] for i in rest],
        axis_name,
        [laid[i] for i in rest] if laid else (),
    )
    for i, x in zip(rest, whole, strict=True):
        out[i] = x
    return jax.tree.unflatten(treedef, out)


def is_placed(tree: Any, mesh: Mesh, axis_name: AxisName, *, pad: bool = False) -> bool:
    """Whether ``tree``'s first shardable leaf already has its ZeRO sharding (cheap).

    With ``pad``, also whether every leaf :func:`place` pads is padded already.
    Every step of a ZeRO stage asks this of the state it is given, so the
    per-shape answers are cached. A leaf on ``mesh`` is read with its split
    over the model axes (:mod:`fdp.data._model_axes`).
    """
    n = check_axis(mesh, axis_name)
    if n <= 1:  # nothing is padded or split over one device
        return True
    data = frozenset(axis_names_of(axis_name))
    leaves = jax.tree.leaves(tree)
    layouts = [_layout_on(getattr(x, "sharding", None), mesh, data) for x in leaves]
    if pad and needs_padding(tree, n, layouts):
        return False
    for x, layout in zip(leaves, layouts, strict=True):
        target = _placed_sharding(mesh, tuple(np.shape(x)), n, axis_name, layout)
        if target is not None:
            return getattr(x, "sharding", None) == target
    return True


@functools.lru_cache(maxsize=1024)
def _layout_on(sharding: Any, mesh: Mesh, data: frozenset[str]) -> P:
    """A leaf's split over ``mesh``'s non-data axes, from its ``sharding`` (``P()`` off ``mesh``).

    Cached: every ZeRO step reads it for each leaf of the state it is given.
    """
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return drop_axes(sharding.spec, data)
    return WHOLE


@functools.lru_cache(maxsize=1024)
def _placed_sharding(
    mesh: Mesh, shape: tuple[int, ...], n: int, axis_name: AxisName, layout: P = WHOLE
) -> NamedSharding | None:
    """The ZeRO sharding of a leaf of ``shape``, or None where it is not split."""
    if shard_dim(shape, n, taken_dims(layout)) is None:
        return None
    return NamedSharding(mesh, full_spec(shape, n, axis_name, layout))


@functools.lru_cache(maxsize=32)
def _place_jit(treedef: Any, targets: tuple[NamedSharding, ...]) -> Any:
    return jax.jit(lambda tree: tree, out_shardings=jax.tree.unflatten(treedef, targets))


@functools.lru_cache(maxsize=32)
def _pad_place_jit(
    treedef: Any, n: int, layouts: tuple[P, ...], targets: tuple[NamedSharding, ...]
) -> Any:
    out = jax.tree.unflatten(treedef, targets)
    return jax.jit(lambda tree: pad_tree(tree, n, layouts), out_shardings=out)


def place(
    tree: Any, mesh: Mesh, axis_name: AxisName, *, sharded: bool = True, pad: bool = False
) -> Any:
    """``tree`` moved onto its ZeRO shardings (or replicated), outside ``jit``.

    A jitted copy, so it works with arrays of several processes and never
    aliases the caller's buffers (a donating step would delete them). An
    abstract ``tree`` (``jax.ShapeDtypeStruct`` leaves) gets its shardings only.
    With ``pad`` (the optimizer state), leaves that no dimension of the number
    of devices divides are padded with zeros first (:mod:`fdp.step.layout._padding`),
    so they are sharded too.
    """
    n = check_axis(mesh, axis_name)
    layouts = model_specs(tree, mesh, axis_name)
    if pad and sharded and needs_padding(tree, n, layouts):
        shapes = _per_leaf(tree, layouts, lambda x, lay: pad_struct(x, n, taken_dims(lay)))
        target = shardings(shapes, mesh, axis_name, layouts)
        if is_abstract(tree):
            return placed_like(shapes, target)
        treedef = jax.tree.structure(tree)
        return _pad_place_jit(treedef, n, layouts, tuple(jax.tree.leaves(target)))(tree)
    if sharded:
        target = shardings(tree, mesh, axis_name, layouts)
    else:
        target = replicated(tree, mesh, layouts)
    if is_abstract(tree):  # lowered for a mesh it cannot run on: describe, compute nothing
        return placed_like(tree, target)
    treedef = jax.tree.structure(tree)
    return _place_jit(treedef, tuple(jax.tree.leaves(target)))(tree)


# -- what each device holds ----------------------------------------------------------------


def shape_structs(tree: Any) -> Any:
    """``tree`` as ``jax.ShapeDtypeStruct`` leaves (no arrays kept alive)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


@dataclasses.dataclass(frozen=True)
class HeldBytes:
    """Bytes of a pytree: in all, and held by one device under a stage's shardings.

    Attributes:
      total: bytes of the whole arrays (unpadded).
      per_device: bytes one device holds, its share of any padding included.
      whole_leaves: key paths of the leaves kept whole on every device (no
        dimension divisible by the number of devices, and not padded) when
        sharded.
      padding: bytes of zeros added in all (over every device) to shard leaves
        that no dimension of the number of devices divides
        (:mod:`fdp.step.layout._padding`).
    """

    total: int
    per_device: int
    whole_leaves: tuple[str, ...]
    padding: int = 0


def held_bytes(tree: Any, n: int, *, sharded: bool, pad: bool = False) -> HeldBytes:
    """What one of ``n`` devices holds of ``tree`` (arrays or shape structs).

    ``pad``: leaves that no dimension of ``n`` divides are padded and sharded,
    as the step keeps the optimizer state (:func:`place` with ``pad``). ``tree``
    is read as unpadded: a leaf padded already counts as a leaf of that shape.
    """
    total = per_device = padding = 0
    whole: list[str] = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        shape = tuple(np.shape(x))
        nbytes = math.prod(shape) * np.dtype(x.dtype).itemsize
        total += nbytes
        split = sharded and shard_dim(shape, n) is not None
        padded = sharded and pad and pad_dim(shape, n) is not None
        if padded:
            extra = padding_bytes(shape, x.dtype, n)
            padding += extra
            per_device += (nbytes + extra) // n
        else:
            per_device += nbytes // n if split else nbytes
        if sharded and not split and not padded and n > 1 and shape:
            whole.append(jax.tree_util.keystr(path))
    return HeldBytes(total, per_device, tuple(whole), padding)


def memory_table(
    stage: int, n: int, params: Any, opt_state: Any, *, scattered: bool | None = None
) -> str:
    """What each of ``n`` devices holds at ``stage``, as text (for :func:`fdp.describe`).

    ``scattered``: whether the reduced gradients are scattered (default: from stage 2;
    at stage 1 too with a hook that has a reduce-scatter form).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32),
      ...           "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
      >>> print(memory_table(2, 8, params, {"mu": params, "nu": params}))
      ZeRO stage 2 over 8 device(s), bytes each device holds:
        parameters (between steps)       268 B of 268 B (1.000)
        reduced gradients (in the step)   44 B of 268 B (0.164)
        optimizer state (between steps)   88 B of 536 B (0.164)
        kept whole (no dimension divisible by 8, not padded): ['b'], ['mu']['b'], ['nu']['b']

      A ``7 x 5`` kernel's optimizer state is padded to ``8 x 5`` and sharded (its
      parameter, never padded, stays whole):

      >>> params = {"k": jax.ShapeDtypeStruct((7, 5), jnp.float32)}
      >>> print(memory_table(1, 8, params, {"mu": params}))
      ZeRO stage 1 over 8 device(s), bytes each device holds:
        parameters (between steps)       140 B of 140 B (1.000)
        reduced gradients (in the step)  140 B of 140 B (1.000)
        optimizer state (between steps)   20 B of 140 B (0.143)
        kept whole (no dimension divisible by 8, not padded): ['k']
        optimizer state padding (zeros, in all): 20 B, 2 B per device
    """
    scatter = stage >= 2 if scattered is None else scattered
    rows = [
        ("parameters (between steps)", held_bytes(params, n, sharded=stage >= 3)),
        ("reduced gradients (in the step)", held_bytes(params, n, sharded=scatter)),
        (
            "optimizer state (between steps)",
            held_bytes(opt_state, n, sharded=stage >= 1, pad=True),
        ),
    ]
    lines = [f"ZeRO stage {stage} over {n} device(s), bytes each device holds:"]
    width = max(len(name) for name, _ in rows)
    digits = max(len(f"{held.total:,}") for _, held in rows)
    for name, held in rows:
        share = held.per_device / held.total if held.total else 1.0
        lines.append(
            f"  {name.ljust(width)}  {held.per_device:>{digits},} B of {held.total:>{digits},} B "
            f"({share:.3f})"
        )
    whole = sorted(set(held_bytes(params, n, sharded=True).whole_leaves + rows[2][1].whole_leaves))
    if stage >= 1 and whole:
        lines.append(
            f"  kept whole (no dimension divisible by {n}, not padded): {', '.join(whole)}"
        )
    padding = rows[2][1].padding
    if stage >= 1 and padding:
        lines.append(
            f"  optimizer state padding (zeros, in all): {padding:,} B, "
            f"{padding // n:,} B per device"
        )
    return "\n".join(lines)
