"""DDP's ``no_sync`` as an explicit pair: accumulate locally, then sync once.

For training loops that do their own micro-batching::

    acc = fdp.grad_accumulator(loss_fn)
    grads = acc.init(state)
    for micro_batch in micro_batches:
        grads, _ = acc.accumulate(state, grads, micro_batch)   # no communication
    state, metrics = acc.sync(state, grads)                    # one bucketed reduction

``fdp.train_step(accumulation=fdp.Accumulation(steps=K))`` does the same inside one
compiled step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fdp.bucketing import plan_for
from fdp.collectives import vary
from fdp.collectives._axis import AxisName
from fdp.data._placement import DATA_AXIS
from fdp.hooks import reduce_with_hook
from fdp.nn._moments import using_example_mask
from fdp.step.core._state import add_device_axis, strip_device_axis
from fdp.step.grads._batch import batch_rows, place_batch, split_mask
from fdp.step.grads._keys import per_device
from fdp.step.grads._local_grads import (
    LossWeights,
    add_into,
    example_scale,
    mean_loss_scale,
    zero_sums,
)
from fdp.step.grads._loss import call_loss, check_loss_fn
from fdp.step.options._config import LossFn, StepConfig
from fdp.step.options._policies import Accumulation, Loss, Reduction, from_keywords


class Accumulated(NamedTuple):
    """Gradients summed on each device, with what is needed to average them.

    Every leaf has a leading device axis sharded over the data axis.

    Attributes:
      grads: per-device sums of gradients (in the accumulation dtype).
      loss: per-device sums of the loss (mean losses, or weighted per-example
        losses).
      weight: per-device number of micro-batches (mean losses) or of real
        examples (per-example losses).
    """

    grads: Any
    loss: jax.Array
    weight: jax.Array


class GradAccumulator:
    """``init``, ``accumulate`` and ``sync``; build it with :func:`grad_accumulator`."""

    def __init__(self, loss_fn: LossFn, cfg: StepConfig):
        self.loss_fn = loss_fn
        self._config = cfg

    @property
    def config(self) -> StepConfig:
        """The settings, bound to the mesh (the first access starts JAX's backend)."""
        if not self._config.bound:
            self._config = self._config.bind()
        return self._config

    @functools.cached_property
    def _init(self) -> Any:
        return jax.jit(self._global_init)

    @functools.cached_property
    def _accumulate(self) -> Any:
        return jax.jit(self._global_accumulate, donate_argnums=(1,))

    @functools.cached_property
    def _sync(self) -> Any:
        cfg = self.config
        return jax.jit(
            self._global_sync,
            donate_argnums=(0, 1) if cfg.donate else (1,),
            compiler_options=cfg.compiler_options,
        )

    def _global_init(self, params: Any) -> Accumulated:
        cfg = self.config

        def local(params: Any) -> Accumulated:
            zeros = zero_sums(params, cfg.accum_dtype)
            return add_device_axis(Accumulated(zeros, jnp.zeros(()), jnp.zeros(())))

        return cfg.shard_map(local, (P(),), P(cfg.axis_name))(params)

    def init(self, state: Any) -> Accumulated:
        """Zero accumulators, one per device, for ``state.params``."""
        return self._init(state.params)

    def _global_accumulate(
        self, state: Any, acc: Accumulated, batch: Any, rng: Any, mask: Any
    ) -> tuple[Accumulated, jax.Array]:
        cfg = self.config
        batch, mask = place_batch(batch, mask, batch_rows(batch, mask, cfg), cfg)
        axis = P(cfg.axis_name)

        def local(state: Any, acc: Accumulated, batch: Any, rng: Any, mask: Any) -> tuple:
            acc = strip_device_axis(acc)
            key = per_device(rng, cfg.axis_name)
            extra = () if key is None else (key,)

            weights = split_mask(mask)[0] if cfg.per_example else None

            def objective(p: Any) -> tuple[jax.Array, jax.Array]:
                with using_example_mask(weights):  # for fdp.SyncBatchNorm
                    loss, _, _ = call_loss(self.loss_fn, cfg, False, p, batch, *extra)
                if isinstance(loss, tuple):  # (sum, weight): Loss(normalize='tokens'), refused
                    raise TypeError("grad_accumulator does not apply Loss.normalize='tokens'.")
                if weights is not None:
                    return jnp.sum(weights * loss), jnp.sum(weights)
                return loss, jnp.ones(())

            (loss, weight), grads = jax.value_and_grad(objective, has_aux=True)(
                vary(state.params, cfg.axis_name)
            )
            summed = add_into(acc.grads, grads)
            new = Accumulated(summed, acc.loss + loss, acc.weight + weight)
            return add_device_axis(new), add_device_axis(loss)

        mapped = cfg.shard_map(local, (P(), axis, axis, P(), axis), (axis, axis))
        return mapped(state, acc, batch, rng, mask)

    def accumulate(
        self, state: Any, acc: Accumulated, batch: Any, rng: Any = None, mask: Any = None
    ) -> tuple[Accumulated, jax.Array]:
        """Adds the gradients of ``batch`` on every device, without communicating.

        Returns:
          The new accumulators (the old ones are donated) and every device's own
          loss on its share of ``batch`` (a ``[devices]`` array, not averaged:
          averaging would communicate).
        """
        return self._accumulate(state, acc, batch, rng, mask)

    def _global_sync(self, state: Any, acc: Accumulated) -> tuple[Any, dict[str, Any]]:
        cfg = self.config
        plan = plan_for(state.params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
        if jax.tree.leaves(jax.eval_shape(lambda p: cfg.hook.init(p, plan), state.params)):
            raise ValueError(
                f"comm hook {cfg.comm_hook.name!r} keeps state between steps, which "
                "grad_accumulator does not carry; use "
                "fdp.train_step(accumulation=fdp.Accumulation(steps=...))."
            )

        def local(state: Any, acc: Accumulated) -> tuple:
            acc = strip_device_axis(acc)
            # Weighted as the step weighs (fdp.step.grads._local_grads), so that the mean over
            # devices is the mean over all micro-batches (or all real examples), or with
            # accumulate_op='sum' their sum, as torch's no_sync adds them. Every real
            # example weighs the same: each device holds rows of what it accumulated.
            how = LossWeights(cfg.accumulate_op, "example", divide_by_initial_world_size=False)
            if cfg.per_example:
                scale, total = example_scale(acc.weight, True, cfg.axis_name, how)
            else:
                scale = mean_loss_scale(how, jnp.maximum(acc.weight, 1.0))
                total = jnp.maximum(jax.lax.psum(acc.weight, cfg.axis_name), 1.0)
            grads = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), acc.grads, state.params)
            grads, _ = reduce_with_hook(
                cfg.hook,
                (),
                grads,
                axis_name=cfg.axis_name,
                plan=plan,
                layout=cfg.bound_layout,
                grouped=cfg.groups_buckets,
            )
            # Mean losses: total counts micro-batches; per-example: real examples.
            loss = jax.lax.psum(acc.loss, cfg.axis_name) / total
            return state.apply_gradients(grads=grads), {"loss": loss}

        return cfg.shard_map(local, (P(), P(cfg.axis_name)), (P(), P()))(state, acc)

    def sync(self, state: Any, acc: Accumulated) -> tuple[Any, dict[str, Any]]:
        """Averages the accumulated gradients over the data axis and applies them.

        Returns:
          The new state and ``{"loss": ...}``, the loss over everything
          accumulated. The state (if ``donate``) and ``acc`` are donated.
        """
        return self._sync(state, acc)


