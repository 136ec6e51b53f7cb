"""``fdp.nnx_train_step``: the DDP step for a Flax NNX model and ``nnx.Optimizer``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fdp.bucketing import BucketPlan, plan_for
from fdp.data._placement import DATA_AXIS, replicate
from fdp.hooks import CommHook, reduce_with_hook
from fdp.observe._observer import Observer
from fdp.observe._stats import StatsSchedule
from fdp.step._common import (
    LossFn,
    StepConfig,
    StepLayout,
    add_device_axis,
    call_loss,
    has_leaves,
    make_config,
    per_device,
    prepare_batch,
    reduce_metrics,
    strip_device_axis,
    sync_buffers,
)
from fdp.step._local_grads import local_gradients
from fdp.step._usage import (
    ParamUsage,
    analyse_usage,
    keep_untouched,
    untouched_flags,
    warn_if_unused,
)


class CommState(nnx.Variable):
    """A comm hook's state on an ``nnx.Optimizer`` (one copy per device, stacked)."""


class NNXDataParallelStep:
    """A compiled data-parallel step for Flax NNX; build it with :func:`nnx_train_step`.

    Call it as ``metrics = step(model, optimizer, batch[, mask])``: like
    ``nnx.jit`` steps, it updates ``model`` and ``optimizer`` in place. A
    stateful comm hook keeps its state on the optimizer as
    ``optimizer.fdp_comm_state``.
    """

    def __init__(self, loss_fn: LossFn, cfg: StepConfig, stats: bool | StatsSchedule = False):
        self.loss_fn = loss_fn
        self.config = cfg
        self.plan: BucketPlan | None = None
        self.usage: ParamUsage | None = None
        self._placed = False
        self._jitted = jax.jit(
            self._global_step,
            static_argnums=(0,),
            donate_argnums=(1, 2) if cfg.donate else (),
            compiler_options=cfg.compiler_options,
        )
        self._jitted_hook_init = jax.jit(self._hook_init)
        names = ("graphdef", "comm_state", "state", "batch", "mask")
        self._observer = Observer(self, "fdp.nnx_train_step", names, 3, stats)

    def _hook_init(self, params: Any) -> Any:
        cfg = self.config
        plan = plan_for(params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
        return jax.shard_map(
            lambda p: add_device_axis(cfg.comm_hook.init(p, plan)),
            mesh=cfg.mesh,
            in_specs=P(),
            out_specs=P(cfg.axis_name),
            axis_names={cfg.axis_name},
            check_vma=False,
        )(params)

    def init(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any = None) -> None:
        """Gives ``optimizer`` the comm hook's state, and reads the parameter usage."""
        if not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(
                f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}. "
                "For a Linen TrainState use fdp.train_step."
            )
        cfg = self.config
        if not self._placed:
            # On the mesh before the first step: the step's outputs are, and inputs
            # placed otherwise would compile the step a second time on the next call.
            # With several processes this also hands everyone process 0's values.
            nnx.update((model, optimizer), replicate(nnx.state((model, optimizer)), cfg.mesh))
            self._placed = True
        if batch is not None and self.usage is None:
            self.usage = self._analyse(model, optimizer, batch)
        if hasattr(optimizer, "fdp_comm_state"):
            return
        params = nnx.state(model, optimizer.wrt)
        plan = plan_for(params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
        if has_leaves(jax.eval_shape(lambda p: cfg.comm_hook.init(p, plan), params)):
            optimizer.fdp_comm_state = CommState(self._jitted_hook_init(params))

    def _analyse(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> ParamUsage:
        cfg = self.config
        model_def, params, rest = nnx.split(model, optimizer.wrt, ...)
        split = cfg.num_replicas * cfg.accumulate_steps
        local = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (max(1, jnp.shape(x)[0] // split), *jnp.shape(x)[1:]), jnp.result_type(x)
            ),
            batch,
        )

        def loss_of(p: Any, b: Any, r: Any) -> Any:
            return self.loss_fn(nnx.merge(model_def, p, r, copy=True), b)

        usage = analyse_usage(
            loss_of, params, local, rest, axis_env=[(cfg.axis_name, cfg.num_replicas)]
        )
        warn_if_unused(usage, cfg.find_unused_parameters, stacklevel=4)
        return usage

    def _global_step(
        self, graphdef: Any, comm: Any, state: Any, batch: Any, mask: Any
    ) -> tuple[Any, Any, dict[str, Any]]:
        cfg = self.config
        batch, mask = prepare_batch(batch, mask, cfg)
        local = jax.shard_map(
            lambda c, s, b, m: self._local_step(graphdef, c, s, b, m),
            mesh=cfg.mesh,
            in_specs=(P(cfg.axis_name), P(), P(cfg.axis_name), P(cfg.axis_name)),
            out_specs=(P(cfg.axis_name), P(), P()),
            axis_names={cfg.axis_name},
            check_vma=cfg.check_vma,
        )
        return local(comm, state, batch, mask)

    def _local_step(
        self, graphdef: Any, comm: Any, state: Any, batch: Any, mask: Any
    ) -> tuple[Any, Any, dict[str, Any]]:
        cfg = self.config
        model, optimizer = nnx.merge(graphdef, strip_device_axis(comm), state)
        model_def, params, keys, rest = nnx.split(model, optimizer.wrt, nnx.RngKey, ...)
        usage = self.usage
        unused = usage.unused if (cfg.find_unused_parameters and usage is not None) else ()
        track = usage.conditional if (cfg.find_unused_parameters and usage is not None) else ()
        self.plan = plan_for(params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb, unused)
        # Per-device random streams, so each device draws its own dropout masks.
        index = jax.lax.axis_index(cfg.axis_name)
        local_keys = jax.tree.map(lambda k: jax.random.fold_in(k, index), keys)

        def objective(p: Any, micro: Any, carry: Any, key: Any) -> tuple:
            del key
            # copy=True: fresh Variables at this trace level, which the forward
            # pass may mutate (batch statistics, rng counters).
            m = nnx.merge(model_def, p, local_keys, carry, copy=True)
            loss, aux, _ = call_loss(self.loss_fn, cfg, False, m, micro)
            return loss, aux, nnx.split(m, optimizer.wrt, nnx.RngKey, ...)[3]

        out = local_gradients(
            objective,
            per_device(params, cfg.axis_name),
            batch,
            rest,
            axis_name=cfg.axis_name,
            accumulate_steps=cfg.accumulate_steps,
            accum_dtype=cfg.accum_dtype,
            per_example=cfg.per_example,
            mask=mask,
            track=track,
        )
        has_comm = hasattr(optimizer, "fdp_comm_state")
        hook_state = optimizer.fdp_comm_state.get_value() if has_comm else ()
        grads, hook_state = reduce_with_hook(
            cfg.comm_hook,
            hook_state,
            out.grads,
            axis_name=cfg.axis_name,
            plan=self.plan,
            layout=cfg.layout,
            params=params,
        )
        nnx.update(model, sync_buffers(out.carry, cfg.buffers, cfg.axis_name))
        old = (nnx.as_pure(params), nnx.as_pure(optimizer.opt_state))
        optimizer.update(model, grads)
        if unused or track:
            keep = untouched_flags(usage, out.used, cfg.axis_name)
            new = (nnx.as_pure(nnx.state(model, optimizer.wrt)), nnx.as_pure(optimizer.opt_state))
            kept_params, kept_opt = keep_untouched(new, old, jax.tree.structure(old[0]), keep)
            nnx.update(model, kept_params)
            nnx.update(optimizer.opt_state, nnx.state(kept_opt))
        if has_comm:
            optimizer.fdp_comm_state.set_value(hook_state)
        comm_out, state_out = nnx.split((model, optimizer), CommState, ...)[1:]
        metrics = reduce_metrics(out.global_loss(cfg.axis_name), out.aux, cfg.axis_name)
        return add_device_axis(comm_out), state_out, metrics

    def __call__(
        self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any, mask: Any = None
    ) -> dict[str, Any]:
        """Runs one step in place and returns the metrics."""
        self.init(model, optimizer, batch)
        graphdef, comm, state = nnx.split((model, optimizer), CommState, ...)
        if self._observer.on:
            comm, state, metrics = self._observer.run(
                self._jitted, (graphdef, comm, state, batch, mask)
            )
        else:
            comm, state, metrics = self._jitted(graphdef, comm, state, batch, mask)
        nnx.update((model, optimizer), comm, state)
        return metrics

    def stats(self) -> dict[str, Any]:
        """Sampled runtime statistics; see :meth:`fdp.DataParallelStep.stats`."""
        return self._observer.stats()

    def logging_data(self) -> dict[str, Any]:
        """The step's settings as logged at ``FDP_DEBUG=INFO`` (DDP's logging data)."""
        return self._observer.logging_data()

    def lower(
        self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any, mask: Any = None
    ) -> Any:
        """The lowered step, without running it."""
        self.init(model, optimizer, batch)
        graphdef, comm, state = nnx.split((model, optimizer), CommState, ...)
        return self._jitted.lower(graphdef, comm, state, batch, mask)


def nnx_train_step(
    loss_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    axis_name: str = DATA_AXIS,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    has_aux: bool = False,
    donate: bool = True,
    layout: StepLayout = "auto",
    comm_hook: CommHook | str | None = None,
    accumulate_steps: int = 1,
    accum_dtype: Any = None,
    per_example: bool = False,
    find_unused_parameters: bool = False,
    buffers: str = "broadcast",
    stats: bool | StatsSchedule = False,
) -> NNXDataParallelStep:
    """Builds a jitted DDP step for a Flax NNX model and its ``nnx.Optimizer``.

    Gradients are taken with respect to the optimizer's ``wrt`` variables
    (``nnx.Param`` by default), reduced over the data axis in DDP's buckets and
    applied with ``optimizer.update``. Other variables changed by the forward
    pass (batch statistics) are kept in step as ``buffers`` says (device 0's by
    default, like DDP's ``broadcast_buffers``). Random streams (``nnx.Rngs``)
    draw different numbers on each device.

    Args:
      loss_fn: ``loss_fn(model, batch)`` returning the mean loss over the local
        batch, or ``(loss, aux)`` with ``has_aux=True``.
      mesh: the mesh (default: all devices on one ``'data'`` axis).
      axis_name: the data axis of ``mesh``.
      bucket_cap_mb: DDP's ``bucket_cap_mb`` (MiB).
      first_bucket_cap_mb: cap of the first bucket (MiB).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      donate: donate the state's buffers to the step.
      layout: ``'auto'`` (``'flat'`` on CPU with several processes, else
        ``'leaves'``), ``'leaves'`` (no copies) or ``'flat'`` (DDP's packed
        bucket buffers, kept apart by XLA:CPU); see :func:`fdp.reduce_gradients`.
      comm_hook: a :class:`fdp.hooks.CommHook` or a hook name. Hooks whose
        replicas diverge (``noop``, ``post_local_sgd``) need one model per
        device, which an NNX model object is not: use :func:`fdp.train_step`.
      accumulate_steps: micro-batches per step, reduced once (``no_sync``).
      accum_dtype: accumulation dtype (default: float32 for 16-bit parameters).
      per_example: ``loss_fn`` returns one loss per example; uneven batches
        are padded and masked, and ``mask=`` weighs examples.
      find_unused_parameters: leave parameters that do not reach the loss, and
        their optimizer state, untouched (see :func:`fdp.train_step`).
      buffers: ``'broadcast'`` (device 0's batch statistics) or ``'mean'``
        (averaged over the data axis). ``'local'`` needs one model per device:
        use :func:`fdp.train_step`.
      stats: sample runtime statistics (``step.stats()``) at any debug level;
        see :func:`fdp.train_step`.

    Returns:
      An :class:`NNXDataParallelStep`: ``metrics = step(model, optimizer, batch)``.

    Raises:
      ValueError: a hook whose replicas diverge.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import fdp
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def loss_fn(model, batch):
      ...     return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)
      >>> step = fdp.nnx_train_step(loss_fn)
      >>> batch = fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones(8)})
      >>> metrics = step(model, optimizer, batch)
      >>> int(optimizer.step[...])
      1
    """
    cfg = make_config(
        loss_fn,
        mesh=mesh,
        axis_name=axis_name,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        has_aux=has_aux,
        donate=donate,
        layout=layout,
        comm_hook=comm_hook,
        model_averager=None,
        accumulate_steps=accumulate_steps,
        accum_dtype=accum_dtype,
        per_example=per_example,
        find_unused_parameters=find_unused_parameters,
        buffers=buffers,
    )
    if cfg.buffers == "local":
        raise ValueError(
            "buffers='local' keeps batch statistics once per device, which an NNX model "
            "object cannot hold; use fdp.train_step with a Linen TrainState, or "
            "buffers='broadcast' / 'mean'."
        )
    if cfg.per_device_state:
        raise ValueError(
            f"comm hook {cfg.comm_hook.name!r} lets replicas diverge, which needs one model "
            "per device; an NNX model object holds one. Use fdp.train_step with a Linen "
            "TrainState for this hook."
        )
    return NNXDataParallelStep(loss_fn, cfg, stats)
