"""``fdp.train_step``: the DDP step for a Flax Linen ``TrainState``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fdp.bucketing import plan_for
from fdp.data._model_axes import model_specs
from fdp.observe._stats import StatsSchedule
from fdp.runtime import _heartbeat as heartbeat
from fdp.step.core._plan import StepPlan, prepare
from fdp.step.core._runner import STALE
from fdp.step.core._state import (
    PerDevice,
    add_device_axis,
    hook_is_stateful,
    join_side,
    linen_layout,
    linen_state_ready,
    prepare_linen_state,
    split_side,
    strip_device_axis,
    unstacked,
)
from fdp.step.core._step import Step
from fdp.step.core._update import Parts, View
from fdp.step.grads._batch import batch_rows, local_batch_struct
from fdp.step.grads._local_grads import Objective
from fdp.step.grads._loss import call_loss
from fdp.step.layout._sharded_init import build_sharded, shardings_of
from fdp.step.options._config import LossFn, StepConfig


@dataclasses.dataclass(frozen=True)
class Linen:
    """How the step reads and updates a ``TrainState`` (:class:`~fdp.step.core._update.FrontEnd`).

    The parameters and optimizer state are the state's; ``batch_stats`` are the
    buffers (:class:`PerDevice` with ``buffers='local'``), ``comm_state`` the hook's.
    With a hook whose replicas diverge, every leaf has a leading device axis.
    """

    loss_fn: Any

    def split(self, static: Any, state: Any) -> Parts:
        core, side = split_side(state)
        return Parts(core, side.get("batch_stats"), side.get("comm_state"))

    def join(self, static: Any, parts: Parts) -> Any:
        return join_side(
            parts.owner, {"batch_stats": parts.buffers, "comm_state": parts.hook_state}
        )

    def specs(self, config: StepConfig, parts: Parts) -> Parts:
        data = P(config.axis_name)
        state = data if config.per_device_state else P()
        return Parts(state, data if isinstance(parts.buffers, PerDevice) else state, data)

    def open(self, config: StepConfig, static: Any, parts: Parts, *, local: bool) -> View:
        core, stats, comm = parts
        wrapped = isinstance(stats, PerDevice)
        if not local:
            return View(core, core.params, stats, comm, extra=wrapped)
        if config.per_device_state:
            core, stats = strip_device_axis((core, stats))
        else:
            stats = self.local_buffers(stats)
        hook_state = None if comm is None else strip_device_axis(comm)
        return View(core, core.params, stats, hook_state, extra=wrapped)

    def objective(self, config: StepConfig, view: View, keys: Any) -> Objective:
        has_stats = view.buffers is not None

        def objective(p: Any, micro: Any, carry: Any, key: Any) -> tuple:
            args = (p, micro) + ((carry,) if has_stats else ()) + (() if key is None else (key,))
            loss, aux, new_stats = call_loss(self.loss_fn, config, has_stats, *args)
            return loss, aux, (new_stats if has_stats else carry)

        return objective

    def local_buffers(self, buffers: Any) -> Any:
        return strip_device_axis(buffers.value) if isinstance(buffers, PerDevice) else buffers

    def buffer_spec(self, config: StepConfig, buffers: Any) -> Any:
        return P(config.axis_name) if isinstance(buffers, PerDevice) else P()

    def wrap_buffers(self, like: Any, buffers: Any) -> Any:
        return PerDevice(add_device_axis(buffers)) if isinstance(like, PerDevice) else buffers

    def set_buffers(self, owner: Any, buffers: Any) -> Any:
        return owner  # batch_stats travel beside the TrainState

    def params(self, owner: Any) -> Any:
        return owner.params

    def opt_state(self, owner: Any) -> Any:
        return owner.opt_state

    def with_arrays(self, owner: Any, params: Any, opt_state: Any) -> Any:
        return owner.replace(params=params, opt_state=opt_state)

    def apply(self, owner: Any, grads: Any) -> Any:
        return owner.apply_gradients(grads=grads)

    def count(self, owner: Any) -> Any:
        return owner.step

    def close(
        self,
        config: StepConfig,
        view: View,
        owner: Any,
        buffers: Any,
        hook_state: Any,
        *,
        local: bool,
    ) -> Parts:
        if not local:
            return Parts(owner, buffers, hook_state)
        if config.per_device_state:
            owner, buffers = add_device_axis((owner, buffers))
        elif view.extra:  # PerDevice batch_stats (buffers='local')
            buffers = PerDevice(add_device_axis(buffers))
        comm = None if hook_state is None else add_device_axis(hook_state)
        return Parts(owner, buffers, comm)


class DataParallelStep(Step):
    """A compiled data-parallel training step; build it with :func:`train_step`.

    Call it as ``state, metrics = step(state, batch)``, optionally with ``rng``
    (dropout) and ``mask`` (per-example weights). ``plan`` holds the bucket plan
    and ``usage`` the parameter usage of the last call; ``lower`` gives the
    lowered program for inspection. The step itself is :class:`fdp.step.core._step.Step`,
    shared with NNX; this class adds the ``TrainState`` calling convention.
    """

    def __init__(self, loss_fn: LossFn, cfg: StepConfig, stats: bool | StatsSchedule = False):
        super().__init__(
            "fdp.train_step",
            Linen(loss_fn),
            loss_fn,
            cfg,
            arg_names=("static", "state", "batch", "rng", "mask"),
            stats=stats,
        )
        # Known once the first call prepared (placed) the state; until then, None.
        self._stateful_hook: bool | None = None

    def _plan(self, state: Any, batch: Any, rng: Any, mask: Any) -> StepPlan:
        """The plan for these inputs (memoised per shape, computed outside the trace)."""
        # The jitted step's arguments (its static part is None): the names agree.
        return self._plan_for(
            (None, state, batch, rng, mask), lambda: self._compute_plan(state, batch, rng, mask)
        )

    def _compute_plan(self, state: Any, batch: Any, rng: Any, mask: Any) -> StepPlan:
        cfg = self.config
        rows = batch_rows(batch, mask, cfg)
        params, stats = state.params, getattr(state, "batch_stats", None)
        stacked = cfg.per_device_state and jnp.ndim(state.step) > 0  # once prepared
        if stacked:
            params = unstacked(params)
        if isinstance(stats, PerDevice) or (stacked and stats is not None):
            stats = unstacked(stats.value if isinstance(stats, PerDevice) else stats)
        if cfg.zero_stage:
            self._remember_shapes(params, state.opt_state)
        extra = ([] if stats is None else [stats]) + ([] if rng is None else [rng])
        micro_batch = local_batch_struct(batch, rows, cfg)
        mesh, axis = cfg.bound_mesh, cfg.axis_name
        layouts = model_specs(params, mesh, axis)
        plan = prepare(cfg, self.loss_fn, rows, params, micro_batch, *extra, layouts=layouts)
        return plan.with_opt_layouts(model_specs(state.opt_state, mesh, axis))

    def init(self, state: Any) -> Any:
        """Prepares ``state`` for this step, as ``tx.init`` prepares an optimizer's.

        The documented way to start: ``state = step.init(state)``, then train
        (or checkpoint and inspect the prepared state first). A step called on
        an unprepared state still prepares it at its first call, as fdp 0.1
        did. With a hook whose replicas
        diverge (``noop``, ``post_local_sgd``) every leaf gains a leading device
        axis; with ``buffers='local'`` ``batch_stats`` is kept once per device
        (:class:`fdp.PerDevice`); with a stateful hook ``comm_state`` is filled.
        """
        _check_state(state)
        cfg = self.config
        buckets = self.plan
        if buckets is None:  # no batch yet to tell unused parameters: all are bucketed
            stacked = cfg.per_device_state and jnp.ndim(state.step) > 0
            params = unstacked(state.params) if stacked else state.params
            layouts = model_specs(params, cfg.bound_mesh, cfg.axis_name)  # as the step's plan
            buckets = plan_for(params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb, layouts=layouts)
        self._agree("init", None, optimizer=_optimizer(state), state=state)
        if cfg.zero_stage:  # before the optimizer state is padded (fdp.step.layout._padding)
            self._remember_shapes(state.params, state.opt_state)
        return prepare_linen_state(cfg, state, buckets)

    def abstract_init(self, make_state: Callable[..., Any], *args: Any) -> Any:
        """The state :meth:`init_sharded` builds, as shapes with its shardings; nothing runs.

        A template for restoring a checkpoint straight into the step's layout:
        ``fdp.CheckpointManager.restore(step.abstract_init(make_state, key))``
        reads each device's share from disk and never builds the state whole.

        Args:
          make_state: builds the ``TrainState`` from ``args``.
          *args: its array arguments (a PRNG key); close over the rest.

        Returns:
          The ``TrainState`` with ``jax.ShapeDtypeStruct`` leaves carrying the
          shardings the step keeps them in (ZeRO's, or replicated).
        """
        abstract = jax.eval_shape(make_state, *args)
        _check_state(abstract)
        if self.config.zero_stage:
            self._remember_shapes(abstract.params, abstract.opt_state)
        return linen_layout(self.config, abstract)

    def init_sharded(self, make_state: Callable[..., Any], *args: Any) -> Any:
        """``make_state(*args)`` built directly in the step's layout, then prepared.

        The way to start a model too large to exist whole on one device:
        ``make_state`` runs under ``jit`` with ``out_shardings`` set to the
        layout the step gives each leaf (:meth:`abstract_init`), so each device
        computes and holds only its share of the sharded leaves (the optimizer
        state from stage 1, the parameters too at stage 3). The result equals
        ``step.init(make_state(*args))`` exactly (on a mesh with model axes, as
        exactly as ``jax.jit(make_state, out_shardings=...)`` equals
        ``make_state``: jax 0.12 can differ by an ulp there).

        Args:
          make_state: builds the ``TrainState`` from ``args``, for example
            ``lambda key: TrainState.create(apply_fn=model.apply,
            params=model.init(key, x)["params"], tx=tx)``.
          *args: its array arguments (a PRNG key); close over the rest.

        Returns:
          The state, prepared as :meth:`init` prepares it.

        Raises:
          TypeError: ``make_state`` does not build a ``TrainState``.

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> import fdp
          >>> def make_state(key):
          ...     params = {"w": jax.random.normal(key, (16, 4))}
          ...     return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.1))
          >>> step = fdp.train_step(lambda p, b: jnp.mean(b["x"] @ p["w"]),
          ...                        sharding=fdp.Sharding(zero_stage=3))
          >>> state = step.init_sharded(make_state, jax.random.key(0))
          >>> state.params["w"].shape, state.params["w"].addressable_shards[0].data.shape
          ((16, 4), (2, 4))
        """
        layout = self.abstract_init(make_state, *args)
        state = build_sharded(make_state, args, shardings_of(layout))
        return self.init(state)

    def __call__(
        self, state: Any, batch: Any, rng: Any = None, mask: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """Runs one step: ``(state, batch[, rng][, mask]) -> (state, metrics)``."""
        alone = self._alone
        if alone is not None:  # the last signature's program, needing nothing else: jit's cost
            beats = self._beats  # under fdp launch (entering twice, below too, is harmless)
            if beats:
                heartbeat.step_entered()
            try:
                out = alone(state, batch, rng, mask)
            except (TypeError, ValueError, RuntimeError) as e:
                if not self._passed_on(e, getattr(state, "step", None)):
                    raise
            else:
                if beats:
                    heartbeat.step_done()
                return out
        heartbeat.step_entered()  # for fdp launch's hang detection (a no-op outside it)
        _check_state(state)
        self._key_reuse.seen(rng)
        if self._fast is not None:  # a signature seen before: its compiled program
            self._check_alive(getattr(state, "step", None), (None, state, batch, rng, mask))
            out = self._run_fast(None, state, batch, rng, mask)
            if out is not STALE:
                if alone is None:
                    self._program_alone()
                return out
        plan = self._plan(state, batch, rng, mask)
        self._agree(
            "call", plan, optimizer=_optimizer(state), state=state, batch=batch, rng=rng, mask=mask
        )
        stateful = self._stateful_hook
        if stateful is None or not linen_state_ready(self.config, state, stateful):
            state = prepare_linen_state(self.config, state, plan.buckets)
            self._stateful_hook = hook_is_stateful(self.config, plan.buckets)
        return self._run(plan, None, state, batch, rng, mask)

    def lower(self, state: Any, batch: Any, rng: Any = None, mask: Any = None) -> Any:
        """The lowered step (``.as_text()``, ``.compile()``), without running it."""
        _check_state(state)
        plan = self._plan(state, batch, rng, mask)
        self._agree(
            "call", plan, optimizer=_optimizer(state), state=state, batch=batch, rng=rng, mask=mask
        )
        state = prepare_linen_state(self.config, state, plan.buckets)
        return self._lower(plan, None, state, batch, rng, mask)


def _optimizer(state: Any) -> tuple[Any, Any, Any] | None:
    """``(tx, opt_state, params)`` of a ``TrainState``, whose settings are checked once."""
    tx = getattr(state, "tx", None)
    if tx is None or not hasattr(tx, "update") or not hasattr(state, "opt_state"):
        return None
    return tx, state.opt_state, state.params


def _check_state(state: Any) -> None:
    if not (hasattr(state, "params") and hasattr(state, "apply_gradients")):
        raise TypeError(
            "state must be a flax.training.train_state.TrainState (something with "
            f".params and .apply_gradients), got {type(state).__name__}. For Flax NNX "
            "use fdp.nnx_train_step."
        )
