"""What every step front end shares: jit, observability, and the plan of the last call.

A call takes one of two paths. The first call, and any call whose arguments are not of
the previous call's signature, goes through the front end's checks, places the state,
computes the :class:`StepPlan` and finds or compiles the program for that signature:
work that depends only on the inputs' structure, shapes and shardings. A call like the
previous one hands its arguments to that program (``jax.stages.Compiled``), which
costs what ``jax.jit``'s own dispatch costs: the program checks, in C++, that the
arguments are of the signature it was compiled for. Arguments of another signature
(shapes, dtypes, tree, shardings) are refused there with a ``TypeError`` or
``ValueError`` before anything runs or is donated, and the call takes the first path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from fdp import backends
from fdp.bucketing import BucketPlan
from fdp.observe._debug import DebugLevel, debug_level
from fdp.observe._fingerprint import check_settings_across_processes, settings_fingerprint
from fdp.observe._observer import Observer, logging_data
from fdp.observe._stats import StatsSchedule
from fdp.runtime import _heartbeat as heartbeat
from fdp.step.core._in_flight import InFlight
from fdp.step.core._plan import StepPlan
from fdp.step.grads import _finite as finite
from fdp.step.grads._key_reuse import KeyReuse
from fdp.step.grads._usage import ParamUsage
from fdp.step.layout._zero import memory_table, shape_structs
from fdp.step.options._config import StepConfig


class Fast(NamedTuple):
    """The last call's plan and compiled program, for the calls that follow with its signature."""

    plan: StepPlan
    compiled: Any  # jax.stages.Compiled: takes the dynamic arguments alone
    statics: tuple  # the static arguments it was compiled for
    # Whether a call needs nothing but the program (and, under fdp launch, the heartbeat):
    # no in-flight bound, no numerics guard, no observer. Then the front end calls it alone.
    alone: bool