def grad_accumulator(
    loss_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    axis_name: AxisName = DATA_AXIS,
    reduction: Reduction | None = None,
    accumulation: Accumulation | None = None,
    loss: Loss | None = None,
    donate: bool = True,
    **deprecated: Any,
) -> GradAccumulator:
    """DDP's ``no_sync`` as two steps: a local-gradient step and a sync step.

    Args:
      loss_fn: ``loss_fn(params, batch[, rng])`` returning the mean loss over
        the local batch, or one loss per example with ``Loss(per_example=True)``.
      mesh: the mesh (default: all devices on one ``'data'`` axis).
      axis_name: the data axis.
      reduction: how ``sync`` reduces (:class:`fdp.Reduction`): bucket caps,
        layout, a stateless comm hook (default: the mean), its dtype and levels.
      accumulation: ``dtype`` (default: float32 for 16-bit parameters) and
        ``op``: ``'mean'`` (default): ``sync`` applies the mean of the
        accumulated gradients (of the micro-batch mean losses), so K
        micro-batches make one step on their union; ``'sum'``: their sum, as
        torch's ``no_sync`` accumulates ``.grad`` (divide your loss by K there
        to get the mean). ``'sum'`` needs ``per_example=False``. The number of
        micro-batches is your calls to ``accumulate`` (leave ``steps`` at 1).
      loss: ``per_example``: ``loss_fn`` returns one loss per example;
        ``mask=`` weighs them (every real example the same, over everything
        accumulated). The other :class:`fdp.Loss` fields are the steps' only.
      donate: donate the state to ``sync``.
      **deprecated: fdp 0.1's flat keywords, for one release (see
        :func:`fdp.train_step`).

    Returns:
      A :class:`GradAccumulator`.

    Raises:
      ValueError: a hook whose replicas diverge, or a policy field this
        accumulator does not apply; ``sync`` raises for a hook that keeps state
        (use ``fdp.train_step(accumulation=...)``).
    """
    given = {
        "mesh": mesh,
        "axis_name": axis_name,
        "reduction": reduction,
        "accumulation": accumulation,
        "loss": loss,
        "donate": donate,
    }
    cfg = StepConfig(**from_keywords("fdp.grad_accumulator", given, deprecated))
    _check_applied(cfg)
    if cfg.accumulate_op == "sum" and cfg.per_example:
        raise ValueError(
            "grad_accumulator(accumulate_op='sum') adds the gradients of mean losses and "
            "needs per_example=False; with per_example=True it averages over the real "
            "examples accumulated (accumulate_op='mean')."
        )
    if cfg.per_device_state:
        raise ValueError(
            f"comm hook {cfg.comm_hook.name!r} lets replicas diverge; grad_accumulator keeps "
            "one replicated state. Use fdp.train_step(accumulation=...) instead."
        )
    return GradAccumulator(check_loss_fn(loss_fn), cfg)


# What grad_accumulator applies of each policy; any other field must keep its default.
_APPLIED = {
    "reduction": ("bucket_cap_mb", "first_bucket_cap_mb", "layout", "comm_hook"),
    "accumulation": ("dtype", "op"),
    "loss": ("per_example",),
}


def _check_applied(cfg: StepConfig) -> None:
    """Refuses a policy field that grad_accumulator would otherwise ignore."""
    for keyword, applied in _APPLIED.items():
        policy = getattr(cfg, keyword)
        default = type(policy)()
        for field in dataclasses.fields(policy):
            value = getattr(policy, field.name)
            if field.name not in applied and value != getattr(default, field.name):
                raise ValueError(
                    f"grad_accumulator does not apply {type(policy).__name__}.{field.name} "
                    f"(got {value!r}); it applies {', '.join(applied)} of {keyword}=. Use "
                    "fdp.train_step for the rest."
                )
