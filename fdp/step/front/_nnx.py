"""``fdp.nnx_train_step``: the DDP step for a Flax NNX model and ``nnx.Optimizer``."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, cast

import flax.errors
from flax import nnx
from jax.sharding import PartitionSpec as P

from fdp.bucketing import BucketPlan, plan_for
from fdp.data._model_axes import model_specs
from fdp.observe._stats import StatsSchedule
from fdp.runtime import _heartbeat as heartbeat
from fdp.step.core._comm_state import LEGACY_ATTR, HookState, NNXCommState
from fdp.step.core._plan import StepPlan, prepare
from fdp.step.core._runner import STALE
from fdp.step.core._state import (
    add_device_axis,
    hook_is_stateful,
    init_hook_state,
    replicate_over_data,
    strip_device_axis,
)
from fdp.step.core._step import Step
from fdp.step.core._update import Parts, View
from fdp.step.grads._batch import batch_rows, local_batch_struct
from fdp.step.grads._local_grads import Objective
from fdp.step.grads._loss import call_loss
from fdp.step.layout._sharded_init import build_sharded, shardings_of
from fdp.step.layout._zero import place
from fdp.step.options._config import LossFn, StepConfig


@dataclasses.dataclass(frozen=True)
class _ModelLoss:
    """The user's ``loss_fn(model, batch)`` as a function of the model's arrays (hashable)."""

    loss_fn: Any
    graphdef: Any

    def __call__(self, params: Any, batch: Any, keys: Any, rest: Any) -> Any:
        # copy=True: fresh Variables at this trace level, which the forward pass
        # may mutate (batch statistics, rng counters).
        return self.loss_fn(nnx.merge(self.graphdef, params, keys, rest, copy=True), batch)


def _split_model(model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[Any, Any, Any, Any]:
    """``(graphdef, params, rng keys, other state)`` of ``model``."""
    graphdef, params, keys, rest = nnx.split(model, optimizer.wrt, nnx.RngKey, ...)
    return graphdef, params, keys, rest


def split_hook_state(objects: Any) -> tuple[Any, Any, Any]:
    """``nnx.split(objects, HookState, ...)``, the hook's part ``{}`` where it holds nothing.

    An empty ``nnx.State`` flattens in Python at every call of the program (a hook
    without state, the common case); an empty dict flattens in jit's C++, and
    ``nnx.merge``/``nnx.update`` take it as they take the empty state.
    """
    graphdef, comm, rest = nnx.split(objects, HookState, ...)
    return graphdef, (comm if comm else {}), rest


def _hook_variable(optimizer: nnx.Optimizer, holder: NNXCommState | None) -> HookState | None:
    """Where the hook's state is: the :class:`NNXCommState` given, else fdp 0.1's attribute."""
    if holder is not None:
        return holder.comm_state
    return getattr(optimizer, LEGACY_ATTR, None)  # deprecated; set only when no holder is given


@dataclasses.dataclass(frozen=True)
class NNX:
    """How the step reads and updates NNX objects (see :class:`fdp.step.core._update.FrontEnd`).

    The objects are ``(model, optimizer, comm_state)``, the last an
    :class:`NNXCommState` or None. The jitted step gets their graph as ``static``
    and ``(comm, state)``: the hook's state (:class:`HookState` variables,
    stacked per device) and the rest; the step merges them into objects,
    takes the gradient of the optimizer's ``wrt`` variables, keeps the other
    variables the forward pass changes as buffers, and folds the model's
    ``nnx.Rngs`` keys per device.
    """

    loss_fn: Any

    def split(self, static: Any, state: Any) -> Parts:
        comm, rest = state
        return Parts(rest, None, comm)

    def join(self, static: Any, parts: Parts) -> Any:
        return parts.hook_state, parts.owner

    def specs(self, config: StepConfig, parts: Parts) -> Parts:
        return Parts(P(), P(), P(config.axis_name))

    def open(self, config: StepConfig, static: Any, parts: Parts, *, local: bool) -> View:
        comm = strip_device_axis(parts.hook_state) if local else parts.hook_state
        model, optimizer, holder = nnx.merge(static, comm, parts.owner)
        model_def, params, keys, rest = _split_model(model, optimizer)
        variable = _hook_variable(optimizer, holder)
        hook_state = None if variable is None else variable.get_value()
        return View((model, optimizer, holder), params, rest, hook_state, keys, model_def)

    def objective(self, config: StepConfig, view: View, keys: Any) -> Objective:
        model_def, optimizer = view.extra, view.owner[1]

        def objective(p: Any, micro: Any, carry: Any, key: Any) -> tuple:
            del key
            m = nnx.merge(model_def, p, keys, carry, copy=True)
            loss, aux, _ = call_loss(self.loss_fn, config, False, m, micro)
            return loss, aux, _split_model(m, optimizer)[3]

        return objective

    def local_buffers(self, buffers: Any) -> Any:
        return buffers

    def buffer_spec(self, config: StepConfig, buffers: Any) -> Any:
        return P()

    def wrap_buffers(self, like: Any, buffers: Any) -> Any:
        return buffers

    def set_buffers(self, owner: Any, buffers: Any) -> Any:
        nnx.update(owner[0], buffers)
        return owner

    def params(self, owner: Any) -> Any:
        model, optimizer = owner[:2]
        return nnx.as_pure(nnx.state(model, optimizer.wrt))

    def opt_state(self, owner: Any) -> Any:
        return nnx.as_pure(owner[1].opt_state)

    def with_arrays(self, owner: Any, params: Any, opt_state: Any) -> Any:
        model, optimizer = owner[:2]
        nnx.update(model, params)
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
        return owner

    def apply(self, owner: Any, grads: Any) -> Any:
        owner[1].update(owner[0], grads)
        return owner

    def count(self, owner: Any) -> Any:
        return owner[1].step[...]

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
        if hook_state is not None:
            cast(HookState, _hook_variable(owner[1], owner[2])).set_value(hook_state)
        comm, state = split_hook_state(owner)[1:]
        return Parts(state, None, add_device_axis(comm) if local else comm)


class NNXDataParallelStep(Step):
    """A compiled data-parallel step for Flax NNX; build it with :func:`nnx_train_step`.

    Call it as ``metrics = step(model, optimizer, batch[, mask])``: like
    ``nnx.jit`` steps, it updates ``model`` and ``optimizer`` in place. A
    stateful comm hook (PowerSGD) keeps its state in an :class:`fdp.NNXCommState`
    that :meth:`init` returns and every call takes, ``step(model, optimizer,
    batch, comm_state=comm_state)``, updating it in place too: an object the
    caller holds, as it holds the optimizer, and checkpoints with the rest. The
    step itself is :class:`fdp.step.core._step.Step`, shared with Linen; this class
    adds the NNX calling convention.
    """

    def __init__(self, loss_fn: LossFn, cfg: StepConfig, stats: bool | StatsSchedule = False):
        super().__init__(
            "fdp.nnx_train_step",
            NNX(loss_fn),
            loss_fn,
            cfg,
            arg_names=("graphdef", "state", "batch", "rng", "mask"),
            stats=stats,
        )
        self._placed = False
        self._stateful_hook: bool | None = None  # known once hook state was made
        # Set once a comm_state was handed out (init) or given (a call): from then on a
        # stateful hook's calls must all be given it.
        self._holder_given = False

    def _plan(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any, mask: Any) -> StepPlan:
        cfg = self.config
        rows = batch_rows(batch, mask, cfg)
        graphdef, params, keys, rest = _split_model(model, optimizer)
        if cfg.zero_stage:
            self._remember_shapes(params, nnx.state(optimizer.opt_state))
        micro_batch = local_batch_struct(batch, rows, cfg)
        loss = _ModelLoss(self.loss_fn, graphdef)
        try:
            mesh, axis = cfg.bound_mesh, cfg.axis_name
            layouts = model_specs(params, mesh, axis)
            plan = prepare(cfg, loss, rows, params, micro_batch, keys, rest, layouts=layouts)
            # In the leaf order of nnx.as_pure(optimizer.opt_state), the front end's.
            return plan.with_opt_layouts(model_specs(optimizer.opt_state, mesh, axis))
        except flax.errors.TraceContextError as e:
            raise _captured_object_error(e) from e

    def init(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any = None) -> NNXCommState:
        """Places ``model`` and ``optimizer`` on the mesh; returns the comm hook's state.

        The documented way to start, as ``tx.init`` is for an optimizer's state:
        ``comm_state = step.init(model, optimizer)``, then ``step(model,
        optimizer, batch, comm_state=comm_state)``. The returned
        :class:`fdp.NNXCommState` holds a stateful hook's state (PowerSGD's),
        made from the parameters, and nothing for a hook without state; fdp
        adds nothing to ``model`` or ``optimizer``. Checkpoint it with them
        (``(model, optimizer, comm_state)``); to restore, make the template
        with this call. A step called on objects not yet placed still places
        them at its first call, as fdp 0.1 did. With ``batch``, the parameters
        the loss does not use are known, and left out of the buckets that
        shape the hook's state (with ``find_unused_parameters``).
        """
        buckets = self._check_and_place(model, optimizer, batch)
        holder = NNXCommState()
        self._fill(model, optimizer, buckets, holder)
        self._holder_given = True
        return holder

    def _agree_objects(
        self,
        at: str,
        plan: StepPlan | None,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        **args: Any,
    ) -> None:
        """:meth:`_agree` on the objects' state and settings, and ``args``."""
        state = nnx.state((model, optimizer))
        self._agree(at, plan, optimizer=_optimizer(model, optimizer), state=state, **args)

    def _check_and_place(
        self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any
    ) -> BucketPlan | None:
        """Checks and places the objects; the buckets of ``batch``'s plan (None without one)."""
        _check_optimizer(optimizer)
        plan = None if batch is None else self._plan(model, optimizer, batch, None)
        self._agree_objects("init", plan, model, optimizer, batch=batch)
        if not self._placed:
            self._place(model, optimizer)
            self._placed = True
        return None if plan is None else plan.buckets

    def _fill(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        buckets: BucketPlan | None,
        holder: NNXCommState | None,
    ) -> None:
        """Makes a stateful hook's state, where it is missing: in ``holder``, else fdp 0.1's place.

        Without ``holder`` (deprecated), the state goes where fdp 0.1 put it, an
        attribute on ``optimizer`` (:data:`~fdp.step.core._comm_state.LEGACY_ATTR`).
        """
        if _hook_variable(optimizer, holder) is not None:
            return
        cfg = self.config
        params = nnx.state(model, optimizer.wrt)
        if buckets is None:
            buckets = self.plan
        if buckets is None:  # no batch yet: every leaf, keyed by layout as the step's plan is
            layouts = model_specs(params, cfg.bound_mesh, cfg.axis_name)
            caps = (cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
            buckets = plan_for(params, *caps, layouts=layouts)
        self._stateful_hook = hook_is_stateful(cfg, buckets)
        if not self._stateful_hook:
            return
        variable = HookState(init_hook_state(cfg, buckets, params, stacked=False))
        if holder is not None:
            holder.comm_state = variable
        else:
            setattr(optimizer, LEGACY_ATTR, variable)  # deprecated: fdp 0.1's place

    def _place(self, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        """Places ``model`` and ``optimizer`` (arrays, or shape structs) in the step's layout."""
        # On the mesh before the first step: the step's outputs are, and inputs placed
        # otherwise would compile the step a second time on the next call. With
        # several processes this also hands everyone process 0's values.
        cfg = self.config
        nnx.update((model, optimizer), replicate_over_data(cfg, nnx.state((model, optimizer))))
        if cfg.zero_stage:
            self._place_zero(model, optimizer)

    def abstract_init(
        self, make: Callable[..., tuple[nnx.Module, nnx.Optimizer]], *args: Any
    ) -> tuple[nnx.Module, nnx.Optimizer]:
        """The model and optimizer :meth:`init_sharded` builds, as shapes; nothing runs.

        A template for restoring a checkpoint straight into the step's layout:
        ``ckpt.restore(step.abstract_init(make, key))`` fills the abstract
        model and optimizer in place with each device's share, never whole.

        Args:
          make: builds ``(model, optimizer)`` from ``args``.
          *args: its array arguments (a PRNG key); close over the rest.

        Returns:
          ``(model, optimizer)`` (``nnx.eval_shape``) whose variables hold
          ``jax.ShapeDtypeStruct`` values carrying the step's shardings.
        """
        model, optimizer = _built_pair(nnx.eval_shape(make, *args))
        self._place(model, optimizer)
        return model, optimizer

    def init_sharded(
        self, make: Callable[..., tuple[nnx.Module, nnx.Optimizer]], *args: Any
    ) -> tuple[nnx.Module, nnx.Optimizer]:
        """``make(*args)`` built directly in the step's layout, then placed.

        The way to start a model too large to exist whole on one device: the
        model and optimizer are built under ``jit`` with ``out_shardings`` set
        to the layout the step gives each variable (:meth:`abstract_init`), so
        each device computes and holds only its share of the sharded ones (the
        optimizer state from stage 1, the parameters too at stage 3). The
        result equals ``make(*args)`` after ``step.init`` exactly. A stateful
        comm hook's state comes from ``step.init(model, optimizer)`` on the
        result, which places nothing again.

        Args:
          make: builds ``(model, optimizer)`` from ``args``, for example
            ``lambda key: (m := Model(rngs=nnx.Rngs(key)), nnx.Optimizer(m, tx,
            wrt=nnx.Param))``.
          *args: its array arguments (a PRNG key); close over the rest.

        Returns:
          ``(model, optimizer)``, placed as :meth:`init` places them.

        Raises:
          TypeError: ``make`` does not return ``(model, nnx.Optimizer)``.
        """
        graphdef, abstract = nnx.split(self.abstract_init(make, *args))

        def build(*a: Any) -> Any:
            return nnx.split(make(*a))[1]

        state = build_sharded(build, args, shardings_of(abstract))
        model, optimizer = nnx.merge(graphdef, state)
        self._placed = True  # placing again would first replicate: whole on every device
        self._check_and_place(model, optimizer, None)
        return model, optimizer

    def _place_zero(self, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        """Shards the optimizer state (and at stage 3 the parameters) over the data axis."""
        cfg = self.config
        mesh, axis = cfg.bound_mesh, cfg.shard_axis
        # What describe shows is read before the optimizer state is padded.
        self._remember_shapes(nnx.state(model, optimizer.wrt), nnx.state(optimizer.opt_state))
        opt_state = place(nnx.state(optimizer.opt_state), mesh, axis, pad=True)
        nnx.update(optimizer.opt_state, opt_state)
        if cfg.zero_stage >= 3:
            nnx.update(model, place(nnx.state(model, optimizer.wrt), mesh, axis))

    def __call__(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        batch: Any,
        mask: Any = None,
        *,
        comm_state: NNXCommState | None = None,
    ) -> dict[str, Any]:
        """Runs one step in place and returns the metrics.

        Args:
          model: the model, updated in place.
          optimizer: its ``nnx.Optimizer``, updated in place.
          batch: the global batch (``fdp.shard_batch``).
          mask: per-example weights (with ``fdp.Loss(per_example=True)``), or None.
          comm_state: the comm hook's state from :meth:`init`, updated in place;
            needed by a stateful hook (an empty ``fdp.NNXCommState()`` is
            filled at the first call). Without it, a stateful hook's state is
            kept as fdp 0.1 kept it, on the optimizer, with a
            ``DeprecationWarning``.
        """
        heartbeat.step_entered()  # for fdp launch's hang detection (a no-op outside it)
        if comm_state is not None:
            self._holder_given = True
        elif self._holder_given and self._stateful_hook:
            raise ValueError(
                f"comm_state: comm hook {self.config.comm_hook.name!r} keeps its state in the "
                "fdp.NNXCommState this step made or was given before; pass it on every call "
                "(step(model, optimizer, batch, comm_state=comm_state)), got None. Without "
                "it the hook would start again from a fresh state."
            )
        objects = (model, optimizer, comm_state)
        if self._fast is not None and self._ready(objects):  # jit's dispatch and NNX's split
            if _hook_variable(optimizer, comm_state) is None:
                # No hook state in the objects: NNX's split without filters, half the
                # cost of split_hook_state's, gives the same graph and the same rest.
                graphdef, state = nnx.split(objects)
                comm = {}
            else:
                graphdef, comm, state = split_hook_state(objects)
            self._check_alive(optimizer.step.get_raw_value(), (graphdef, state, batch, None, mask))
            out = self._run_fast(graphdef, (comm, state), batch, None, mask)
            if out is not STALE:
                (comm, state), metrics = out
                if comm:
                    nnx.update(objects, comm, state)
                else:
                    nnx.update(objects, state)
                self._warn_legacy(optimizer, comm_state)
                return metrics
        plan, graphdef, comm, state = self._prepare_call(objects, batch, mask)
        (comm, state), metrics = self._run(plan, graphdef, (comm, state), batch, None, mask)
        nnx.update(objects, comm, state)
        self._warn_legacy(optimizer, comm_state)
        return metrics

    def split(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        *,
        comm_state: NNXCommState | None = None,
    ) -> tuple[Any, tuple[Any, Any]]:
        """``(graphdef, state)`` for :meth:`apply`: the objects placed (as by :meth:`init`), split.

        The in-place call splits and updates the objects at every step, as
        ``nnx.jit`` does: Python that walks the whole graph (hundreds of
        microseconds for a small model). Split once instead, as with ``jax.jit``
        over ``nnx.split`` state, and each step costs jit's dispatch: the same
        compiled program as the in-place call. Write the state back with
        ``nnx.update((model, optimizer, comm_state), *state)``, or make new
        objects with :meth:`merge`.

        Args:
          model: the model.
          optimizer: its ``nnx.Optimizer``.
          comm_state: a stateful hook's :class:`fdp.NNXCommState` from
            :meth:`init` (one is made when None and the hook keeps state).

        Returns:
          ``(graphdef, state)``: the objects' graph (static) and their arrays,
          ``state = (hook_state, rest)``; ``hook_state`` is ``{}`` for a hook that
          keeps no state (``nnx.update`` and ``nnx.merge`` take it as they take
          an empty ``nnx.State``, and it costs nothing to pass).

        Example:
          >>> import jax.numpy as jnp, optax
          >>> from flax import nnx
          >>> import fdp
          >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
          >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
          >>> step = fdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
          >>> graphdef, state = step.split(model, optimizer)
          >>> batch = fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones((8, 1))})
          >>> for _ in range(3):
          ...     state, metrics = step.apply(graphdef, state, batch)
          >>> nnx.update((model, optimizer, None), *state)
          >>> int(optimizer.step.get_value())
          3
        """
        if comm_state is None:
            buckets = self._check_and_place(model, optimizer, None)
            self._fill(model, optimizer, buckets, None)
            if hasattr(optimizer, LEGACY_ATTR):  # a stateful hook: its state goes in a holder
                variable = getattr(optimizer, LEGACY_ATTR)
                delattr(optimizer, LEGACY_ATTR)
                comm_state = NNXCommState()
                comm_state.comm_state = variable
        else:
            _check_comm_state(optimizer, comm_state)
            buckets = self._check_and_place(model, optimizer, None)
            self._fill(model, optimizer, buckets, comm_state)
        graphdef, comm, rest = split_hook_state((model, optimizer, comm_state))
        return graphdef, (comm, rest)

    def apply(
        self, graphdef: Any, state: tuple[Any, Any], batch: Any, mask: Any = None
    ) -> tuple[tuple[Any, Any], dict[str, Any]]:
        """Runs one step on :meth:`split` state: ``(graphdef, state, batch) -> (state, metrics)``.

        The step the in-place call runs, with none of NNX's per-call graph
        walks: a call with a signature seen before is jit's dispatch. ``state``
        is donated (unless the step was built with ``donate=False``): use the
        state this returns.

        Args:
          graphdef: the graph from :meth:`split`.
          state: ``(hook_state, rest)`` from :meth:`split` or the previous call.
          batch: the global batch (``fdp.shard_batch``).
          mask: per-example weights (with ``fdp.Loss(per_example=True)``), or None.

        Returns:
          ``(state, metrics)``.
        """
        alone = self._alone
        if alone is not None and graphdef is self._fast.statics[0]:  # type: ignore[union-attr]
            beats = self._beats  # under fdp launch (entering twice, below too, is harmless)
            if beats:
                heartbeat.step_entered()
            try:  # the last signature's program, needing nothing else: jit's cost
                out = alone(state, batch, None, mask)
            except (TypeError, ValueError, RuntimeError) as e:
                if not self._passed_on(e, _optimizer_step(state)):
                    raise
            else:
                if beats:
                    heartbeat.step_done()
                return out
        heartbeat.step_entered()  # for fdp launch's hang detection (a no-op outside it)
        args = (graphdef, state, batch, None, mask)
        self._check_alive(_optimizer_step(state), args)
        out = STALE
        if self._fast is not None:
            out = self._run_fast(graphdef, state, batch, None, mask)
            if out is not STALE and alone is None:
                self._program_alone()
        if out is STALE:
            objects = nnx.merge(graphdef, *state)
            plan, again, comm, rest = self._prepare_call(objects, batch, mask)
            # The caller's graph where it is the same: the next calls find it by identity.
            graphdef = graphdef if again == graphdef else again
            out = self._run(plan, graphdef, (comm, rest), batch, None, mask)
        return out

    def merge(self, graphdef: Any, state: tuple[Any, Any]) -> tuple[Any, Any, Any]:
        """New ``(model, optimizer, comm_state)`` from :meth:`split` state (``nnx.merge``)."""
        return nnx.merge(graphdef, *state)

    def lower(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        batch: Any,
        mask: Any = None,
        *,
        comm_state: NNXCommState | None = None,
    ) -> Any:
        """The lowered step, without running it (``comm_state`` as in a call).

        Without ``comm_state`` a stateful hook's state is made for the lowering
        alone: nothing is added to ``optimizer``.
        """
        if comm_state is None and not hasattr(optimizer, LEGACY_ATTR):
            comm_state = NNXCommState()  # for this lowering only
        plan, graphdef, comm, state = self._prepare_call(
            (model, optimizer, comm_state), batch, mask
        )
        self._warn_legacy(optimizer, comm_state)
        return self._lower(plan, graphdef, (comm, state), batch, None, mask)

    def _ready(self, objects: tuple[nnx.Module, nnx.Optimizer, NNXCommState | None]) -> bool:
        """Checks the objects (O(1)); whether they are placed and hold what the hook keeps."""
        _, optimizer, holder = objects
        _check_optimizer(optimizer)
        _check_comm_state(optimizer, holder)
        variable = _hook_variable(optimizer, holder)
        return self._placed and (self._stateful_hook is False or variable is not None)

    def _warn_legacy(self, optimizer: nnx.Optimizer, holder: NNXCommState | None) -> None:
        """Warns when a stateful hook's state is kept as fdp 0.1 kept it (no ``comm_state``)."""
        if holder is None and _hook_variable(optimizer, None) is not None:
            warnings.warn(
                _LEGACY_WARNING.format(hook=self.config.comm_hook.name),
                DeprecationWarning,
                stacklevel=3,
            )

    def _prepare_call(
        self, objects: tuple[nnx.Module, nnx.Optimizer, NNXCommState | None], batch: Any, mask: Any
    ) -> tuple[StepPlan, Any, Any, Any]:
        """The plan and the split ``(graphdef, hook state, state)`` of one call."""
        model, optimizer, holder = objects
        if not self._ready(objects):
            with heartbeat.compiling():  # it traces: never a hang for fdp launch
                first = self._plan(model, optimizer, batch, mask)
            self._agree_objects("call", first, model, optimizer, batch=batch, mask=mask)
            with heartbeat.compiling():
                if not self._placed:
                    self._place(model, optimizer)
                    self._placed = True
                self._fill(model, optimizer, first.buckets, holder)
        graphdef, comm, state = split_hook_state(objects)
        plan = self._plan_for(
            (graphdef, state, batch, None, mask), lambda: self._plan(model, optimizer, batch, mask)
        )
        return plan, graphdef, comm, state


_LEGACY_WARNING = (
    "fdp.nnx_train_step: comm hook {hook!r} keeps state between steps, and keeping it on "
    "the optimizer (optimizer.fdp_comm_state, set by fdp) without comm_state= is "
    "deprecated and goes in the next release. Hold it yourself: comm_state = "
    "step.init(model, optimizer), then step(model, optimizer, batch, "
    "comm_state=comm_state), and checkpoint (model, optimizer, comm_state)."
)


def _optimizer_step(state: tuple[Any, Any]) -> Any:
    """The optimizer's step count in :meth:`NNXDataParallelStep.split` state (None if elsewhere).

    One leaf, read in O(1) to tell a donated state (every leaf is deleted at once).
    """
    try:
        return state[1][1]["step"].get_raw_value()
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def _check_comm_state(optimizer: nnx.Optimizer, holder: Any) -> None:
    """Raises unless ``holder`` is None or an :class:`NNXCommState` the optimizer does not rival."""
    if holder is None:
        return
    if not isinstance(holder, NNXCommState):
        raise TypeError(
            "comm_state must be the fdp.NNXCommState that step.init(model, optimizer) "
            f"returns, or None, got {type(holder).__name__}."
        )
    if hasattr(optimizer, LEGACY_ATTR):
        raise ValueError(
            "comm_state was given, and the optimizer also holds a comm hook's state as "
            "fdp 0.1 kept it (optimizer.fdp_comm_state, set by a step called without "
            "comm_state=, or restored from such a checkpoint): the step would not know which "
            "to use. Pass comm_state= on every call; to keep the saved state, restore the "
            "checkpoint into a fresh (model, optimizer, comm_state) with comm_state = "
            "step.init(model, optimizer): fdp moves it into comm_state."
        )


def _built_pair(built: Any) -> tuple[nnx.Module, nnx.Optimizer]:
    """``built`` if it is ``(model, optimizer)``, else an error naming what ``make`` returned."""
    if (
        not isinstance(built, tuple)
        or len(built) != 2
        or not isinstance(built[0], nnx.Module)
        or not isinstance(built[1], nnx.Optimizer)
    ):
        raise TypeError(
            "make must return (model, optimizer): an nnx.Module and the nnx.Optimizer "
            f"over it, got {type(built).__name__}."
        )
    return built


def _captured_object_error(error: Exception) -> TypeError:
    """The error for an NNX object mutated from inside the step's trace, naming the fix."""
    return TypeError(
        "loss_fn changes an NNX object that is not the model, such as an nnx.Rngs captured "
        "from outside (`lambda m, b: loss_fn(m, b, rngs)`): NNX objects can only change at "
        "the trace level they come from, and fdp.nnx_train_step traces loss_fn(model, "
        "batch) with the model alone. Either keep the Rngs in the model (`self.rngs = "
        "rngs` in __init__, or nnx.Dropout(rate, rngs=rngs)), or keep your own step "
        "`train_step(model, optimizer, metrics, rngs, batch)` and decorate it with "
        "@fdp.ddp, which takes the rngs as an argument (add `grads = "
        f"fdp.reduce_gradients(grads)` after taking them). JAX said: {error}"
    )


def _optimizer(model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[Any, Any, Any]:
    """``(tx, opt_state, params)`` as ``optimizer.update`` passes them to ``tx.update``."""
    params = nnx.as_pure(nnx.state(model, optimizer.wrt))
    return optimizer.tx, nnx.as_pure(optimizer.opt_state), params


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}. "
            "For a Linen TrainState use fdp.train_step."
        )
