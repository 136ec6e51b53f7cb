"""A device's gradient of its share of the batch, with no communication.

This is DDP's ``no_sync``: ``K`` micro-batches are scanned, their gradients summed
locally (in float32 for 16-bit parameters), and nothing crosses devices until the
one bucketed reduction that follows. The first ``K - 1`` run in a loop and the
last after it, so the reduction can overlap the last micro-batch's backward pass
(with ``finish``, the two run together in a loop of one trip).

The objective each device differentiates is weighted so that the *mean over
the N devices* of the local gradients is the gradient the step applies:

- ``per_example=False``: the loss function returns the mean loss of its
  micro-batch; each micro-batch weighs ``1/K`` (``accumulate_op='mean'``: the
  gradient of the whole batch) or ``1`` (``'sum'``: torch's ``no_sync``).
- ``per_example=True``: it returns one loss per example, weighed by the mask
  ``w``. With ``c`` a device's real examples (``sum(w)``), ``R`` their sum over
  devices, ``A`` the devices with ``c > 0`` and ``H`` the devices holding rows
  of the caller's batch, a device's objective is ``N * s * sum(w * loss)`` with

  - ``weighting='example'``: ``s = 1 / R``, times ``A / H`` with
    ``divide_by_initial_world_size`` (a device out of data counts as one with the
    others' mean number of examples, so with equal batches this is torch's
    division by the initial world size);
  - ``weighting='device'``: ``s = 1 / (c * D)``, each device's mean counting
    once, ``D = H`` with ``divide_by_initial_world_size`` (torch's default),
    else ``A``;

  and ``K`` times that with ``accumulate_op='sum'``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fdp import _compat
from fdp.collectives import is_varying, mean_over, sum_over, vary
from fdp.collectives._axis import AxisName
from fdp.collectives._blocks import on_blocks
from fdp.nn._moments import using_example_mask
from fdp.step.grads._batch import split_mask
from fdp.step.grads._usage import nonzero_flags

# objective(params, micro_batch, carry, rng) -> (loss, aux, new_carry); ``loss`` is a
# scalar mean, or one value per example with per_example=True.
Objective = Callable[[Any, Any, Any, Any], tuple[jax.Array, Any, Any]]


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """How the local losses are weighed: the step's settings of the same names.

    Attributes:
      accumulate_op: ``'mean'`` or ``'sum'`` of the micro-batch gradients.
      weighting: ``'example'`` or ``'device'`` (per-example losses only).
      divide_by_initial_world_size: devices out of data count in the divisor.
    """

    accumulate_op: str = "mean"
    weighting: str = "example"
    divide_by_initial_world_size: bool = True

    @classmethod
    def of(cls, config: Any) -> LossWeights:
        """The weights a :class:`fdp.step.StepConfig` asks for."""
        return cls(config.accumulate_op, config.weighting, config.divide_by_initial_world_size)


def per_token(sums: list[Any], loss: jax.Array, axis_name: AxisName) -> tuple[list, jax.Array]:
    """Summed token-loss gradients divided for the mean over devices, and the global weight.

    ``loss`` is ``(loss_sum, weight)`` over this device's micro-batches; with
    ``W`` the weight over every device (one scalar all-reduce), each sum is
    scaled by ``N / W``, so the device mean of the results is the gradient of
    the global per-token mean loss (MaxText's and torchtitan's normalisation).
    """
    total = jnp.maximum(sum_over(loss[1], axis_name), jnp.finfo(jnp.float32).tiny)
    scale = jax.lax.axis_size(axis_name) / total
    return [s * scale.astype(s.dtype) for s in sums], total


def mean_loss_scale(how: LossWeights, k: Any) -> Any:
    """The weight of one of ``k`` micro-batch mean losses: ``1/k``, or 1 for ``'sum'``.

    The one rule for mean losses, in the step (``k`` static) and in
    :func:`fdp.grad_accumulator` (``k`` the micro-batches a device accumulated).
    """
    return 1.0 if how.accumulate_op == "sum" else 1.0 / k


def example_scale(
    count: jax.Array, holds: Any, axis_name: AxisName, how: LossWeights, k: int = 1
) -> tuple[jax.Array, jax.Array]:
    """``(N * s * K', R)``: the factor on this device's weighted loss sum, and the real examples.

    The one rule for per-example losses (see the module's docstring), in the
    step and in :func:`fdp.grad_accumulator`: ``count`` is this device's real
    examples, ``holds`` whether it holds rows of the caller's batch, ``k``
    the micro-batches (``K' = K`` with ``accumulate_op='sum'``, else 1). A
    collective: one small all-reduce.
    """
    # One small all-reduce: real examples, devices with some, devices holding rows.
    holds = jnp.asarray(holds)
    local = jnp.stack([count, (count > 0).astype(count.dtype), holds.astype(count.dtype)])
    total, active, holding = sum_over(local, axis_name)
    total, holding = jnp.maximum(total, 1.0), jnp.maximum(holding, 1.0)
    if how.weighting == "device":
        divisor = holding if how.divide_by_initial_world_size else jnp.maximum(active, 1.0)
        s = 1.0 / (jnp.maximum(count, 1.0) * divisor)
    elif how.divide_by_initial_world_size:
        s = active / (holding * total)
    else:
        s = 1.0 / total
    repeats = k if how.accumulate_op == "sum" else 1  # torch's no_sync adds K gradients
    return s * (jax.lax.axis_size(axis_name) * repeats), total


@dataclasses.dataclass
class LocalGrads:
    """What one device computed.

    Attributes:
      grads: the weighted local gradients (their device-mean is the full-batch
        gradient), in the parameters' dtypes.
      loss: this device's part of the loss: its mean loss, or (per-example)
        its sum of weighted losses. :meth:`global_loss` reduces it.
      total: per-example mode: real examples over all devices; else None.
      aux: aux values combined over micro-batches (floats averaged, integers
        summed), not yet reduced over devices.
      carry: the model state carried through the micro-batches (buffers).
      used: for each tracked leaf, whether some micro-batch gave it a non-zero
        gradient on this device.
      aux_rows: per aux leaf, whether it holds one row per example (to be
        gathered along the batch, not reduced).
    """

    grads: Any
    loss: jax.Array
    total: jax.Array | None
    aux: Any
    carry: Any
    used: jax.Array
    aux_rows: tuple[bool, ...] = ()

    def global_loss(
        self,
        axis_name: AxisName,
        combine_with: str | None = None,
        model_axes: tuple[str, ...] = (),
    ) -> jax.Array:
        """The loss over the whole batch (a collective: call it after the buckets).

        With ``combine_with`` (a bucket's combiner key, on GPU) the loss's
        all-reduce is tagged with it, and XLA:GPU merges it into that bucket's
        all-reduce: one collective fewer per step, as plain jit's partitioner
        merges the loss with a gradient. ``model_axes``: the mesh's other axes,
        where the all-reduce then runs manual too, as the buckets do (left to
        the partitioner there, jax 0.12 puts the tag on a sharding constraint
        after the all-reduce, and the loss stays a collective of its own).
        """
        if combine_with is not None:
            key = combine_with

            def summed(loss: jax.Array) -> jax.Array:
                return _compat.tag_combiner_key(sum_over(loss, axis_name), key)

            total = on_blocks(summed, P(), model_axes)(self.loss)
            return total / (jax.lax.axis_size(axis_name) if self.total is None else self.total)
        if self.total is None:
            return mean_over(self.loss, axis_name)
        return sum_over(self.loss, axis_name) / self.total


def accum_dtype_for(dtype: Any, accum_dtype: Any = None) -> jnp.dtype:
    """The accumulation dtype: ``accum_dtype``, else float32 for 16-bit floats."""
    if accum_dtype is not None:
        return jnp.dtype(accum_dtype)
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


def zero_sums(params: Any, accum_dtype: Any = None) -> Any:
    """Zeros like ``params`` in their accumulation dtypes (:func:`accum_dtype_for`)."""
    return jax.tree.map(
        lambda x: jnp.zeros(jnp.shape(x), accum_dtype_for(jnp.result_type(x), accum_dtype)),
        params,
    )


def add_into(sums: Any, grads: Any) -> Any:
    """``sums + grads``, leaf by leaf, in the sums' dtypes (no_sync's local accumulation)."""
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), sums, grads)


def split_micro_batches(batch: Any, k: int) -> Any:
    """``[K*B, ...]`` leaves as ``[K, B, ...]`` (micro-batch ``i`` is rows ``iB:(i+1)B``)."""
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)


def per_example_leaves(stacked: Any, rows: int, gather: Any) -> tuple[bool, ...]:
    """Per leaf of the micro-batches' stacked aux ``[K, ...]``: one row per example?

    Args:
      stacked: the aux of the ``K`` micro-batches, stacked.
      rows: the rows of one micro-batch.
      gather: the step's ``gather_aux``: ``True`` (leaves whose leading size is
        ``rows``), ``False`` (none) or ``fn(key_path) -> bool``.

    Raises:
      ValueError: ``gather`` names a leaf without one row per example.
    """
    paths = jax.tree_util.tree_flatten_with_path(stacked)[0]
    if gather is True or gather is False:
        return tuple(gather and x.ndim >= 2 and x.shape[1] == rows for _, x in paths)
    flags = []
    for path, x in paths:
        name = jax.tree_util.keystr(path)
        chosen = bool(gather(name))
        if chosen and not (x.ndim >= 2 and x.shape[1] == rows):
            raise ValueError(
                f"gather_aux names aux leaf {name or 'aux'}, whose shape on one device is "
                f"{tuple(x.shape[1:])}; a gathered leaf needs one row per example of the "
                f"local micro-batch ({rows}, ...). Leave it out of gather_aux to average it "
                "over devices, or return it per example."
            )
        flags.append(chosen)
    return tuple(flags)


def _combine_aux(stacked: Any, k: int, rows: tuple[bool, ...]) -> Any:
    leaves, treedef = jax.tree.flatten(stacked)

    def leaf(x: jax.Array, per_example: bool) -> jax.Array:
        if per_example:  # micro-batch i holds the local rows iB:(i+1)B
            return x.reshape(-1, *x.shape[2:])
        if k == 1:
            return x[0]
        return x.mean(0) if jnp.issubdtype(x.dtype, jnp.inexact) else x.sum(0)

    return jax.tree.unflatten(treedef, [leaf(x, r) for x, r in zip(leaves, rows, strict=True)])


def local_gradients(
    objective: Objective,
    params: Any,
    batch: Any,
    carry: Any,
    *,
    axis_name: AxisName,
    accumulate_steps: int = 1,
    accum_dtype: Any = None,
    per_example: bool = False,
    tokens: bool = False,
    weights: LossWeights = LossWeights(),
    mask: jax.Array | None = None,
    rng: jax.Array | None = None,
    track: Sequence[int] = (),
    gather_aux: Any = True,
    hold_last: bool = True,
    last_after_loop: bool = False,
    finish: Callable[[list[Any]], list[Any]] | None = None,
) -> LocalGrads:
    """Scans the micro-batches of this device's batch and sums their gradients.

    Args:
      objective: the per-micro-batch loss (see ``Objective``).
      params: per-device (varying) parameters.
      batch: this device's batch, leading size divisible by ``accumulate_steps``.
      carry: model state threaded through the micro-batches (or ``None``).
      axis_name: the data axis (for the global example count and metrics).
      accumulate_steps: number of micro-batches K.
      accum_dtype: accumulation dtype (default: float32 for 16-bit parameters).
      per_example: the objective returns one loss per example.
      tokens: the objective returns ``(loss_sum, weight)``: the summed gradient
        is divided by the weight over every micro-batch and device before it
        is reduced (``fdp.Loss(normalize='tokens')``), a collective of one
        scalar; the mean over devices is then the gradient of the global
        per-token mean.
      weights: how the losses are weighed (see the module's docstring).
      mask: this device's ``[K*B]`` weights (per-example mode), 1 for real
        examples, 0 for padding, ``STEP_PADDING`` for the step's own padding.
      rng: this device's key, folded with the micro-batch index when K > 1.
      track: indices of parameter leaves whose run-time use is recorded.
      gather_aux: which aux leaves hold one row per example (see
        :func:`per_example_leaves`).
      hold_last: with ``accumulate_steps > 1``, run the last micro-batch after
        the loop over the others, so that the reductions that follow depend on
        its backward pass alone and may overlap it (on an accelerator). Off,
        all K run in one loop: no copy of the first K-1 and no second copy of
        the body, for a compiler that would not overlap them (XLA:CPU). The
        same additions in the same order either way.
      last_after_loop: with ``accumulate_steps > 1``, hold the last
        micro-batch back until the loop is done (an optimization barrier ties
        its inputs to the loop's result). Otherwise the compiler may run its
        forward pass before or beside the loop, holding its activations through
        it: compiled for 8 x H100, a 12-layer GPT's temp memory at K=4 was
        1.358x plain jit's, 1.003x with the barrier (docs/gpu.md). Set on GPUs.
      finish: with ``accumulate_steps > 1``, the reduction of the summed
        gradient leaves, run with the last micro-batch in a loop of one trip
        (:func:`fdp._compat.run_once`): there the accumulator is the loop's
        parameter, so each weight-gradient product adds into it in place and the
        reduction reads it there. The returned ``grads`` are then reduced. Needs
        accumulators in the parameters' dtypes and a shard_map that does not
        track replication (the carry turns from per-device to replicated).

    Returns:
      A :class:`LocalGrads`.

    Raises:
      ValueError: ``finish`` with ``accumulate_steps=1`` or without ``hold_last``.
    """
    k = accumulate_steps
    if finish is not None and (k == 1 or not hold_last):
        raise ValueError(
            "local_gradients(finish=...) reduces with the last of several micro-batches, "
            f"held after the loop; got accumulate_steps={k}, hold_last={hold_last}."
        )
    leaves, treedef = jax.tree.flatten(params)
    dtypes = [jnp.result_type(x) for x in leaves]
    if per_example:
        size = jax.tree.leaves(batch)[0].shape[0]
        local_mask = jnp.ones((size,), jnp.float32) if mask is None else mask
        w, holds = split_mask(local_mask)
        scale, total = example_scale(jnp.sum(w), holds, axis_name, weights, k)
        total_or_none: jax.Array | None = total
        micro_masks = split_mask(local_mask)[0].reshape(k, -1)
    else:
        micro_masks, total_or_none, scale = jnp.zeros((k, 0)), None, None

    def micro(state: tuple, xs: tuple) -> tuple[tuple, Any]:
        acc, carry, loss_acc, used = state
        index, micro_batch, micro_mask = xs
        # One micro-batch uses the device's key as is; several fold in their index.
        micro_rng = rng if rng is None or k == 1 else jax.random.fold_in(rng, index)

        def weighted(p: Any) -> tuple[jax.Array, tuple]:
            # Layers that take statistics (fdp.SyncBatchNorm) read the real examples.
            with using_example_mask(micro_mask if scale is not None else None):
                loss, aux, new_carry = objective(p, micro_batch, carry, micro_rng)
            if scale is not None:  # per-example: weighed by the real examples
                loss_sum = jnp.sum(micro_mask * loss)
                return loss_sum * scale, (loss_sum, aux, new_carry)
            if tokens:  # (sum, weight): the sum now, divided by the global weight after
                token_sum, weight = loss
                return token_sum, (jnp.stack([token_sum, weight]), aux, new_carry)
            return loss * mean_loss_scale(weights, k), (loss / k, aux, new_carry)

        (_, (loss_part, aux, carry)), grads = jax.value_and_grad(weighted, has_aux=True)(params)
        aux = jax.tree.map(jnp.asarray, aux)  # Python numbers too: the micro-batches stack them
        grad_leaves = jax.tree.leaves(grads)
        acc = add_into(acc, grad_leaves)
        used = used | nonzero_flags([grad_leaves[i] for i in track])
        return (acc, carry, loss_acc + loss_part, used), aux

    acc0 = zero_sums(leaves, accum_dtype)
    # The scan carry changes per device: type it device-varying from the start. A
    # parameter passed replicated (a layer stack reduced in the backward loop,
    # fdp.step.grads._scanned) has a gradient reduced already: its sum stays replicated.
    acc0 = [
        a if is_varying(x, axis_name) is False else vary(a, axis_name)
        for a, x in zip(acc0, leaves, strict=True)
    ]
    # The loss so far: a scalar, or (token loss sum, weight) with ``tokens``.
    loss0 = jnp.zeros((2,) if tokens else (), jnp.float32)
    state0 = (acc0, *vary((carry, loss0, jnp.zeros((len(track),), jnp.bool_)), axis_name))
    micro_batches = split_micro_batches(batch, k)
    xs = (jnp.arange(k), micro_batches, micro_masks)
    last = jax.tree.map(lambda x: x[-1], xs)
    if k == 1:
        state, aux = micro(state0, last)
        aux = jax.tree.map(lambda x: x[None], aux)
    elif not hold_last:
        state, aux = jax.lax.scan(micro, state0, xs)
    else:
        # The last micro-batch runs after the loop, not in it: the bucket reductions
        # that follow then depend on its backward pass alone, and the compiler can
        # start each while the rest of that backward pass runs, as DDP reduces
        # during the backward pass of the step after no_sync. Same additions, same
        # order as a loop over all K.
        if last_after_loop:  # each micro-batch read where it lies: no copy of the first K-1
            state, aux_head = jax.lax.scan(
                lambda st, i: micro(st, jax.tree.map(lambda x: x[i], xs)), state0, jnp.arange(k - 1)
            )
            state, last = jax.lax.optimization_barrier((state, last))
        else:
            head = jax.tree.map(lambda x: x[:-1], xs)
            state, aux_head = jax.lax.scan(micro, state0, head)
        if finish is None:
            state, aux_last = micro(state, last)
        else:

            def last_and_finish(st: tuple) -> tuple[tuple, Any]:
                st, aux_l = micro(st, last)
                sums = per_token(st[0], st[2], axis_name)[0] if tokens else st[0]
                return (list(finish(sums)), *st[1:]), aux_l

            state, aux_last = _compat.run_once(last_and_finish, state)
        aux = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), aux_head, aux_last)
    acc, carry, loss_acc, used = state
    if tokens:  # (already divided by the weight where ``finish`` reduced them)
        divided, total_or_none = per_token(acc, loss_acc, axis_name)
        acc = acc if finish is not None else divided
        loss_acc = loss_acc[0]
    grads = jax.tree.unflatten(treedef, [a.astype(d) for a, d in zip(acc, dtypes, strict=True)])
    micro_rows = jax.tree.leaves(micro_batches)[0].shape[1]
    rows = per_example_leaves(aux, micro_rows, gather_aux)
    aux = _combine_aux(aux, k, rows)
    return LocalGrads(grads, loss_acc, total_or_none, aux, carry, used, rows)