class StepRunner:
    """The base of :class:`fdp.step.core._step.Step`: jit, observability, the plan of the last call.

    The step gives it the function to jit, ``global_step(plan, *args)``, and
    calls :meth:`_run` with a :class:`StepPlan` and the arguments. The runner
    binds the config (at the first call: building a step starts no backend),
    jits with the plan static, routes calls through the observer while it
    watches, and remembers the plan of the last call for ``plan``, ``usage``,
    ``logging_data`` and ``describe``.

    Args:
      kind: the step's name in logs, e.g. ``"fdp.train_step"``.
      config: the step's settings.
      global_step: the function to jit; its first argument is the plan.
      donate_argnums: positions among ``args`` (after the plan) to donate.
      static_argnums: positions among ``args`` that are static (hashable): the leading ones.
      arg_names: names of ``args``, for the DETAIL check.
      batch_arg: position of the global batch among ``args``.
      stats: sample runtime statistics at any debug level.
    """

    def __init__(
        self,
        kind: str,
        config: StepConfig,
        global_step: Callable[..., Any],
        *,
        donate_argnums: tuple[int, ...],
        static_argnums: tuple[int, ...] = (),
        arg_names: tuple[str, ...],
        batch_arg: int,
        stats: bool | StatsSchedule = False,
    ):
        self._kind = kind
        self._config = config
        self._global_step = global_step
        self._donate_argnums = donate_argnums
        if static_argnums != tuple(range(len(static_argnums))):
            raise ValueError(f"static_argnums must lead the arguments, got {static_argnums}")
        self._static_argnums = static_argnums
        self._jitted: Any = None
        self._last_plan: StepPlan | None = None
        self._plans: dict[Any, StepPlan] = {}
        self._ran: set[StepPlan] = set()  # plans called once: compiled (for the heartbeat)
        self._held: tuple[Any, Any] | None = None  # shapes of (params, opt_state), ZeRO
        self._arg_names = arg_names
        self._observer = Observer(kind, arg_names, batch_arg, stats)
        self._agreed: set[str] = set()  # where the processes compared their settings
        self._calls = 0  # for the numerics guard's message
        self._key_reuse = KeyReuse(kind)  # a dropout key passed unchanged: warned once
        self._queue: InFlight | bool | None = False  # the platform's bound; False: undecided
        # The last call's plan and program, for the next one with its signature (see the
        # module's docstring).
        self._fast: Fast | None = None
        self._programs: dict[Any, Fast] = {}  # per signature: a call switching between shapes
        # The last program itself, once a call with its signature needs nothing else
        # (:meth:`_program_alone`): the front end calls it directly, jit's own cost.
        self._alone: Any = None
        self._beats = False  # under fdp launch: the heartbeat around the program alone

    @property
    def config(self) -> StepConfig:
        """The step's settings, bound to its mesh (the first access starts JAX's backend)."""
        if not self._config.bound:
            self._config = self._config.bind()
        return self._config

    @property
    def plan(self) -> BucketPlan | None:
        """The bucket plan of the last call (None before the first call or ``lower``)."""
        return None if self._last_plan is None else self._last_plan.buckets

    @property
    def usage(self) -> ParamUsage | None:
        """How each parameter took part in the loss at the last call (None before it)."""
        return None if self._last_plan is None else self._last_plan.usage

    @property
    def step_plan(self) -> StepPlan | None:
        """The whole :class:`fdp.step.StepPlan` of the last call."""
        return self._last_plan

    def _remember_shapes(self, params: Any, opt_state: Any) -> None:
        """Keeps the shapes of the parameters and optimizer state for :meth:`memory_table`.

        The first call's, for the same parameters: later calls see the optimizer
        state padded (:mod:`fdp.step.layout._padding`), which no longer says what was padded.
        """
        params = shape_structs(params)
        same = self._held is not None and _shapes(self._held[0]) == _shapes(params)
        if not same:
            self._held = (params, shape_structs(opt_state))

    def memory_table(self) -> str | None:
        """What each device holds under ZeRO, as text (None at stage 0 or before a call)."""
        if self._held is None or not self.config.zero_stage:
            return None
        cfg = self.config
        return memory_table(
            cfg.zero_stage, cfg.num_shards, *self._held, scattered=cfg.scatters_gradients
        )

    def _plan_for(self, args: tuple, compute: Callable[[], StepPlan]) -> StepPlan:
        """The plan for a call with ``args``, computed once per their shapes and dtypes.

        ``prepare`` is memoised too, but its key needs the loss's inputs, which an
        NNX step gets only by splitting the model again; this key is one flatten of
        the call's own arguments (``None`` leaves and static values included), so a
        repeated call costs a lookup.
        """
        leaves, treedef = jax.tree.flatten(args)
        # A donated state is deleted by the step; passed again, jaxlib can crash the
        # process (SIGSEGV on a multi-device CPU mesh) instead of raising. Every leaf of
        # a donated argument goes at once, so its first leaf tells (one call per step).
        if leaves and _deleted(leaves[0]):
            raise self._donated_error(args)
        key = (treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", x)) for x in leaves))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:  # new shapes every call: keep memory bounded
                self._plans.clear()
            with heartbeat.compiling():  # it traces: never a hang for fdp launch
                plan = self._plans[key] = compute()
        return plan

    def _check_alive(self, probe: Any, args: tuple) -> None:
        """Refuses a donated state, read from one of its leaves (``probe``), before jit sees it.

        jit refuses a deleted array itself from jaxlib 0.11; 0.10 can crash on a
        multi-device CPU mesh instead, and donation deletes every leaf at once.
        """
        if _deleted(probe):
            raise self._donated_error(args)

    def _donated_error(self, args: tuple) -> RuntimeError:
        where = ""
        for i, arg in enumerate(args):
            gone = [p for p, x in jax.tree_util.tree_flatten_with_path(arg)[0] if _deleted(x)]
            if gone:
                name = self._arg_names[i] if i < len(self._arg_names) else f"argument {i}"
                where = f" ({name}{jax.tree_util.keystr(gone[0])}, and {len(gone) - 1} more)"
                break
        return RuntimeError(
            f"{self._kind}: this state was donated to an earlier step and its arrays are "
            f"deleted{where}; use the state the step returned: `state, metrics = "
            "step(state, batch)`. (Build the step with donate=False to keep inputs alive.)"
        )

    def _agree(
        self,
        at: str,
        plan: StepPlan | None,
        *,
        optimizer: tuple[Any, Any, Any] | None = None,
        **args: Any,
    ) -> None:
        """Checks, once per ``at`` (``"init"``, ``"call"``), that the processes build this alike.

        Before the state is placed or the step traced, at any debug level:
        processes with another ZeRO stage, comm hook, bucket cap, layout or leaf
        would otherwise wait for each other in a collective (a hang), not fail.
        One exchange of a hash; nothing with one process. At ``DETAIL`` the
        optimizer hyper-parameters in the state (``optax.inject_hyperparams``)
        are compared by value. Non-finite hyper-parameters are refused on any
        number of processes, and so, at the first check, is an ``optimizer``
        ``(tx, opt_state, params)`` whose update computes with a NaN setting
        (``optax.sgd(float("nan"))``, which keeps it in a closure).
        """
        if at in self._agreed:
            return
        hyper = finite.hyperparameters(args)
        finite.check_hyperparameters(hyper, kind=self._kind)
        if optimizer is not None and not self._agreed:
            finite.check_optimizer(*optimizer, kind=self._kind)
        if jax.process_count() > 1:
            detail = debug_level() >= DebugLevel.DETAIL
            fingerprint = settings_fingerprint(self._kind, self.config, plan, args)
            fingerprint["at"] = at
            # At DETAIL the program is compared too: a process at another level would wait.
            fingerprint["FDP_DEBUG=DETAIL"] = detail
            if detail:  # values, not shapes: torch compares neither
                fingerprint.update({f"hyper-parameter {k}": v for k, v in hyper.items()})
            check_settings_across_processes(fingerprint, detail=detail)
        self._agreed.add(at)

    def _jit(self) -> Any:
        if self._jitted is None:
            self._jitted = jax.jit(
                self._global_step,
                static_argnums=(0, *(i + 1 for i in self._static_argnums)),
                donate_argnums=tuple(i + 1 for i in self._donate_argnums),
                compiler_options=self.config.compiler_options,
            )
        return self._jitted

    def _passed_on(self, error: Exception, probe: Any) -> bool:
        """Whether the program alone refused a call (another signature, a donated state).

        It refuses in C++ before anything runs: ``TypeError``/``ValueError`` for other
        shapes, trees or shardings (and, on jaxlib 0.10, a deleted array), a
        ``RuntimeError`` for a deleted array on 0.11+. The call then takes the path
        with every check, which names the mistake. Any other error is the program's own:
        one that failed while running (a peer gone from a collective) has consumed a
        donated state too, so a deleted state alone does not tell a refusal.
        """
        if not isinstance(error, RuntimeError):
            return True
        return "deleted" in str(error) and _deleted(probe)

    def _run_fast(self, *args: Any) -> Any:
        """A call like the last one: its compiled program, called as it is (O(1) Python).

        Returns:
          The step's outputs, or :data:`STALE` when the arguments are not of the
          signature that program was compiled for (it checks them in C++, as jit's
          cache does, before anything runs or is donated): take the first path.
        """
        fast = self._fast
        assert fast is not None
        n = len(fast.statics)  # the static arguments lead (checked when the step is built)
        if args[:n] != fast.statics:  # compared by identity first: the same graph object
            return STALE
        dynamic = args[n:]
        try:
            if self._observer.on:
                out = self._observer.run_compiled(fast.compiled, dynamic, args)
            else:
                out = fast.compiled(*dynamic)
        except (TypeError, ValueError):  # another signature (shapes, tree, shardings)
            return STALE
        return self._finish(out)

    def _run(self, plan: StepPlan, *args: Any) -> Any:
        """A call on the first path: ``plan`` was computed for ``args``."""
        self._last_plan = plan
        # For fdp launch's hang detection (no-ops outside it): the front end recorded
        # that the step was entered; its first call per plan compiles, never a hang.
        compiling = plan not in self._ran
        # Compiled apart from the call (which reuses it), so that the first execution,
        # which waits for the peers, is watched like any other; unless the observer
        # times the first call with its compilation (stats on), which stays one. The
        # compiled program is kept for the calls that follow with this signature.
        timed = self._observer.on and self._observer.times_first_call()
        n = len(self._static_argnums)
        key = (plan, args[:n], signature(args[n:]))
        fast = self._programs.get(key)
        compiled = None if fast is None else fast.compiled
        if compiled is None and not (compiling and timed):
            with heartbeat.compiling() if compiling else contextlib.nullcontext():
                compiled = self._jit().lower(plan, *args).compile()
        with heartbeat.compiling() if compiling and timed else contextlib.nullcontext():
            if self._observer.on:
                out = self._observer.run(self._jit(), self.config, plan, args)
            else:
                out = self._jit()(plan, *args)
        if compiled is None:  # lowered from the arguments' types: donated arrays still have them
            compiled = self._jit().lower(plan, *args).compile()
        if compiling:
            if len(self._ran) >= 64:  # as _plans: new shapes every call keep memory bounded
                self._ran.clear()
            self._ran.add(plan)
            if self._queue is False:
                self._queue = in_flight(self.config.mesh)
        if fast is None:
            fast = Fast(plan, compiled, args[:n], self._nothing_per_call(out))
        self._fast = fast
        self._alone = None  # until the front end's next call asks (_program_alone)
        self._beats = heartbeat.active()  # once the writer is set up: fdp launch's or none
        if len(self._programs) >= 64:  # new shapes every call: keep memory bounded
            self._programs.clear()
        self._programs[key] = fast
        return self._finish(out)

    def _nothing_per_call(self, out: Any) -> bool:
        """Whether a call of this program needs nothing but the program (``Fast.alone``)."""
        guarded = isinstance(out, tuple) and isinstance(out[-1], dict) and finite.KEY in out[-1]
        return self._queue is None and not guarded

    def _program_alone(self) -> Any:
        """The last program, to call alone from now on, or None while a call needs more.

        More is needed while the observer samples, while the second call's key is
        to be compared with the first's, or where :attr:`Fast.alone` says so.
        """
        fast = self._fast
        if fast is None or not fast.alone or self._observer.on or not self._key_reuse.settled:
            return None
        self._alone = fast.compiled
        return self._alone

    def _finish(self, out: Any) -> Any:
        """After a call: the in-flight bound, the numerics guard, the heartbeat."""
        if isinstance(self._queue, InFlight):  # the metrics (last): the state may be donated
            self._queue.add(out[-1] if isinstance(out, tuple) else out)
        self._calls += 1
        # The metrics come last; a program traced with FDP_CHECK_FINITE=1 holds the codes.
        if isinstance(out, tuple) and isinstance(out[-1], dict) and finite.KEY in out[-1]:
            out = (
                *out[:-1],
                finite.check(out[-1], kind=self._kind, call=self._calls, config=self.config),
            )
        heartbeat.step_done()  # for fdp launch's hang detection (a no-op outside it)
        return out

    def _lower(self, plan: StepPlan, *args: Any) -> Any:
        self._last_plan = plan
        return self._jit().lower(plan, *args)

    def stats(self) -> dict[str, Any]:
        """Sampled runtime statistics (step time, examples/s, bytes all-reduced per step).

        Sampled at ``FDP_DEBUG=INFO`` or above, or with ``stats=`` when the step
        is built; otherwise ``{"enabled": False}``. See docs/observability.md for
        the fields.
        """
        return self._observer.stats()

    def logging_data(self) -> dict[str, Any]:
        """The step's settings as logged at ``FDP_DEBUG=INFO`` (DDP's logging data).

        Raises:
          RuntimeError: the step has not been called (or lowered) yet.
        """
        if self._last_plan is None:
            raise RuntimeError(
                f"{type(self).__name__}.logging_data() needs the traced step: call the step "
                "(or its .lower(...)) once first."
            )
        return logging_data(self._kind, self.config, self._last_plan)


STALE: Any = object()  # what :meth:`StepRunner._run_fast` returns when the first path is due


def in_flight(mesh: Any) -> InFlight | None:
    """The queue bound the platform's backend sets for steps on ``mesh`` (None: JAX's own)."""
    limit = backends.for_platform(mesh.devices.flat[0].platform).steps_in_flight(mesh)
    return None if limit is None else InFlight(limit)


def signature(args: tuple) -> tuple:
    """What a compiled program checks of its arguments: their tree and each leaf's type.

    Shape, dtype, weak type and sharding of each leaf (the type of one that is no
    array): computed on the first path only, one walk of the arguments.
    """
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(
        (
            getattr(x, "shape", None),
            getattr(x, "dtype", type(x)),
            getattr(x, "weak_type", None),
            getattr(x, "sharding", None),
        )
        for x in leaves
    )


def _deleted(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` whose buffers were deleted (donated)."""
    is_deleted = getattr(x, "is_deleted", None)
    return is_deleted is not None and bool(is_deleted())


def _shapes(tree: Any) -> list[tuple[tuple[int, ...], Any]]:
    return [(tuple(x.shape), x.dtype) for x in jax.tree.leaves(tree)]
