"""What a train step does besides stepping: its INFO log, DETAIL check and runtime stats.

A step owns one :class:`Observer` and routes its calls through
:meth:`Observer.run` while ``observer.on`` is true. The first call always goes
through it: it reads the debug level and, at OFF with no statistics asked for,
turns ``on`` off, so that later calls cost the step one attribute check and the
compiled program is the one it would be without fdp's observability.

Otherwise, before the first step runs, the observer traces the step (the call
that follows reuses that trace), logs its settings at INFO, and compares them
across processes at DETAIL. Nothing it does enters the traced program.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import jax

from fdp.observe import _fingerprint
from fdp.observe._debug import DebugLevel, debug_level, logger
from fdp.observe._hlo import collective_stats
from fdp.observe._stats import RuntimeStats, StatsSchedule, check_schedule


class Observer:
    """Observes one step function: built in the step's ``__init__``.

    Args:
      kind: the step's name in logs, e.g. ``"fdp.train_step"``.
      arg_names: names of the jitted function's arguments after the plan.
      batch_arg: position of the global batch among them.
      stats: ``True`` or a :class:`fdp.StatsSchedule` to sample runtime
        statistics at any debug level (they are sampled at INFO and DETAIL
        anyway).
    """

    def __init__(
        self,
        kind: str,
        arg_names: tuple[str, ...],
        batch_arg: int,
        stats: bool | StatsSchedule = False,
    ):
        self.on = True  # the step routes calls through run() while this is true
        self.level: DebugLevel | None = None  # read at the first call
        self.runtime: RuntimeStats | None = None
        self.agreed_digest: str | None = None
        self._kind = kind
        self._arg_names = arg_names
        self._batch_arg = batch_arg
        self._schedule = check_schedule(stats)

    def times_first_call(self) -> bool:
        """Whether the next call is the first one and is timed, compilation included."""
        return self.level is None and bool(self._schedule or debug_level() >= DebugLevel.INFO)

    def run(self, fn: Any, config: Any, plan: Any, args: tuple) -> Any:
        """Runs the jitted step ``fn(plan, *args)``, observing it as the level says.

        Args:
          fn: the jitted step; its first argument is the (static) plan.
          config: the step's bound :class:`fdp.step.StepConfig`.
          plan: the :class:`fdp.step.StepPlan` of this call.
          args: the step's other arguments.
        """
        if self.level is None:
            return self._first_call(fn, config, plan, args)
        return self._sample(fn, (plan, *args), args[self._batch_arg])

    def run_compiled(self, compiled: Any, dynamic: tuple, args: tuple) -> Any:
        """Runs a call after the first: ``compiled(*dynamic)``, sampled as :meth:`run` samples.

        Args:
          compiled: the step's program for these arguments (``jax.stages.Compiled``),
            which never compiles.
          dynamic: its arguments (the step's, less the static ones).
          args: the step's arguments, for the batch.
        """
        return self._sample(compiled, dynamic, args[self._batch_arg], compiles=False)

    def _sample(self, fn: Any, fn_args: tuple, batch: Any, *, compiles: bool = True) -> Any:
        """``fn(*fn_args)`` through the runtime statistics; logs a sampled step at INFO."""
        runtime, level = self.runtime, self.level
        assert runtime is not None and level is not None  # set by the first call
        out, sampled = runtime.run(fn, fn_args, batch, compiles=compiles)
        if sampled and level >= DebugLevel.INFO:
            logger.info("%s: %s", self._kind, runtime.summary())
        return out

    def _first_call(self, fn: Any, config: Any, plan: Any, args: tuple) -> Any:
        level = debug_level()
        schedule = self._schedule or (StatsSchedule() if level >= DebugLevel.INFO else None)
        if schedule is None:
            self.level, self.on = level, False
            return fn(plan, *args)
        # The call below finds this trace in jit's cache and does not trace again.
        lowered = fn.trace(plan, *args).lower()
        collectives = collective_stats(lowered)
        runtime = RuntimeStats(
            schedule, collectives=collectives.summary(), sent_bytes=collectives.sent_bytes()
        )
        if level >= DebugLevel.INFO:
            logger.info("%s", render(self._kind, logging_data(self._kind, config, plan)))
        if level >= DebugLevel.DETAIL:
            logger.debug(
                "%s: collectives per step, per device, in the lowered program: %s",
                self._kind,
                collectives.summary(),
            )
            named = dict(zip(self._arg_names, args, strict=True))
            fingerprint = _fingerprint.step_fingerprint(self._kind, config, plan, named, lowered)
            self.agreed_digest = _fingerprint.check_across_processes(fingerprint)
            logger.debug(
                "%s: %d process(es) agree on the step (%d fields, sha256 %s)",
                self._kind,
                jax.process_count(),
                len(fingerprint),
                self.agreed_digest[:16],
            )
        # Only now: if anything above raised, the next call is a first call again.
        self.level, self.runtime = level, runtime
        return self._sample(fn, (plan, *args), args[self._batch_arg])

    def stats(self) -> dict[str, Any]:
        """The runtime statistics, or ``{"enabled": False}`` when none are sampled."""
        if self.runtime is None:
            return {"enabled": False}
        return {"enabled": True, **self.runtime.as_dict()}


def logging_data(kind: str, config: Any, plan: Any) -> dict[str, Any]:
    """A step's settings, as DDP's ``_get_ddp_logging_data`` gives them.

    Args:
      kind: the step's name, e.g. ``"fdp.train_step"``.
      config: its bound :class:`fdp.step.StepConfig` (every setting is listed).
      plan: its :class:`fdp.step.StepPlan` (buckets, parameters, usage).
    """
    buckets, usage = plan.buckets, plan.usage
    devices = list(config.bound_mesh.devices.flat)
    shapes, dtypes_ = buckets.leaf_shapes, buckets.leaf_dtypes
    leaf_bytes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes_, strict=True)]
    settings = config.describe()
    del settings["mesh_device_ids"]  # the mesh's shape is enough in a log
    return {
        "step": kind,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "local_device_count": sum(d.process_index == jax.process_index() for d in devices),
        "num_replicas": config.num_replicas,
        **settings,
        "num_parameter_leaves": len(shapes),
        "total_parameter_size_bytes": sum(leaf_bytes),
        "dtypes": dict(sorted(collections.Counter(str(d) for d in dtypes_).items())),
        "bucket_cap_bytes": buckets.bucket_cap_bytes,
        "first_bucket_cap_bytes": buckets.first_bucket_cap_bytes,
        "num_buckets": len(buckets.buckets),
        "bucket_sizes": [b.nbytes for b in buckets.buckets],
        "unused_parameters": list(usage.unused_key_paths),
        "unused_parameter_size": sum(leaf_bytes[i] for i in usage.unused),
        "conditional_parameters": list(usage.conditional_key_paths),
        # GPU accumulation: the last micro-batch and the reductions share a loop of one trip.
        "reduces_with_last_micro_batch": plan.last_in_loop,
        # fold_dots (CPU): dense products computed as 2-D ones, and what it left as written.
        "fold_dots_products": None if plan.folds is None else plan.folds.folded,
        "fold_dots_left": None if plan.folds is None else dict(plan.folds.left),
    }


def render(kind: str, data: dict[str, Any]) -> str:
    """The INFO message: one ``key: value`` line per field."""
    head = (
        f"{kind} (process {data['process_index']} of {data['process_count']}), "
        "before its first step:"
    )
    return "\n".join([head, *(f"  {k}: {v}" for k, v in data.items())])
