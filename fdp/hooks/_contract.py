"""The comm-hook contract: a pure function of ``(state, bucket)``.

DDP's hooks take ``(state, bucket)`` and return a future of the reduced flat
buffer. fdp's functional form returns the reduced values and the new state:

    result, new_state = hook.reduce(state, bucket)

``result`` is either the reduced flat buffer (``bucket.size`` elements of
``bucket.dtype``) or one reduced array per gradient (shapes ``bucket.shapes``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fdp import _compat
from fdp.bucketing import Bucket, BucketPlan, pack, unpack
from fdp.bucketing._plan import WHOLE
from fdp.collectives import axis_size, sum_over
from fdp.collectives._axis import AxisName
from fdp.collectives._blocks import on_blocks

HookState = Any
Layout = Literal["leaves", "flat"]
LAYOUTS = ("leaves", "flat")


def check_layout(layout: str) -> None:
    """Raises ``ValueError`` unless ``layout`` is ``'leaves'`` or ``'flat'``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")


class GradBucket:
    """One bucket of local gradients, as a comm hook sees it (DDP's ``GradBucket``).

    Attributes:
      index: the bucket's position in reduce order (``bucket.index()`` in DDP).
      meta: the static :class:`fdp.bucketing.Bucket` (dtype, shapes, offsets...).
      gradients: this device's gradients in the bucket, un-divided, in bucket
        order (``bucket.gradients()``).
      parameters: the matching parameters, or ``None`` when not available.
      is_last: whether this is the last bucket reduced in the step.
      axis_name: the data axis to communicate over.
      layout: the step's layout (``'leaves'`` or ``'flat'``): hooks that can
        work either way (the default all-reduce) follow it.
      shard_dims: with ZeRO stage 2 or 3, per gradient the dimension its
        reduced value is scattered along (None: kept whole); else None.
      after: the previous bucket's reduced gradients in this reduction (None
        for the first bucket). A hook whose calls have side effects outside
        XLA (the CPU backend's shared-memory sum) takes it as an operand, so
        that every process runs those calls in bucket order.
      largest_nbytes: the bytes of the largest bucket of this reduction (a
        hook that reserves room for every bucket at the first one reads it).
      grouped: with the step's ``layout='flat'``, whether its compiler merges
        the collectives tagged with the bucket's key (:func:`bucket_key`) into
        one (XLA:GPU, the default hook). The default hook then reduces the
        gradients where they lie, one tagged all-reduce each, instead of
        packing them: still one collective per bucket, without the packing copy.
        A bucket split over model axes (``layout`` is then ``'leaves'``) is
        reduced so on each device's block of it.
    """

    def __init__(
        self,
        meta: Bucket,
        gradients: Sequence[jax.Array],
        *,
        is_last: bool,
        axis_name: AxisName,
        layout: str = "leaves",
        parameters: Sequence[jax.Array] | None = None,
        shard_dims: Sequence[int | None] | None = None,
        after: Sequence[jax.Array] | None = None,
        largest_nbytes: int = 0,
        grouped: bool = False,
    ):
        self.meta = meta
        self.gradients = tuple(gradients)
        self.parameters = None if parameters is None else tuple(parameters)
        self.is_last = is_last
        self.axis_name = axis_name
        self.layout = layout
        self.shard_dims = None if shard_dims is None else tuple(shard_dims)
        self.after = None if after is None else tuple(after)
        self.largest_nbytes = largest_nbytes
        self.grouped = grouped

    @property
    def index(self) -> int:
        """Position in reduce order."""
        return self.meta.index

    @property
    def dtype(self) -> np.dtype:
        """The dtype of every gradient in the bucket."""
        return self.meta.dtype

    @property
    def size(self) -> int:
        """Elements in the flat buffer."""
        return self.meta.size

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of each gradient."""
        return self.meta.shapes

    @property
    def offsets(self) -> tuple[int, ...]:
        """Offset of each gradient in the flat buffer."""
        return self.meta.offsets

    @property
    def key_paths(self) -> tuple[str, ...]:
        """Key path of each gradient."""
        return self.meta.key_paths

    @property
    def num_replicas(self) -> int:
        """Devices along the data axis (DDP's world size)."""
        return axis_size(self.axis_name)

    @property
    def buffer(self) -> jax.Array:
        """The flat 1-D buffer of the bucket's gradients.

        Packed on every access rather than cached: a cached value traced in one
        branch of a ``lax.cond`` must not leak into the other branch. XLA merges
        the identical packs.
        """
        return pack(self.meta, list(self.gradients))

    def unpack(self, buffer: jax.Array) -> list[jax.Array]:
        """Splits a flat buffer of this bucket into per-gradient arrays."""
        return unpack(self.meta, buffer)

    def astype(self, dtype: Any) -> GradBucket:
        """The same bucket with its gradients cast to ``dtype``."""
        meta = dataclasses.replace(self.meta, dtype=np.dtype(dtype))
        return self.with_gradients(meta, [g.astype(dtype) for g in self.gradients])

    def with_gradients(
        self, meta: Bucket, gradients: Sequence[jax.Array], **changes: Any
    ) -> GradBucket:
        """This bucket's settings with other ``gradients`` described by ``meta``.

        ``changes``: keyword fields to give other values (``parameters=``, ``after=``).
        """
        fields: dict[str, Any] = {
            "is_last": self.is_last,
            "axis_name": self.axis_name,
            "layout": self.layout,
            "parameters": self.parameters,
            "shard_dims": self.shard_dims,
            "after": self.after,
            "largest_nbytes": self.largest_nbytes,
            "grouped": self.grouped,
        }
        return GradBucket(meta, gradients, **{**fields, **changes})

    def shard_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of each gradient's share on one device after a reduce-scatter."""
        dims = self.shard_dims or (None,) * len(self.shapes)
        n = self.num_replicas
        return tuple(
            s if d is None else tuple(x // n if i == d else x for i, x in enumerate(s))
            for s, d in zip(self.shapes, dims, strict=True)
        )


InitFn = Callable[[Any, BucketPlan], HookState]
ReduceFn = Callable[[HookState, GradBucket], tuple[Any, HookState]]


class _HookFields(NamedTuple):
    name: str
    init: InitFn
    reduce: ReduceFn
    replicated_output: bool = True
    vma_safe: bool = True
    reduce_scatter: ReduceFn | None = None


class CommHook(_HookFields):
    """A comm hook: settings live in the closures, arrays in the state.

    Attributes:
      name: shown in errors and logs.
      init: ``init(params, plan) -> state``, the hook's state for one device,
        built from the parameters (arrays or ``jax.ShapeDtypeStruct``) and the
        bucket plan. Stateless hooks return ``()``.
      reduce: ``reduce(state, bucket) -> (result, state)`` for one bucket.
      replicated_output: whether every device gets the same result. ``False``
        (no-op, local SGD) makes the step keep one copy of the train state per
        device, since replicas then diverge.
      vma_safe: whether the hook's collectives keep JAX's replicated/varying
        typing (``psum`` does; ``all_gather`` followed by a local reduction and
        grouped ``psum`` do not). ``False`` runs the step's ``shard_map`` with
        ``check_vma=False``.
      reduce_scatter: the hook's reduce-scatter form, for ZeRO stages 2 and 3
        (keyword-only; see :func:`with_reduce_scatter`), or None.

    Two hooks are equal when all six fields are, so a step config holding a
    hook stays a valid ``jax.jit`` key.

    Example:
      >>> hook = CommHook("mine", stateless_init, lambda s, b: (list(b.gradients), s))
      >>> hook.name, hook.reduce_scatter is None
      ('mine', True)
    """

    __slots__ = ()

    def __new__(
        cls,
        name: str,
        init: InitFn,
        reduce: ReduceFn,
        replicated_output: bool = True,
        vma_safe: bool = True,
        *,
        reduce_scatter: ReduceFn | None = None,
    ) -> CommHook:
        return super().__new__(cls, name, init, reduce, replicated_output, vma_safe, reduce_scatter)


def with_reduce_scatter(hook: CommHook, reduce_scatter: ReduceFn) -> CommHook:
    """``hook`` with a reduce-scatter form, so ZeRO stages 2 and 3 accept it.

    ``reduce_scatter(state, bucket) -> (shares, state)`` returns one array per
    gradient: this device's share of the reduced value along
    ``bucket.shard_dims[i]`` (the whole reduced value where that is None), with
    the shapes ``bucket.shard_shapes()``. fdp's ``allreduce``, ``bf16_compress``
    and ``fp16_compress`` (and the compress wrappers of hooks that have one)
    come with theirs.

    Returns:
      A copy of ``hook`` whose ``reduce_scatter`` field is ``reduce_scatter``
      (``hook`` itself is left as it was: use the value returned).
    """
    return hook._replace(reduce_scatter=reduce_scatter)


def reduce_scatter_of(hook: CommHook) -> ReduceFn | None:
    """``hook``'s reduce-scatter form, or None when it has none."""
    return hook.reduce_scatter


def mean_all_reduce(
    values: Sequence[jax.Array],
    axis_name: AxisName,
    *,
    divide_first: bool = True,
    groups: list[list[int]] | None = None,
) -> list[jax.Array]:
    """Each array's mean over the data axis (or over its replica group), in torch's order.

    torch's hooks do not all divide at the same point. ``allreduce_hook``, the
    fp16/bf16 compression hooks and PowerSGD before ``start_powerSGD_iter`` divide
    each tensor by the group size, then sum (``default_hooks._allreduce_fut``, "to
    avoid overflow, especially for FP16"); fdp does the same. PowerSGD sums its
    uncompressed tensors and its Q matrices, then divides (``divide_first=False``),
    as torch does. Post-local SGD is fdp's one deliberate difference: torch divides
    first, fdp sums first, because inside its ``lax.cond`` dividing first makes XLA
    keep a divided copy of every bucket (measured: 13% more temp memory on an MLP);
    the two differ by rounding only.

    Args:
      values: this device's arrays.
      axis_name: the data axis.
      divide_first: divide before summing (see above).
      groups: replica groups of ``axis_name`` to average within (post-local SGD's
        subgroups); None for the whole axis.
    """
    if not values:
        return []
    size = len(groups[0]) if groups else axis_size(axis_name)

    def total(xs: list[jax.Array]) -> list[jax.Array]:
        if groups:
            return jax.lax.psum(xs, axis_name, axis_index_groups=groups)
        return sum_over(xs, axis_name)

    if divide_first:
        return total([v / jnp.asarray(size, v.dtype) for v in values])
    return [v / size for v in total(list(values))]


def bucket_key(index: int) -> str:
    """The combiner key of bucket ``index``'s collectives (its name in the HLO too)."""
    return f"fdp_bucket_{index}"


def grouped_mean_all_reduce(
    values: Sequence[jax.Array], axis_name: AxisName, key: str
) -> list[jax.Array]:
    """:func:`mean_all_reduce` of ``values``, each all-reduce tagged with combiner key ``key``.

    Under :func:`fdp._compat.group_gpu_all_reduces_by_key` XLA:GPU merges the
    tagged all-reduces into one collective of several operands, each reduced in
    place: DDP's one collective per bucket without copying the gradients into a
    flat buffer first.
    """
    return [_compat.tag_combiner_key(r, key) for r in mean_all_reduce(values, axis_name)]


def mean_reduce_scatter(
    values: Sequence[jax.Array],
    dims: Sequence[int | None],
    axis_name: AxisName,
    *,
    flat: bool = False,
    layout: P = WHOLE,
) -> list[jax.Array]:
    """Each array's mean over the data axis, this device's share along ``dims``.

    Divides first, then sums, as :func:`mean_all_reduce` does by default. Arrays
    whose dimension is None are all-reduced whole. With ``flat`` the scattered
    arrays travel as one buffer, laid out shard-major (FSDP's copy-in): each is
    viewed as ``[N, share]`` along its dimension and the views are concatenated,
    so one reduce-scatter of the buffer leaves each device exactly its share of
    every array. ``layout``: the arrays' split over the mesh's model axes (a
    bucket's :attr:`~fdp.bucketing.Bucket.layout`); each is then scattered on
    its block (:func:`fdp.collectives._blocks.on_blocks`), never packed.
    """
    n = axis_size(axis_name)
    out: list[Any] = [None] * len(values)
    whole = [i for i, d in enumerate(dims) if d is None]
    for i, r in zip(whole, mean_all_reduce([values[i] for i in whole], axis_name), strict=True):
        out[i] = r
    split = [(i, d) for i, d in enumerate(dims) if d is not None]
    if not split:
        return out
    parts = [(values[i] / jnp.asarray(n, values[i].dtype), d) for i, d in split]
    if not flat or len(layout):
        for (i, _), (v, d) in zip(split, parts, strict=True):
            scatter = functools.partial(
                jax.lax.psum_scatter, axis_name=axis_name, scatter_dimension=d, tiled=True
            )
            out[i] = on_blocks(scatter, layout)(v)
        return out
    rows = [jnp.moveaxis(v, d, 0).reshape(n, -1) for v, d in parts]
    mine = jax.lax.psum_scatter(
        jnp.concatenate(rows, axis=1), axis_name, scatter_dimension=0, tiled=True
    )[0]
    start = 0
    for (i, d), row in zip(split, rows, strict=True):
        width = row.shape[1]
        moved = jnp.moveaxis(values[i], d, 0).shape
        share = mine[start : start + width].reshape((moved[0] // n, *moved[1:]))
        out[i] = jnp.moveaxis(share, 0, d)
        start += width
    return out


def stateless_init(params: Any, plan: BucketPlan) -> HookState:
    """``init`` of a hook without state."""
    del params, plan
    return ()


def as_leaves(hook: CommHook, bucket: GradBucket, result: Any) -> list[jax.Array]:
    """Checks a hook's result and returns it as one array per gradient.

    Raises:
      TypeError: the result is neither a flat buffer nor a list of arrays.
      ValueError: shapes, dtypes or the number of arrays do not match the bucket.
    """
    want_leaves = ", ".join(f"{bucket.dtype}{list(s)}" for s in bucket.shapes)
    expected = (
        f"expected the flat buffer {bucket.dtype}[{bucket.size}] or one array per "
        f"gradient ({want_leaves})"
    )
    if isinstance(result, list | tuple):
        got = [jnp.result_type(r) for r in result]
        shapes = [tuple(jnp.shape(r)) for r in result]
        if len(result) != len(bucket.shapes) or any(
            s != w or d != bucket.dtype for s, w, d in zip(shapes, bucket.shapes, got, strict=False)
        ):
            listed = ", ".join(f"{d}{list(s)}" for d, s in zip(got, shapes, strict=True))
            raise ValueError(
                f"comm hook {hook.name!r} returned [{listed}] for bucket {bucket.index}; "
                f"{expected}."
            )
        return list(result)
    if not hasattr(result, "shape") or not hasattr(result, "dtype"):
        raise TypeError(
            f"comm hook {hook.name!r} returned {type(result).__name__} for bucket "
            f"{bucket.index}; {expected}."
        )
    if tuple(result.shape) != (bucket.size,) or np.dtype(result.dtype) != bucket.dtype:
        raise ValueError(
            f"comm hook {hook.name!r} returned {result.dtype}{list(result.shape)} for bucket "
            f"{bucket.index}; {expected}."
        )
    return bucket.unpack(result)


def as_shards(hook: CommHook, bucket: GradBucket, result: Any) -> list[jax.Array]:
    """Checks a hook's reduce-scatter result: one share per gradient, in order.

    Raises:
      ValueError: the number, shapes or dtypes of the shares do not match.
    """
    want = bucket.shard_shapes()
    shapes = [tuple(jnp.shape(r)) for r in result] if isinstance(result, list | tuple) else None
    if (
        shapes is None
        or shapes != list(want)
        or any(jnp.result_type(r) != bucket.dtype for r in result)
    ):
        expected = ", ".join(f"{bucket.dtype}{list(s)}" for s in want)
        raise ValueError(
            f"comm hook {hook.name!r}'s reduce_scatter returned {shapes!r} for bucket "
            f"{bucket.index}; expected one share per gradient: {expected}."
        )
    return list(result)
