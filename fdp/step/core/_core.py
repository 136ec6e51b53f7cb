"""The step's core, shared by the Linen and NNX steps: a pure function of arrays.

Per device, inside the step's ``shard_map``:

    params (gathered, ZeRO stage 3) -> per-device -> local gradients
    (micro-batches) -> bucketed reduction with the comm hook (reduce-scattered,
    ZeRO stages 2 and 3) -> "untouched" flags of unused parameters -> buffers
    made one again -> metrics reduced over the data axis, with the reduced
    gradient's global norm

Nothing here knows how the update is applied; the front ends differ only there
(``TrainState.apply_gradients`` in Linen, ``nnx.Optimizer.update`` in NNX).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fdp.backends import fold_leading_dims
from fdp.bucketing._plan import WHOLE
from fdp.collectives import axis_size, broadcast, is_varying, mean_over, sum_over, vary
from fdp.collectives._axis import AxisName
from fdp.hooks import reduce_with_hook
from fdp.hooks._contract import bucket_key
from fdp.step.core._plan import StepPlan
from fdp.step.grads import _finite as finite
from fdp.step.grads._keys import per_device
from fdp.step.grads._local_grads import LossWeights, Objective, local_gradients
from fdp.step.grads._mixed import cast_floats, compute_in, master_gradients
from fdp.step.grads._norm import global_norm
from fdp.step.grads._per_use import finish_gradients, per_use_objective
from fdp.step.grads._scanned import reduced_in_loop, scattered_in_loop, shares
from fdp.step.grads._usage import untouched_flags
from fdp.step.layout._hybrid import reduce_hybrid
from fdp.step.layout._zero import bucket_shard_dims, gather_params
from fdp.step.options._config import StepConfig


class Reduced(NamedTuple):
    """What the core computed on one device.

    Attributes:
      grads: the reduced gradients (like the parameters; with ZeRO stages 2
        and 3, this device's share of each).
      buffers: the state carried through the micro-batches (batch statistics),
        made one again as ``config.buffers`` says; None without buffers.
      hook_state: the comm hook's new state on this device.
      keep: per parameter leaf, whether the update must leave it (and its
        optimizer state) untouched: ``True``, ``False`` or a traced bool; None
        when no leaf is kept.
      metrics: ``({"loss": ..., "aux": ...}, gathered)`` over the whole batch,
        with ``"grad_norm"`` when the reduction policy asks for it
        (:mod:`fdp.step.grads._norm`): see
        :func:`reduce_metrics`; :func:`join_metrics` makes it one.
    """

    grads: Any
    buffers: Any
    hook_state: Any
    keep: tuple[Any, ...] | None
    metrics: tuple[dict[str, Any], tuple[Any, ...]]


def sync_buffers(buffers: Any, mode: Any, axis_name: AxisName) -> Any:
    """Buffers changed per device by the forward pass, made one again.

    ``'broadcast'``: device 0's values (DDP's ``broadcast_buffers=True``).
    ``'mean'``: floating buffers averaged over the data axis (integer ones from
    device 0). ``'local'``: left as they are, one per device. A function:
    ``mode(buffers, axis_name)`` (DDP's buffer comm hook).
    """
    if callable(mode):
        return mode(buffers, axis_name)
    if mode == "local" or axis_size(axis_name) == 1:
        return buffers

    def leaf(x: Any) -> Any:
        # Only values known to be replicated are left alone: without replication
        # tracking (check_vma=False) nothing is known, and everything is synced.
        if is_varying(x, axis_name) is False:
            return x
        if mode == "mean" and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return jax.lax.pmean(x, axis_name)
        return broadcast(x, 0, axis_name=axis_name)

    return jax.tree.map(leaf, buffers)


def reduce_leaf(x: Any, axis_name: AxisName) -> jax.Array:
    """A value that differs per device, made one: floats averaged, integers and bools summed.

    The rule for every metric fdp returns (``aux``, ``fdp.ddp``'s outputs):
    a count adds up over the devices, a mean loss or accuracy is averaged.
    """
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return mean_over(x, axis_name)
    return sum_over(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, axis_name)


def _per_device(params: Any, replicated: tuple[int, ...], axis_name: AxisName) -> Any:
    """``params`` made per-device for ``jax.grad``, but for the leaves ``replicated``."""
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(
        treedef,
        [x if i in replicated else vary(x, axis_name) for i, x in enumerate(leaves)],
    )


def reduce_metrics(
    loss: jax.Array, aux: Any, axis_name: AxisName, rows: tuple[bool, ...] = ()
) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The loss (already reduced) and aux averaged over the data axis.

    Integer and bool aux leaves are summed: counts add up. Leaves with one row
    per example (``rows``) are not reduced: they leave the step's shard_map
    gathered along the batch (out spec ``P(axis)``, :data:`METRICS_SPECS`).

    Returns:
      ``(metrics, gathered)``: ``gathered`` has one entry per aux leaf, the
      per-example leaf or None; in ``metrics['aux']`` those leaves are empty
      placeholders until :func:`join_metrics` puts them back.
    """
    metrics = {"loss": loss}
    gathered: tuple[Any, ...] = ()
    if aux is not None:
        leaves, treedef = jax.tree.flatten(aux)
        rows = rows or (False,) * len(leaves)
        gathered = tuple(x if r else None for x, r in zip(leaves, rows, strict=True))
        reduced = [
            jnp.zeros((0,), jnp.result_type(x)) if r else reduce_leaf(x, axis_name)
            for x, r in zip(leaves, rows, strict=True)
        ]
        metrics["aux"] = jax.tree.unflatten(treedef, reduced)
    return metrics, gathered


def metrics_specs(axis_name: AxisName) -> tuple[Any, Any]:
    """The out spec of :func:`reduce_metrics`'s pair: reduced replicated, rows gathered."""
    return P(), P(axis_name)


def join_metrics(pair: tuple[dict[str, Any], tuple[Any, ...]], size: int) -> dict[str, Any]:
    """Outside the shard_map: the gathered per-example aux leaves put back, padding cut."""
    metrics, gathered = pair
    if not any(g is not None for g in gathered):
        return metrics
    leaves, treedef = jax.tree.flatten(metrics["aux"])
    leaves = [x if g is None else g[:size] for x, g in zip(leaves, gathered, strict=True)]
    return {**metrics, "aux": jax.tree.unflatten(treedef, leaves)}


def reduce_step(
    objective: Objective,
    params: Any,
    buffers: Any,
    hook_state: Any,
    batch: Any,
    mask: jax.Array | None,
    rng: jax.Array | None,
    *,
    config: StepConfig,
    plan: StepPlan,
) -> Reduced:
    """One device's share of a step, up to (not including) the update.

    Args:
      objective: ``objective(params, micro_batch, buffers, key) -> (loss, aux,
        new_buffers)`` for one micro-batch.
      params: this device's parameters (replicated or per-device; its shares
        of them with ZeRO stage 3).
      buffers: state threaded through the micro-batches, or None.
      hook_state: the comm hook's state on this device (``()`` if stateless).
      batch: this device's share of the batch.
      mask: its per-example weights (``per_example=True``), else None.
      rng: the step's key (folded per device here), or None.
      config: the bound step config.
      plan: the step plan for these shapes.

    Returns:
      A :class:`Reduced`.
    """
    axis = config.axis_name
    tracked = config.find_unused_parameters
    n = config.num_replicas
    # ZeRO's shards: over the data axis, or over each host's devices (HSDP).
    shard, k = config.shard_axis, config.num_shards
    # A loss with nothing to fold (its dense layers in a scan) is left alone.
    objective = fold_leading_dims(objective) if plan.folds and plan.folds.folded else objective
    per_use = config.gathers_per_use
    dims = bucket_shard_dims(plan.buckets, k)
    low, master = config.sharding.param_dtype, params  # mixed precision: fdp.step.grads._mixed
    if per_use:  # gathered inside the forward and again in the backward pass
        inner = objective if low is None else compute_in(objective, low)
        objective = per_use_objective(
            inner,
            dims,
            shard,
            ahead=config.prefetch_groups,
            group_bytes=config.gather_group_bytes,
            gather_dtype=low,
            layouts=plan.buckets.leaf_layouts,
            # Ties that read one element of a model-split activation cost an
            # all-reduce over the model axis each; a barrier reads none.
            barriers=config.on_gpu and any(lay != WHOLE for lay in plan.buckets.leaf_layouts),
        )
    elif config.zero_stage >= 3:  # gathered once, kept until the backward pass is done
        params = gather_params(
            params if low is None else cast_floats(params, low), plan.buckets, shard, k
        )
    elif low is not None:  # whole: cast where the loss reads them
        objective = compute_in(objective, low)
    # Layer stacks, reduced in the backward loop: all-reduced at stage 0; at stages 1-2
    # reduce-scattered, where split along a later axis than the layer axis.
    in_loop = plan.scanned
    scattered: dict[int, int] = {}  # stages 1-2: leaf -> the dimension it is split along
    if in_loop and config.scatters_gradients:
        scattered = {i: d for i in in_loop if (d := dims[i])}
        leaves = jax.tree.leaves(params)
        wholes = {i: leaves[i] for i in scattered}
        layouts = plan.buckets.leaf_layouts
        objective, in_loop = scattered_in_loop(objective, wholes, scattered, axis, layouts), ()
        inputs = shares(params, scattered, axis)
    else:
        if in_loop:
            objective = reduced_in_loop(objective, in_loop, axis)
        inputs = _per_device(params, in_loop, axis)

    def reduce_buckets(grads: Any) -> tuple[Any, Any]:  # DDP's bucketed reduction
        return reduce_with_hook(
            config.hook,
            hook_state,
            grads,
            axis_name=axis,
            plan=plan.buckets,
            layout=config.bound_layout,
            params=params,
            shard_dims=dims if config.scatters_gradients else None,
            grouped=config.groups_buckets,
            model_axes=config.model_axes,
        )

    def finish(sums: list[Any]) -> list[Any]:
        # Beside the last backward pass (plan.last_in_loop): the mean hook, no state.
        summed = jax.tree.unflatten(jax.tree.structure(params), sums)
        return jax.tree.leaves(reduce_buckets(summed)[0])

    out = local_gradients(
        objective,
        inputs,
        batch,
        buffers,
        axis_name=axis,
        accumulate_steps=config.accumulate_steps,
        accum_dtype=config.accum_dtype,
        per_example=config.per_example,
        tokens=config.loss.normalize == "tokens",
        weights=LossWeights.of(config),
        mask=mask,
        rng=per_device(rng, axis),
        track=plan.usage.conditional if tracked else (),
        gather_aux=config.gather_aux,
        hold_last=plan.last_in_loop or config.holds_last_micro_batch,
        last_after_loop=config.on_gpu,
        finish=finish if plan.last_in_loop else None,
    )
    # Gradients of parameters cast for compute return to the master dtypes.
    local = out.grads if low is None else master_gradients(out.grads, master)
    loss_key = None  # the combiner key the loss's all-reduce joins (GPU, grouped buckets)
    if config.hybrid:  # inside each host (in the backward pass, per use), then across hosts
        grads, hook_state = reduce_hybrid(
            config.comm_hook,
            hook_state,
            local,
            plan=plan.buckets,
            dims=dims,
            axis_name=axis,
            layout=config.bound_layout,
            summed=per_use,
        )
    elif per_use:  # reduce-scattered in the backward pass already
        split = frozenset(i for i, d in enumerate(dims) if d is not None)
        grads = finish_gradients(out.grads, plan.buckets, dims, split, axis)
    elif scattered:  # stacks reduce-scattered in the backward loop; the rest per bucket
        flat = config.bound_layout == "flat"
        grads = finish_gradients(
            out.grads, plan.buckets, dims, frozenset(scattered), axis, flat=flat
        )
    elif plan.last_in_loop:  # reduced with the last micro-batch
        grads = local
    elif in_loop:  # summed in the backward loop already; the rest all-reduced as usual
        whole = (None,) * len(dims)
        grads = finish_gradients(out.grads, plan.buckets, whole, frozenset(in_loop), axis)
    else:
        grads, hook_state = reduce_buckets(local)
        if config.groups_buckets and plan.buckets.buckets:  # one collective fewer
            loss_key = bucket_key(plan.buckets.buckets[-1].index)
    keep = None
    if tracked and (plan.usage.unused or plan.usage.conditional):
        keep = tuple(untouched_flags(plan.usage, out.used, axis))
    metrics = reduce_metrics(
        out.global_loss(axis, combine_with=loss_key, model_axes=config.model_axes),
        out.aux,
        axis,
        out.aux_rows,
    )
    if config.reduction.grad_norm:  # each device may hold its share of split leaves
        shared = per_use or config.scatters_gradients
        metrics[0]["grad_norm"] = global_norm(grads, dims if shared else None, shard)
    if finite.enabled():  # FDP_CHECK_FINITE=1: each device's loss and gradients, tested
        metrics[0][finite.KEY] = finite.codes(out.loss, out.grads, axis, n)
    return Reduced(
        grads,
        sync_buffers(out.carry, config.buffers, axis),
        hook_state,
        keep,
        metrics,
    )
