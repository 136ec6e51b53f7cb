"""The bucketed reduction: a comm hook run over every bucket, and DDP's mean of them."""

from __future__ import annotations

import contextvars
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp.bucketing import Bucket, BucketPlan, check_tree, has_gradient, plan_for
from fdp.bucketing._plan import WHOLE
from fdp.collectives import axis_size, is_varying
from fdp.collectives._axis import AxisName
from fdp.collectives._blocks import on_blocks
from fdp.hooks._contract import (
    CommHook,
    GradBucket,
    HookState,
    Layout,
    ReduceFn,
    as_leaves,
    as_shards,
    check_layout,
)


@dataclasses.dataclass
class ReductionTrace:
    """What the bucketed reduction saw while :func:`fdp.ddp` traced a step.

    Attributes:
      typing_only: the trace only reads which outputs are replicated: the
        gradients come in already summed by ``jax.grad`` and pass unchanged.
      calls: how many times :func:`reduce_with_hook` (which
        :func:`reduce_gradients` calls) ran in the trace.
    """

    typing_only: bool = False
    calls: int = 0


# Set by fdp.ddp around its traces of the user's step; None elsewhere. A context
# variable, not an argument, on purpose: fdp.ddp calls the user's function, and the
# user's function calls fdp.reduce_gradients(grads) with no argument of fdp.ddp's
# to pass on (the adoption path is one added line). Only a value that reaches through
# the user's code can tell reduce_gradients that this trace is ddp's typing pass
# (where jax.grad has already summed the gradients, which would otherwise read as the
# double-reduction mistake) and count its calls.
REDUCTION_TRACE: contextvars.ContextVar[ReductionTrace | None] = contextvars.ContextVar(
    "fdp_reduction_trace", default=None
)


def check_not_reduced(leaves: list[Any], plan: BucketPlan, axis_name: AxisName) -> None:
    """Raises if bucketed gradients are already reduced over ``axis_name``.

    Inside ``shard_map`` with ``check_vma=True``, ``jax.grad`` with respect to
    replicated parameters sums the cotangents over the axis by itself; reducing
    again would scale the gradient by the axis size.
    """
    for bucket in plan.buckets:
        for i, path in zip(bucket.leaf_indices, bucket.key_paths, strict=True):
            if is_varying(leaves[i], axis_name) is False:
                raise ValueError(
                    f"gradient {path or 'grads'} is already reduced over {axis_name!r}: it was "
                    "taken with respect to parameters replicated over that axis, so "
                    "jax.grad summed it across devices. Reducing it again would multiply "
                    "it by the axis size. Before jax.grad, make the parameters per-device "
                    f"with jax.lax.pcast(params, {axis_name!r}, to='varying') (what "
                    "fdp.train_step does), or run the shard_map with check_vma=False."
                )


