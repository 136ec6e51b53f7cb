"""The comm-hook contract: a pure function of ``(state, bucket)``.

DDP's hooks take ``(state, bucket)`` and return a future of the reduced flat
buffer. fdp's functional form returns the reduced values and the new state:

    result, new_state = hook.reduce(state, bucket)

``result`` is either the reduced flat buffer (``bucket.size`` elements of
``bucket.dtype``) or one reduced array per gradient (shapes ``bucket.shapes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fdp.bucketing import Bucket, BucketPlan, pack, unpack
from fdp.collectives import axis_size, sum_over

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
    """

    def __init__(
        self,
        meta: Bucket,
        gradients: Sequence[jax.Array],
        *,
        is_last: bool,
        axis_name: str,
        layout: str = "leaves",
        parameters: Sequence[jax.Array] | None = None,
    ):
        self.meta = meta
        self.gradients = tuple(gradients)
        self.parameters = None if parameters is None else tuple(parameters)
        self.is_last = is_last
        self.axis_name = axis_name
        self.layout = layout

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
        return GradBucket(
            meta,
            [g.astype(dtype) for g in self.gradients],
            is_last=self.is_last,
            axis_name=self.axis_name,
            layout=self.layout,
            parameters=self.parameters,
        )


InitFn = Callable[[Any, BucketPlan], HookState]
ReduceFn = Callable[[HookState, GradBucket], tuple[Any, HookState]]


class CommHook(NamedTuple):
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
    """

    name: str
    init: InitFn
    reduce: ReduceFn
    replicated_output: bool = True
    vma_safe: bool = True


def mean_all_reduce(
    values: Sequence[jax.Array],
    axis_name: str,
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
