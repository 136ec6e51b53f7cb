"""The step, once for both front ends: per-device gradients, the reduction, the update.

The jitted program is ``(plan, static, state, batch, rng, mask) -> (state,
metrics)``; a :class:`~fdp.step.core._update.FrontEnd` says how ``state`` (a Linen
``TrainState``; NNX's hook state and model-and-optimizer state, with the graph
as ``static``) is read and updated. Stage 0 runs everything inside one
``shard_map``; ZeRO stages take the reduced gradients out of it and update on
sharded whole arrays (:func:`~fdp.step.core._update.sharded_update`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fdp.data._rows import leading_size
from fdp.hooks._diloco import DiLoCo
from fdp.observe._stats import StatsSchedule
from fdp.step.core._core import join_metrics, metrics_specs, reduce_step
from fdp.step.core._plan import StepPlan
from fdp.step.core._runner import StepRunner
from fdp.step.core._state import add_device_axis, strip_device_axis
from fdp.step.core._update import FrontEnd, Parts, sharded_update, update
from fdp.step.grads._batch import place_batch
from fdp.step.grads._keys import per_device
from fdp.step.layout._zero import specs
from fdp.step.options._config import LossFn, StepConfig


class Step(StepRunner):
    """The base of :class:`fdp.DataParallelStep` and :class:`fdp.NNXDataParallelStep`.

    Everything between the call's arguments and the update is here; a front
    end adds its calling convention (``step(state, batch)`` or ``step(model,
    optimizer, batch)``), its ``init`` and its :class:`FrontEnd`.

    Args:
      kind: the step's name in logs.
      front: how the front end's state is read and updated.
      loss_fn: the user's loss.
      config: the step's settings.
      arg_names: names of the jitted step's arguments after the plan.
      stats: sample runtime statistics at any debug level.
    """

    def __init__(
        self,
        kind: str,
        front: FrontEnd,
        loss_fn: LossFn,
        config: StepConfig,
        *,
        arg_names: tuple[str, ...],
        stats: bool | StatsSchedule = False,
    ):
        super().__init__(
            kind,
            config,
            self._global_step,
            donate_argnums=(1,) if config.donate else (),
            static_argnums=(0,),
            arg_names=arg_names,
            batch_arg=2,
            stats=stats,
        )
        self.loss_fn = loss_fn
        self._front = front

    def _global_step(
        self, plan: StepPlan, static: Any, state: Any, batch: Any, rng: Any, mask: Any
    ) -> tuple[Any, dict[str, Any]]:
        cfg, front = self.config, self._front
        size = leading_size(batch) or 0
        batch, mask = place_batch(batch, mask, plan.rows, cfg)
        parts = front.split(static, state)
        if cfg.zero_stage:
            parts, metrics = self._sharded_step(plan, static, parts, batch, rng, mask)
        else:
            data, spec = P(cfg.axis_name), front.specs(cfg, parts)
            local = cfg.shard_map(
                lambda *args: self._local_step(plan, static, *args),
                in_specs=(spec, data, P(), data),
                out_specs=(spec, metrics_specs(cfg.axis_name)),
                check_vma=not plan.last_in_loop,  # the loop's carry turns replicated
            )
            parts, metrics = local(parts, batch, rng, mask)
        return front.join(static, parts), join_metrics(metrics, size)

    def _local_step(
        self, plan: StepPlan, static: Any, parts: Parts, batch: Any, rng: Any, mask: Any
    ) -> tuple[Parts, Any]:
        """One device's step at stage 0: gradients, reduction and update, in shard_map."""
        cfg, front = self.config, self._front
        view = front.open(cfg, static, parts, local=True)
        objective = front.objective(cfg, view, per_device(view.keys, cfg.axis_name))
        hook_state = () if view.hook_state is None else view.hook_state
        out = reduce_step(
            objective,
            view.params,
            view.buffers,
            hook_state,
            batch,
            mask,
            rng,
            config=cfg,
            plan=plan,
        )
        averager = cfg.model_averager
        count = front.count(view.owner)  # before the update; unused without an averager
        owner = update(front, front.set_buffers(view.owner, out.buffers), out.grads, out.keep)
        hook_out = out.hook_state
        if isinstance(averager, DiLoCo):
            params, hook_out = averager.sync(
                front.params(owner), count, cfg.axis_name, hook_out, plan.buckets
            )
            owner = front.with_arrays(owner, params, front.opt_state(owner))
        elif averager is not None:
            params = averager.average(front.params(owner), count, cfg.axis_name)
            owner = front.with_arrays(owner, params, front.opt_state(owner))
        hook_out = None if view.hook_state is None else hook_out
        return front.close(cfg, view, owner, out.buffers, hook_out, local=True), out.metrics

    def _sharded_step(
        self, plan: StepPlan, static: Any, parts: Parts, batch: Any, rng: Any, mask: Any
    ) -> tuple[Parts, Any]:
        """ZeRO stages 1-3: reduced gradients from a shard_map, then the sharded update."""
        cfg, front = self.config, self._front
        axis = cfg.axis_name
        shard = cfg.shard_axis  # the data axis, or each host's devices (HSDP)
        view = front.open(cfg, static, parts, local=False)
        data = P(axis)
        param_specs = specs(view.params, cfg.num_shards, shard, plan.buckets.leaf_layouts)
        buffer_spec = front.buffer_spec(cfg, view.buffers)

        def local(params: Any, buffers: Any, keys: Any, hook_state: Any, *inputs: Any) -> tuple:
            batch, rng, mask = inputs
            out = reduce_step(
                front.objective(cfg, view, per_device(keys, axis)),
                params,
                front.local_buffers(buffers),
                () if hook_state is None else strip_device_axis(hook_state),
                batch,
                mask,
                rng,
                config=cfg,
                plan=plan,
            )
            flags = None if out.keep is None else jnp.stack([jnp.asarray(k) for k in out.keep])
            hook_out = None if hook_state is None else add_device_axis(out.hook_state)
            new_buffers = front.wrap_buffers(buffers, out.buffers)
            return out.grads, new_buffers, hook_out, flags, out.metrics

        grads, buffers, hook_state, flags, metrics = cfg.shard_map(
            local,
            in_specs=(
                param_specs if cfg.zero_stage >= 3 else P(),
                buffer_spec,
                P(),
                data,
                data,
                P(),
                data,
            ),
            out_specs=(
                param_specs if cfg.scatters_gradients else P(),
                buffer_spec,
                data,
                P(),
                metrics_specs(axis),
            ),
        )(view.params, view.buffers, view.keys, view.hook_state, batch, rng, mask)
        owner = front.set_buffers(view.owner, buffers)
        owner = sharded_update(front, owner, grads, flags, config=cfg, plan=plan)
        return front.close(cfg, view, owner, buffers, hook_state, local=False), metrics