def no_gradient(plan: BucketPlan, i: int, dim: int | None, n: int) -> Any:
    """What leaf ``i`` of ``plan`` gets when it is in no bucket (its share with ``dim``)."""
    shape, dtype = plan.leaf_shapes[i], plan.leaf_dtypes[i]
    if dim is not None:
        shape = tuple(s // n if k == dim else s for k, s in enumerate(shape))
    if has_gradient(dtype):
        return jnp.zeros(shape, dtype)
    return np.zeros(shape, jax.dtypes.float0)


def block_bucket(bucket: Bucket, shapes: list[tuple[int, ...]]) -> Bucket:
    """``bucket`` as one device's blocks of its gradients (``shapes``), whole on every axis.

    Example:
      >>> b = Bucket(0, np.dtype("float32"), (0, 1), ((4, 8), (8,)), (0, 32), (32, 8),
      ...            ("w", "b"), layout=jax.P(None, "model"))
      >>> block_bucket(b, [(4, 4), (8,)]).offsets
      (0, 16)
    """
    sizes = tuple(math.prod(s) for s in shapes)
    offsets = tuple(int(o) for o in np.cumsum((0, *sizes[:-1])))
    return dataclasses.replace(
        bucket, shapes=tuple(shapes), sizes=sizes, offsets=offsets, layout=WHOLE
    )


def reduce_on_blocks(
    hook: CommHook,
    bucket: GradBucket,
    state: HookState,
    model_axes: tuple[str, ...],
    scatter: ReduceFn | None = None,
) -> tuple[list[jax.Array], HookState]:
    """A stateless hook's reduction of ``bucket`` on each device's blocks of it.

    Run manual over the mesh's ``model_axes`` too: the hook sees a bucket of this
    device's blocks, whole, and packs, compresses or reduces (``scatter``: its
    reduce-scatter form, ZeRO) them over the data axis as it would a bucket of
    whole gradients (DDP over a tensor-parallel model holds each rank's local
    shards). Left to XLA's partitioner, a hook's packing or casting of model-split
    gradients gathered them over the model axis first, and XLA:CPU aborted on a
    bfloat16 all-reduce of any gradient there ("Invalid binary instruction opcode
    copy", jax 0.10.2 and 0.12.0.1).
    """
    layout = bucket.meta.layout

    def reduce(gradients: list[jax.Array], parameters: list[jax.Array] | None) -> list[Any]:
        meta = block_bucket(bucket.meta, [tuple(g.shape) for g in gradients])
        block = bucket.with_gradients(meta, gradients, parameters=parameters, after=None)
        result, kept = (scatter or hook.reduce)(state, block)
        if jax.tree.leaves(kept):
            raise ValueError(f"comm hook {hook.name!r} returned state from a stateless init.")
        return as_leaves(hook, block, result) if scatter is None else as_shards(hook, block, result)

    params = None if bucket.parameters is None else list(bucket.parameters)
    blocks = on_blocks(lambda args: reduce(*args), layout, model_axes)
    return blocks((list(bucket.gradients), params)), state


def reduce_with_hook(
    hook: CommHook,
    state: HookState,
    grads: Any,
    *,
    axis_name: AxisName = "data",
    plan: BucketPlan | None = None,
    layout: Layout = "leaves",
    params: Any = None,
    shard_dims: tuple[int | None, ...] | None = None,
    grouped: bool = False,
    model_axes: tuple[str, ...] = (),
) -> tuple[Any, HookState]:
    """Reduces per-device gradients bucket by bucket with ``hook``.

    Buckets are handed to the hook in bucket-index order; the last one has
    ``is_last=True``. Call it inside ``jax.shard_map`` (or ``jax.pmap``).

    Args:
      hook: the comm hook.
      state: the hook's state for this device (from ``hook.init``).
      grads: this device's gradients (see :func:`fdp.reduce_gradients`).
      axis_name: the data axis.
      plan: the bucket plan; built from ``grads`` with DDP's default caps when
        omitted.
      layout: the step's layout, passed to the hook in each bucket.
      params: the parameters, exposed to the hook as ``bucket.parameters``.
      shard_dims: ZeRO stages 2 and 3: per leaf, the dimension to scatter the
        reduced gradient along (None: whole). The hook's ``reduce_scatter``
        runs instead of ``reduce``, and each device gets its share.
      grouped: with ``layout='flat'``, the compiler merges each bucket's tagged
        collectives into one (``GradBucket.grouped``; fdp's steps set it on
        GPUs with the default hook, with the compiler options that do it).
      model_axes: the mesh's axes besides the data axis (tensor parallelism).
        A stateless hook then reduces each bucket on each device's blocks
        (:func:`reduce_on_blocks`); a stateful one, whose state has the
        buckets' whole shapes, reduces a model-split bucket's gradients where
        they lie, unpacked.

    Returns:
      ``(reduced_grads, new_state)``. Leaves in no bucket come back as zeros
      (float0 for integer and bool leaves), shares of zeros with ``shard_dims``.

    Raises:
      ValueError: the gradients are already reduced (the double-reduction
        trap), do not match the plan, or the hook returns the wrong shape/dtype.
    """
    trace = REDUCTION_TRACE.get()
    if trace is not None:  # under fdp.ddp
        trace.calls += 1
        if trace.typing_only:  # gradients already summed by jax.grad: only types matter
            return grads, state
    n = axis_size(axis_name)
    check_layout(layout)
    plan = plan_for(grads) if plan is None else plan
    leaves = check_tree(plan, grads, "grads")
    check_not_reduced(leaves, plan, axis_name)
    param_leaves = None if params is None else jax.tree.leaves(params)
    scatter = None if shard_dims is None else hook.reduce_scatter
    if shard_dims is not None and scatter is None:
        raise ValueError(
            f"comm hook {hook.name!r} has no reduce-scatter form (ZeRO stages 2 and 3); "
            "see fdp.hooks.with_reduce_scatter."
        )
    dims = shard_dims if shard_dims is not None else (None,) * len(leaves)
    # Leaves in no bucket get no gradient: zeros (float0 for integer leaves, as
    # jax.grad gives them), constants and so replicated by nature.
    out = [no_gradient(plan, i, dims[i], n) for i in range(len(leaves))]
    last = len(plan.buckets) - 1
    largest = max((b.nbytes for b in plan.buckets), default=0)
    after = None  # the previous bucket's reduced gradients: each bucket comes after it
    stateless = not jax.tree.leaves(state)
    for bucket in plan.buckets:  # launched in bucket-index order, as DDP requires
        # On a mesh with model axes a stateless hook runs on each device's blocks
        # (packing, casting and grouping them there); a stateful hook's state has the
        # buckets' whole shapes, so it reduces a model-split bucket's gradients where
        # they lie, never packed (packing would gather them whole over that axis first).
        split = len(bucket.layout) > 0
        blocks = bool(model_axes) and stateless
        grad_bucket = GradBucket(
            bucket,
            [leaves[i] for i in bucket.leaf_indices],
            is_last=bucket.index == last,
            axis_name=axis_name,
            layout="leaves" if split and not blocks else layout,
            parameters=None
            if param_leaves is None
            else [param_leaves[i] for i in bucket.leaf_indices],
            shard_dims=None if scatter is None else [dims[i] for i in bucket.leaf_indices],
            grouped=grouped,
            after=after,
            largest_nbytes=largest,
        )
        with jax.named_scope(f"fdp_bucket_{bucket.index}"):
            if blocks:
                reduced, state = reduce_on_blocks(hook, grad_bucket, state, model_axes, scatter)
            elif scatter is not None:
                result, state = scatter(state, grad_bucket)
                reduced = as_shards(hook, grad_bucket, result)
            else:
                result, state = hook.reduce(state, grad_bucket)
                reduced = as_leaves(hook, grad_bucket, result)
        for i, leaf in zip(bucket.leaf_indices, reduced, strict=True):
            out[i] = leaf
        after = reduced
    return jax.tree.unflatten(plan.treedef, out), state
