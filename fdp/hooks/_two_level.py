"""Hierarchical reduction on a host x device mesh (Horovod's hierarchical all-reduce).

Per bucket, with the data axis ``(outer, inner)`` (hosts, each host's ``k``
devices):

1. reduce-scatter over ``inner``: each device gets the sum of its host's
   buckets over a ``1/k`` share (fast links inside the host);
2. all-reduce that share over ``outer`` (the slow links between hosts), with
   any comm hook: compression pays off here, where bytes cost;
3. all-gather over ``inner``: every device has the whole reduced bucket.

The bytes crossing hosts per device are ``1/k`` of a flat all-reduce's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fdp.bucketing import Bucket, BucketPlan
from fdp.collectives import axis_size
from fdp.hooks._contract import CommHook, GradBucket, HookState, as_leaves
from fdp.hooks._registry import resolve


def split_axis(axis_name: Any, what: str) -> tuple[str, str]:
    """``(outer, inner)`` of a host x device data axis, or an error saying how to get one."""
    if isinstance(axis_name, tuple) and len(axis_name) == 2:
        return axis_name[0], axis_name[1]
    raise ValueError(
        f"{what} needs a host x device data axis, axis_name=(outer, inner); got "
        f"axis_name={axis_name!r}. Build the mesh with fdp.data_mesh(axis_name=fdp.HOST_AXES) "
        "and pass the same axis_name to the step."
    )


def share_bucket(bucket: Bucket, k: int, size: int | None = None) -> Bucket:
    """The 1-D share of ``bucket`` each device of a host reduces over the outer axis.

    ``size``: its elements; by default ``ceil(bucket.size / k)``, a slice of the
    flat bucket (hybrid sharding passes the sum of its leaves' shares).
    """
    size = math.ceil(bucket.size / k) if size is None else size
    return dataclasses.replace(
        bucket,
        leaf_indices=(bucket.index,),
        shapes=((size,),),
        offsets=(0,),
        sizes=(size,),
        key_paths=(f"<bucket {bucket.index}: share 1/{k}>",),
    )


def share_plan(plan: BucketPlan, k: int, sizes: Sequence[int] | None = None) -> BucketPlan:
    """``plan`` with every bucket replaced by its ``1/k`` share (one 1-D leaf each).

    ``sizes``: per bucket, the share's elements (default: see :func:`_share`).
    """
    each: list[int | None] = [None] * len(plan.buckets) if sizes is None else list(sizes)
    buckets = tuple(share_bucket(b, k, size) for b, size in zip(plan.buckets, each, strict=True))
    return dataclasses.replace(
        plan,
        buckets=buckets,
        treedef=jax.tree.structure([0] * len(buckets)),
        leaf_shapes=tuple(b.shapes[0] for b in buckets),
        leaf_dtypes=tuple(b.dtype for b in buckets),
        leaf_key_paths=tuple(b.key_paths[0] for b in buckets),
        excluded=(),
    )


@functools.cache
def hierarchical(
    outer_hook: CommHook | str | None = None, *, inner_size: int | None = None
) -> CommHook:
    """Reduce-scatter inside hosts, ``outer_hook`` across hosts, all-gather inside hosts.

    ``fdp.train_step(..., axis_name=("host", "device"),
    reduction=fdp.Reduction(hierarchical=True))``
    builds it with the step's ``comm_hook`` as ``outer_hook``. The result is
    the mean over both axes, equal to the flat all-reduce's up to float
    rounding.

    Args:
      outer_hook: the hook for the hop between hosts (a hook, a hook's name,
        or None for the mean all-reduce), e.g. ``"bf16_compress"`` or
        :func:`fdp.hooks.compressed_allreduce`. It sees each bucket's share as
        a one-gradient flat bucket on the outer axis. Hooks whose replicas
        diverge (noop, local SGD) are refused.
      inner_size: devices per host; only needed when ``outer_hook`` keeps
        state (it is sized to the shares). The step passes it.

    Returns:
      The hook.

    Raises:
      ValueError: ``outer_hook`` lets replicas diverge.

    Example:
      >>> hierarchical("bf16_compress").name
      'hierarchical(bf16_compress)'
    """
    outer = resolve(outer_hook)
    if not outer.replicated_output:
        raise ValueError(
            f"hierarchical(outer_hook={outer.name!r}): the hop between hosts must give "
            "every device the same result; this hook lets replicas diverge."
        )

    def init(params: Any, plan: BucketPlan) -> HookState:
        if inner_size is None:
            state = jax.eval_shape(lambda: outer.init(params, plan))
            if jax.tree.leaves(state):
                raise ValueError(
                    f"hierarchical(outer_hook={outer.name!r}) keeps state sized to each "
                    "bucket's share, so it needs inner_size= (devices per host); "
                    "fdp.Reduction(hierarchical=True) passes it."
                )
            return outer.init(params, plan)
        shares = share_plan(plan, inner_size)
        return outer.init(shares.leaf_structs(), shares)

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        outer_axis, inner_axis = split_axis(bucket.axis_name, f"hook {name!r}")
        k = axis_size(inner_axis)
        if inner_size is not None and inner_size != k:
            raise ValueError(
                f"hierarchical(inner_size={inner_size}) was built for {inner_size} devices "
                f"per host, but axis {inner_axis!r} has {k}."
            )
        x = bucket.buffer
        meta = share_bucket(bucket.meta, k)
        padded = jnp.pad(x, (0, meta.size * k - bucket.size))
        # Divide by k first (torch's order); the outer hook divides by the hosts.
        share = jax.lax.psum_scatter(padded / jnp.asarray(k, x.dtype), inner_axis, tiled=True)
        hop = GradBucket(
            meta,
            [share],
            is_last=bucket.is_last,
            axis_name=outer_axis,
            layout="flat",
            after=bucket.after,
            largest_nbytes=bucket.largest_nbytes,
        )
        result, state = outer.reduce(state, hop)
        reduced = as_leaves(outer, hop, result)[0]
        # 'invarying': every device of the host ends with the same bucket.
        whole = jax.lax.all_gather(reduced, inner_axis, tiled=True, to="invarying")
        return whole[: bucket.size], state

    name = "hierarchical" if outer.name == "allreduce" else f"hierarchical({outer.name})"
    return CommHook(name, init, reduce, vma_safe=outer.vma_safe)
