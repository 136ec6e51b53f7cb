"""ZeRO stage 3 with parameters gathered where they are used, and freed after.

At stage 3 each device holds ``1/N`` of every shardable parameter between steps.
Gathering all of them at the start of the step and keeping them for the backward
pass (:func:`fdp.step._zero.gather_params`) peaks as high as stage 1: every
parameter is whole on every device from the first layer's forward to the last
layer's backward. PyTorch FSDP2 (``reshard_after_forward=True``) and DeepSpeed
ZeRO-3 instead gather a layer's parameters just before it runs, free them after,
and gather them again for its backward pass.

fdp gets the same program from two JAX mechanisms, without touching the model:

- **Gathers inside the differentiated function.** The objective is called on
  the shards; each sharded leaf is all-gathered inside it (one collective per
  leaf: a DDP bucket of 25 MiB spans many layers). The transpose of an
  all-gather is a reduce-scatter, so ``jax.grad`` with respect to the shards
  hands back each gradient already summed over the data axis and cut to this
  device's share: it leaves the backward pass as a reduce-scatter as soon as
  its layer's backward is done, not after the whole backward pass.
- **A remat policy that never saves a gathered value.** The objective runs
  under ``jax.checkpoint`` with ``save_anything_except_these_names`` on the
  gathered parameters: every activation the backward pass needs is saved as
  usual, but a gathered parameter is not a residual, so the backward pass
  gathers it again from the shards where it needs it. Between its forward use
  and its backward use, a layer's parameters exist only as shards.

When each gather runs is the compiler's choice: each depends on the shards only,
and XLA's scheduler places it before its first consumer (the compiled programs
in tests/step/test_per_use.py and the peak memory in docs/zero.md show it).

The price: one more all-gather per leaf per micro-batch (the backward one), and
with ``accumulate_steps=K`` the gathers and reduce-scatters run in every
micro-batch (K times FSDP's bytes instead of once, as FSDP without
``no_sync``); the accumulated gradient is a share, ``1/N`` of stage 0's.

Limits: a layer stack under ``nn.scan``/``nnx.scan`` is one stacked parameter,
gathered whole at its first use (all layers at once) and saved per layer by
the scan, so a scanned model peaks as with :func:`gather_params`. Leaves kept
whole at stage 3 (no dimension divisible by ``N``) are not gathered; their
local gradients are all-reduced after the backward pass, bucket by bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fdp.bucketing import BucketPlan
from fdp.collectives._axis import AxisName
from fdp.hooks._bucketed import no_gradient
from fdp.hooks._contract import mean_all_reduce
from fdp.step._local_grads import Objective
from fdp.step._zero import gather

GATHERED = "fdp_gathered"


def gathered_where_used(params: Any, dims: Sequence[int | None], axis_name: AxisName) -> Any:
    """Inside ``shard_map`` and a remat: the whole parameters, one all-gather per leaf.

    One collective per leaf, not per bucket: a bucket (25 MiB by default) spans
    many layers, and a packed bucket is whole as soon as any of its leaves is
    needed, which brings back the peak this mode removes. Every gathered leaf is
    named :data:`GATHERED`, so the remat policy of :func:`per_use_objective`
    never saves it for the backward pass.
    """
    leaves, treedef = jax.tree.flatten(params)
    out = [
        x if d is None else checkpoint_name(gather([x], [d], axis_name)[0], GATHERED)
        for x, d in zip(leaves, dims, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def per_use_objective(
    objective: Objective, dims: Sequence[int | None], axis_name: AxisName
) -> Objective:
    """``objective`` taking stage 3's shards: gathers inside, gathered values never saved.

    Its gradient with respect to a sharded leaf is the *sum* over the data axis
    of the local gradients, this device's share (the all-gather's transpose);
    :func:`finish_gradients` turns it into the mean.
    """
    policy = jax.checkpoint_policies.save_anything_except_these_names(GATHERED)

    def run(shards: Any, micro: Any, carry: Any, key: Any) -> tuple[Any, Any, Any]:
        whole = gathered_where_used(shards, dims, axis_name)
        loss, aux, new_carry = objective(whole, micro, carry, key)
        # A remat's outputs must be arrays: Python numbers in aux become arrays here.
        return loss, jax.tree.map(jnp.asarray, aux), new_carry

    return jax.checkpoint(run, policy=policy)


def finish_gradients(
    grads: Any, plan: BucketPlan, dims: Sequence[int | None], axis_name: AxisName, n: int
) -> Any:
    """The mean gradients, as the default hook's reduce-scatter gives them at stage 3.

    ``grads`` holds, per sharded leaf, this device's share of the sum over the
    data axis (reduce-scattered in the backward pass), and per leaf kept whole,
    this device's local gradient. Shares are divided by ``n`` (after the sum,
    where the hook divides before: the same values for ``n`` a power of two);
    whole leaves are all-reduced (mean) bucket by bucket; leaves in no bucket
    get zeros, as :func:`fdp.hooks.reduce_with_hook` gives them.
    """
    leaves, treedef = jax.tree.flatten(grads)
    out = [no_gradient(plan, i, dims[i], n) for i in range(len(leaves))]
    for bucket in plan.buckets:
        whole = [i for i in bucket.leaf_indices if dims[i] is None]
        with jax.named_scope(f"fdp_bucket_{bucket.index}"):
            reduced = mean_all_reduce([leaves[i] for i in whole], axis_name)
            for i, x in zip(whole, reduced, strict=True):
                out[i] = x
            for i in bucket.leaf_indices:
                if dims[i] is not None:
                    out[i] = leaves[i] / jnp.asarray(n, leaves[i].dtype)
    return jax.tree.unflatten(treedef, out)
