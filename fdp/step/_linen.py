"""``fdp.train_step``: a jitted DDP step for a Flax ``TrainState``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp.bucketing import BucketPlan, plan_for
from fdp.data._placement import DATA_AXIS, replicate
from fdp.hooks import CommHook, PeriodicModelAverager, reduce_with_hook
from fdp.observe._observer import Observer
from fdp.observe._stats import StatsSchedule
from fdp.step._common import (
    LossFn,
    PerDevice,
    StepConfig,
    StepLayout,
    add_device_axis,
    call_loss,
    device_rng,
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

_SIDE_FIELDS = ("comm_state", "batch_stats")


class DataParallelStep:
    """A compiled data-parallel training step; build it with :func:`train_step`.

    Call it as ``state, metrics = step(state, batch)``, optionally with ``rng``
    (dropout) and ``mask`` (per-example weights). ``plan`` holds the bucket plan
    and ``usage`` the parameter usage once the step has been traced; ``lower``
    gives the lowered program for inspection.
    """

    def __init__(self, loss_fn: LossFn, cfg: StepConfig, stats: bool | StatsSchedule = False):
        self.loss_fn = loss_fn
        self.config = cfg
        self.plan: BucketPlan | None = None
        self.usage: ParamUsage | None = None
        self._hook_has_state: bool | None = None
        self._jitted = jax.jit(
            self._global_step,
            donate_argnums=(0,) if cfg.donate else (),
            compiler_options=cfg.compiler_options,
        )
        self._jitted_stack = jax.jit(self._stack)
        self._jitted_hook_init = jax.jit(self._hook_init)
        names = ("state", "batch", "rng", "mask")
        self._observer = Observer(self, "fdp.train_step", names, 1, stats)

    # -- state preparation (once, before the first step) ---------------------------

    def _local_params(self, params: Any) -> Any:
        """Parameters as one device sees them (per-device state has a device axis)."""
        if self.config.per_device_state:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), params)
        return params

    def _plan(self, params: Any, exclude: tuple[int, ...] = ()) -> BucketPlan:
        cfg = self.config
        local = self._local_params(params)
        self.plan = plan_for(local, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb, exclude)
        return self.plan

    def _stack(self, tree: Any) -> Any:
        """One copy of a replicated pytree per device, stacked on the data axis."""
        cfg = self.config
        return jax.shard_map(
            add_device_axis,
            mesh=cfg.mesh,
            in_specs=P(),
            out_specs=P(cfg.axis_name),
            axis_names={cfg.axis_name},
            check_vma=False,
        )(tree)

    def _hook_init(self, params: Any) -> Any:
        """The comm hook's state, initialised from the parameters on every device."""
        cfg = self.config
        plan = self._plan(params)

        def local(params: Any) -> Any:
            params = strip_device_axis(params) if cfg.per_device_state else params
            return add_device_axis(cfg.comm_hook.init(params, plan))

        return jax.shard_map(
            local,
            mesh=cfg.mesh,
            in_specs=P(cfg.axis_name) if cfg.per_device_state else P(),
            out_specs=P(cfg.axis_name),
            axis_names={cfg.axis_name},
            check_vma=False,
        )(params)

    def _place(self, state: Any) -> Any:
        """The replicated part of ``state`` on the mesh, if it is not there yet.

        The step's outputs live on the mesh; inputs placed elsewhere would make
        the second call compile the step again.
        """
        cfg = self.config
        core, side = _split(state)
        if cfg.per_device_state and jnp.ndim(state.step) > 0:
            return state
        home = NamedSharding(cfg.mesh, P())
        leaves = jax.tree.leaves(core)
        if all(getattr(x, "sharding", None) == home for x in leaves):
            return state
        return _join(replicate(core, cfg.mesh), side)

    def _needs_init(self, state: Any) -> bool:
        cfg = self.config
        if self._hook_has_state is None:
            return True
        if cfg.per_device_state and jnp.ndim(state.step) == 0:
            return True
        stats = getattr(state, "batch_stats", None)
        local_stats = cfg.buffers == "local" and stats is not None and not cfg.per_device_state
        if local_stats and not isinstance(stats, PerDevice):
            return True
        return self._hook_has_state and getattr(state, "comm_state", None) is None

    def init(self, state: Any) -> Any:
        """Prepares ``state`` for this step.

        The step does this by itself when needed; call it to checkpoint or
        inspect the prepared state before training. With a hook whose replicas
        diverge (``noop``, ``post_local_sgd``) every leaf gains a leading device
        axis; with ``buffers='local'`` ``batch_stats`` is kept once per device
        (:class:`fdp.PerDevice`); with a stateful hook ``comm_state`` is filled.
        """
        cfg = self.config
        _check_state(state)
        state = self._place(state)
        if cfg.per_device_state and jnp.ndim(state.step) == 0:
            core, side = _split(state)
            state = _join(self._jitted_stack(core), side)
        stats = getattr(state, "batch_stats", None)
        local_stats = cfg.buffers == "local" and stats is not None and not cfg.per_device_state
        if local_stats and not isinstance(stats, PerDevice):
            state = state.replace(batch_stats=PerDevice(self._jitted_stack(stats)))
        plan = self._plan(state.params)
        shape = jax.eval_shape(
            lambda p: cfg.comm_hook.init(p, plan), self._local_params(state.params)
        )
        self._hook_has_state = has_leaves(shape)
        if self._hook_has_state:
            if not hasattr(state, "comm_state"):
                raise TypeError(
                    f"comm hook {cfg.comm_hook.name!r} keeps state between steps; use "
                    "fdp.TrainState (flax's TrainState with a comm_state field) instead of "
                    f"{type(state).__module__}.{type(state).__qualname__}."
                )
            if state.comm_state is None:
                state = state.replace(comm_state=self._jitted_hook_init(state.params))
        return state

    # -- the step ---------------------------------------------------------------------

    def _usage(self, state: Any, batch: Any, stats: Any, rng: Any) -> ParamUsage:
        """Classifies the parameters from the traced loss (trace time only)."""
        cfg = self.config
        params = _structs(self._local_params(state.params))
        local_batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (x.shape[0] // (cfg.num_replicas * cfg.accumulate_steps), *x.shape[1:]), x.dtype
            ),
            batch,
        )
        if isinstance(stats, PerDevice) or (cfg.per_device_state and stats is not None):
            stats = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                stats.value if isinstance(stats, PerDevice) else stats,
            )
        extra = [] if stats is None else [_structs(stats)]
        if rng is not None:
            extra.append(_structs(rng))
        usage = analyse_usage(
            self.loss_fn,
            params,
            local_batch,
            *extra,
            axis_env=[(cfg.axis_name, cfg.num_replicas)],
        )
        warn_if_unused(usage, cfg.find_unused_parameters, stacklevel=3)
        return usage

    def _global_step(
        self, state: Any, batch: Any, rng: Any, mask: Any
    ) -> tuple[Any, dict[str, Any]]:
        cfg = self.config
        _check_state(state)
        batch, mask = prepare_batch(batch, mask, cfg)
        core, side = _split(state)
        stats = side.get("batch_stats")
        self.usage = self._usage(state, batch, stats, rng)
        unused = self.usage.unused if cfg.find_unused_parameters else ()
        self._plan(state.params, unused)
        state_spec = P(cfg.axis_name) if cfg.per_device_state else P()
        stats_spec = P(cfg.axis_name) if isinstance(stats, PerDevice) else state_spec
        local = jax.shard_map(
            self._local_step,
            mesh=cfg.mesh,
            in_specs=(
                state_spec,
                stats_spec,
                P(cfg.axis_name),
                P(cfg.axis_name),
                P(),
                P(cfg.axis_name),
            ),
            out_specs=(state_spec, stats_spec, P(cfg.axis_name), P()),
            axis_names={cfg.axis_name},
            check_vma=cfg.check_vma,
        )
        core, stats, comm, metrics = local(core, stats, side.get("comm_state"), batch, rng, mask)
        return _join(core, {"batch_stats": stats, "comm_state": comm}), metrics

    def _local_step(
        self, state: Any, stats: Any, comm: Any, batch: Any, rng: Any, mask: Any
    ) -> tuple[Any, Any, Any, dict[str, Any]]:
        cfg = self.config
        wrapped = isinstance(stats, PerDevice)
        if cfg.per_device_state:
            state, stats = strip_device_axis((state, stats))
        elif wrapped:
            stats = strip_device_axis(stats.value)
        hook_state = () if comm is None else strip_device_axis(comm)
        has_stats = stats is not None
        params = per_device(state.params, cfg.axis_name)
        usage = self.usage
        track = usage.conditional if cfg.find_unused_parameters else ()

        def objective(p: Any, micro: Any, carry: Any, key: Any) -> tuple:
            args = (p, micro) + ((carry,) if has_stats else ()) + (() if key is None else (key,))
            loss, aux, new_stats = call_loss(self.loss_fn, cfg, has_stats, *args)
            return loss, aux, (new_stats if has_stats else carry)

        out = local_gradients(
            objective,
            params,
            batch,
            stats,
            axis_name=cfg.axis_name,
            accumulate_steps=cfg.accumulate_steps,
            accum_dtype=cfg.accum_dtype,
            per_example=cfg.per_example,
            mask=mask,
            rng=device_rng(rng, cfg.axis_name),
            track=track,
        )
        grads, hook_state = reduce_with_hook(
            cfg.comm_hook,
            hook_state,
            out.grads,
            axis_name=cfg.axis_name,
            plan=self.plan,
            layout=cfg.layout,
            params=state.params,
        )
        new_state = state.apply_gradients(grads=grads)
        if cfg.find_unused_parameters and (usage.unused or track):
            keep = untouched_flags(usage, out.used, cfg.axis_name)
            treedef = jax.tree.structure(state.params)
            new_state = keep_untouched(new_state, state, treedef, keep)
        if cfg.model_averager is not None:
            averaged = cfg.model_averager.average(new_state.params, state.step, cfg.axis_name)
            new_state = new_state.replace(params=averaged)
        new_stats = sync_buffers(out.carry, cfg.buffers, cfg.axis_name) if has_stats else None
        if cfg.per_device_state:
            new_state, new_stats = add_device_axis((new_state, new_stats))
        elif wrapped:
            new_stats = PerDevice(add_device_axis(new_stats))
        new_comm = None if comm is None else add_device_axis(hook_state)
        metrics = reduce_metrics(out.global_loss(cfg.axis_name), out.aux, cfg.axis_name)
        return new_state, new_stats, new_comm, metrics

    def __call__(
        self, state: Any, batch: Any, rng: Any = None, mask: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """Runs one step: ``(state, batch[, rng][, mask]) -> (state, metrics)``."""
        if self._needs_init(state):
            state = self.init(state)
        if self._observer.on:
            return self._observer.run(self._jitted, (state, batch, rng, mask))
        return self._jitted(state, batch, rng, mask)

    def stats(self) -> dict[str, Any]:
        """Sampled runtime statistics (step time, examples/s, bytes all-reduced per step).

        Sampled at ``FDP_DEBUG=INFO`` or above, or with ``stats=`` in
        :func:`train_step`; otherwise ``{"enabled": False}``. See
        docs/observability.md for the fields.
        """
        return self._observer.stats()

    def logging_data(self) -> dict[str, Any]:
        """The step's settings as logged at ``FDP_DEBUG=INFO`` (DDP's logging data)."""
        return self._observer.logging_data()

    def lower(self, state: Any, batch: Any, rng: Any = None, mask: Any = None) -> Any:
        """The lowered step (``.as_text()``, ``.compile()``), without running it."""
        return self._jitted.lower(self.init(state), batch, rng, mask)


def _structs(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


def _check_state(state: Any) -> None:
    if not (hasattr(state, "params") and hasattr(state, "apply_gradients")):
        raise TypeError(
            "state must be a flax.training.train_state.TrainState (something with "
            f".params and .apply_gradients), got {type(state).__name__}. For Flax NNX "
            "use fdp.nnx_train_step."
        )


def _split(state: Any) -> tuple[Any, dict[str, Any]]:
    """The state without its side fields (hook state, batch statistics), and those."""
    side = {f: getattr(state, f) for f in _SIDE_FIELDS if getattr(state, f, None) is not None}
    return (state.replace(**dict.fromkeys(side)) if side else state), side


def _join(core: Any, side: dict[str, Any]) -> Any:
    present = {k: v for k, v in side.items() if v is not None}
    return core.replace(**present) if present else core


def train_step(
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
    model_averager: PeriodicModelAverager | None = None,
    accumulate_steps: int = 1,
    accum_dtype: Any = None,
    per_example: bool = False,
    find_unused_parameters: bool = False,
    buffers: str = "broadcast",
    stats: bool | StatsSchedule = False,
) -> DataParallelStep:
    """Builds a jitted DDP step for a ``flax.training.train_state.TrainState``.

    The step computes per-device gradients of ``loss_fn`` on each device's share
    of the batch, reduces them over the data axis in DDP's buckets (by default
    their mean), and applies them with ``state.apply_gradients``. With the
    default hook the result equals one step on the whole batch on one device.

    Args:
      loss_fn: ``loss_fn(params, batch[, batch_stats][, rng])``. It returns the
        mean loss over its (micro-)batch (or one loss per example with
        ``per_example=True``), or a tuple: ``(loss, aux)`` with ``has_aux``,
        ``(loss, new_batch_stats)`` when the state has ``batch_stats``, and
        ``(loss, (aux, new_batch_stats))`` with both.
      mesh: the mesh (default: all devices on one ``'data'`` axis). Other mesh
        axes are left to the compiler, so parameters may be sharded over them.
      axis_name: the data axis of ``mesh``.
      bucket_cap_mb: DDP's ``bucket_cap_mb`` (MiB).
      first_bucket_cap_mb: cap of the first bucket (MiB).
      has_aux: ``loss_fn`` returns aux values, averaged over the data axis
        (integer and bool leaves summed) into ``metrics['aux']``.
      donate: donate the input state's buffers (it must not be used after).
      layout: ``'auto'`` (``'flat'`` on CPU with several processes, else
        ``'leaves'``), ``'leaves'`` (no copies) or ``'flat'`` (DDP's packed
        bucket buffers, kept apart by XLA:CPU); see :func:`fdp.reduce_gradients`.
      comm_hook: a :class:`fdp.hooks.CommHook` or a hook name (default: the
        mean all-reduce). Hooks with state need :class:`fdp.TrainState`.
      model_averager: a :class:`fdp.hooks.PeriodicModelAverager` that averages
        parameters over the data axis periodically (post-local SGD).
      accumulate_steps: split each device's share into this many micro-batches,
        accumulate their gradients locally and reduce once (DDP's ``no_sync``).
      accum_dtype: accumulation dtype (default: float32 for 16-bit parameters).
      per_example: ``loss_fn`` returns one loss per example. Batches that do not
        split evenly are then padded and masked, and ``step(..., mask=w)``
        weighs examples (0 for padding); the loss is the mean over real examples.
      find_unused_parameters: leave parameters that do not take part in the
        loss (found from the traced program), and their optimizer state,
        untouched; parameters used only inside a ``lax.cond`` branch are left
        untouched in steps where no device used them.
      buffers: how ``state.batch_stats`` updated by the forward pass is kept:
        ``'broadcast'`` (device 0's, DDP's default), ``'mean'`` (averaged over
        the data axis) or ``'local'`` (one copy per device).
      stats: sample runtime statistics (``step.stats()``) at any debug level:
        ``True`` (steps 1-10, then every 100th) or a :class:`fdp.StatsSchedule`.
        They are sampled at ``FDP_DEBUG=INFO`` and above anyway.

    Returns:
      A :class:`DataParallelStep`: ``state, metrics = step(state, batch)``,
      where ``metrics['loss']`` is the loss over the whole batch.

    Raises:
      ValueError: the mesh has no ``axis_name`` axis, a cap is not positive, an
        unknown hook name or buffer mode.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax.training.train_state import TrainState
      >>> import fdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)},
      ...                           tx=optax.sgd(0.1))
      >>> state = fdp.replicate(state)
      >>> batch = fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones(8)})
      >>> step = fdp.train_step(loss_fn)
      >>> state, metrics = step(state, batch)
      >>> float(metrics["loss"]), [round(float(w), 4) for w in state.params["w"]]
      (1.0, [0.2, 0.2])
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
        model_averager=model_averager,
        accumulate_steps=accumulate_steps,
        accum_dtype=accum_dtype,
        per_example=per_example,
        find_unused_parameters=find_unused_parameters,
        buffers=buffers,
    )
    return DataParallelStep(loss_fn, cfg, stats)
