"""Hybrid sharding (HSDP, ZeRO++'s hpZ): ZeRO inside each host, replicas across hosts.

With ``sharding=fdp.Sharding(zero_stage=..., shard_over="inner")`` on a host x
device data axis ``(outer, inner)``, stages 1-3 shard over the inner axis only:
each host's ``k`` devices hold ``1/k`` of every leaf that ``k`` divides (ZeRO's
rule, :func:`fdp.step.layout._zero.shard_dim` with ``k``), and every host holds the same
shares. Per bucket the gradients travel as in :func:`fdp.hooks.hierarchical`
(Horovod's hierarchical all-reduce), less its last hop:

1. reduce-scatter over ``inner`` (the fast links inside a host): each device gets
   its host's mean of its share of each leaf, along the leaf's shard dimension;
2. all-reduce of those shares over ``outer`` (the slow links between hosts) with
   the step's comm hook, as one flat buffer per bucket: the hop the hierarchical
   hook runs, so ``"bf16_compress"`` or an int8 hook applies there only;
3. nothing more: a device's share is what its update reads. (The hierarchical
   hook's all-gather inside the host is left to the update at stages 1-2, which
   gathers the new parameters, and to the next step's gathers at stage 3.)

The bytes crossing hosts per device are ``1/k`` of each bucket, as with the
hierarchical hook. Leaves kept whole (no dimension divisible by ``k``) are
averaged over both axes by one plain all-reduce, outside the hook: they hold no
share to cross hosts with, and are a bias's worth of bytes.

At stage 3 with parameters gathered where they are used (:mod:`fdp.step.grads._per_use`)
step 1 happens in the backward pass (the inner all-gather's transpose sums the
gradient over the host); :func:`reduce_hybrid` then divides and runs step 2.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp

from fdp.bucketing import Bucket, BucketPlan, check_tree
from fdp.collectives import axis_size
from fdp.collectives._axis import AxisName
from fdp.hooks._bucketed import check_not_reduced, no_gradient
from fdp.hooks._contract import (
    CommHook,
    GradBucket,
    HookState,
    as_leaves,
    mean_all_reduce,
    mean_reduce_scatter,
)
from fdp.hooks._two_level import share_bucket, share_plan, split_axis
from fdp.step.layout._padding import taken_dims
from fdp.step.layout._zero import bucket_shard_dims, shard_dim

WHAT = "shard_over='inner'"


def share_sizes(plan: BucketPlan, dims: Sequence[int | None], k: int) -> tuple[int, ...]:
    """Per bucket of ``plan``, the elements of one device's shares (whole leaves left out)."""
    return tuple(
        sum(math.prod(plan.leaf_shapes[i]) // k for i in b.leaf_indices if dims[i] is not None)
        for b in plan.buckets
    )


def hop_plan(plan: BucketPlan, k: int) -> BucketPlan:
    """``plan`` as the outer hook sees it: per bucket one flat buffer of a device's shares."""
    return share_plan(plan, k, share_sizes(plan, bucket_shard_dims(plan, k), k))


def _across_hosts(
    outer: CommHook,
    state: HookState,
    shares: list[jax.Array],
    hop: Bucket,
    *,
    is_last: bool,
    outer_axis: str,
) -> tuple[list[jax.Array], HookState]:
    """Step 2: a bucket's shares (already the host's mean) averaged over the hosts by ``outer``."""
    if not shares:
        return [], state
    flat = jnp.concatenate([jnp.ravel(s) for s in shares]) if len(shares) > 1 else shares[0]
    bucket = GradBucket(
        hop, [jnp.ravel(flat)], is_last=is_last, axis_name=outer_axis, layout="flat"
    )
    result, state = outer.reduce(state, bucket)
    reduced = as_leaves(outer, bucket, result)[0]
    out, start = [], 0
    for s in shares:
        out.append(reduced[start : start + s.size].reshape(s.shape))
        start += s.size
    return out, state


def reduce_hybrid(
    outer: CommHook,
    state: HookState,
    grads: Any,
    *,
    plan: BucketPlan,
    dims: Sequence[int | None],
    axis_name: AxisName,
    layout: str = "leaves",
    summed: bool = False,
) -> tuple[Any, HookState]:
    """Inside the step's shard_map: this device's share of the mean of per-device ``grads``.

    Buckets are reduced in index order; per bucket, leaves kept whole are
    averaged over both axes, and the shares go through steps 1 and 2.

    Args:
      outer: the comm hook for the hop between hosts (the step's ``comm_hook``).
      state: its state, shaped by :func:`hop_plan` (``hybrid(outer, ...).init``).
      grads: this device's local gradients; with ``summed``, per sharded leaf
        its share summed over the host already (stage 3's per-use gathers: the
        inner all-gather's transpose).
      plan: the bucket plan.
      dims: per leaf, its shard dimension over the inner axis (None: kept whole).
      axis_name: ``(outer, inner)``.
      layout: ``'flat'`` reduce-scatters each bucket as one shard-major buffer.
      summed: whether step 1 happened in the backward pass (then the shares
        are only divided by ``k``).

    Returns:
      ``(shares, state)``: per leaf its share along ``dims`` (whole where None)
      of the mean over both axes.
    """
    outer_axis, inner_axis = split_axis(axis_name, WHAT)
    k = axis_size(inner_axis)
    if summed:  # shares already: the plan's shapes are the whole leaves'
        leaves = jax.tree.leaves(grads)
    else:
        leaves = check_tree(plan, grads, "grads")
        check_not_reduced(leaves, plan, axis_name)
    hops = share_plan(plan, k, share_sizes(plan, dims, k))
    out = [no_gradient(plan, i, dims[i], k) for i in range(len(leaves))]
    last = len(plan.buckets) - 1
    for bucket, hop in zip(plan.buckets, hops.buckets, strict=True):
        split = [i for i in bucket.leaf_indices if dims[i] is not None]
        whole = [i for i in bucket.leaf_indices if dims[i] is None]
        with jax.named_scope(f"fdp_bucket_{bucket.index}"):
            # Whole leaves: one mean over every device; they are no host's share.
            reduced = mean_all_reduce([leaves[i] for i in whole], axis_name)
            for i, x in zip(whole, reduced, strict=True):
                out[i] = x
            values = [leaves[i] for i in split]
            if summed:
                shares = [v / jnp.asarray(k, v.dtype) for v in values]
            else:  # step 1: the host's mean, this device's share
                flat = layout == "flat"
                shares = mean_reduce_scatter(
                    values, [dims[i] for i in split], inner_axis, flat=flat, layout=bucket.layout
                )
            shares, state = _across_hosts(
                outer, state, shares, hop, is_last=bucket.index == last, outer_axis=outer_axis
            )
        for i, x in zip(split, shares, strict=True):
            out[i] = x
    return jax.tree.unflatten(plan.treedef, out), state


@functools.cache
def hybrid(outer_hook: CommHook, *, inner_size: int) -> CommHook:
    """The comm hook of a hybrid-sharded step: ``outer_hook`` on the hop between hosts.

    Its ``init`` gives ``outer_hook``'s state for the shares that cross hosts
    (:func:`hop_plan`); the step reduces with :func:`reduce_hybrid`, which
    leaves each device its share. Its ``reduce`` is the same followed by an
    all-gather inside the host: the whole mean, as any comm hook gives it
    (what :func:`fdp.hooks.hierarchical` computes, with the shares cut along
    each leaf's shard dimension instead of the flat bucket).

    Args:
      outer_hook: a hook whose replicas agree (checked by the step).
      inner_size: devices per host (``k``).

    Example:
      >>> from fdp.hooks import allreduce
      >>> hybrid(allreduce(), inner_size=4).name
      'hybrid(allreduce)'
    """
    outer = outer_hook

    def init(params: Any, plan: BucketPlan) -> HookState:
        hops = hop_plan(plan, inner_size)
        return outer.init(hops.leaf_structs(), hops)

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        outer_axis, inner_axis = split_axis(bucket.axis_name, f"hook {name!r}")
        k = axis_size(inner_axis)
        dims = [shard_dim(shape, k, taken_dims(bucket.meta.layout)) for shape in bucket.shapes]
        out: list[Any] = list(bucket.gradients)
        split = [j for j, d in enumerate(dims) if d is not None]
        whole = [j for j, d in enumerate(dims) if d is None]
        for j, x in zip(
            whole, mean_all_reduce([out[j] for j in whole], bucket.axis_name), strict=True
        ):
            out[j] = x
        shares = mean_reduce_scatter(
            [out[j] for j in split], [dims[j] for j in split], inner_axis, layout=bucket.meta.layout
        )
        hop = share_bucket(bucket.meta, k, sum(s.size for s in shares))
        shares, state = _across_hosts(
            outer, state, shares, hop, is_last=bucket.is_last, outer_axis=outer_axis
        )
        for j, x in zip(split, shares, strict=True):
            # 'invarying': every device of the host ends with the same whole leaf.
            dim = cast(int, dims[j])
            out[j] = jax.lax.all_gather(x, inner_axis, axis=dim, tiled=True, to="invarying")
        return out, state

    name = f"hybrid({outer.name})"
    return CommHook(name, init, reduce, vma_safe=outer.vma_safe)
