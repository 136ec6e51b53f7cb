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
      step: the step (it has ``config``, ``plan`` and ``usage``).
      kind: its name in logs, e.g. ``"fdp.train_step"``.
      arg_names: names of the jitted function's arguments.
      batch_arg: position of the global batch among them.
      stats: ``True`` or a :class:`fdp.StatsSchedule` to sample runtime
        statistics at any debug level (they are sampled at INFO and DETAIL
        anyway).
    """

    def __init__(
        self,
        step: Any,
        kind: str,
        arg_names: tuple[str, ...],
        batch_arg: int,
        stats: bool | StatsSchedule = False,
    ):
        self.on = True  # the step routes calls through run() while this is true
        self.level: DebugLevel | None = None  # read at the first call
        self.runtime: RuntimeStats | None = None
        self.agreed_digest: str | None = None
        self._step = step
        self._kind = kind
        self._arg_names = arg_names
        self._batch_arg = batch_arg
        self._schedule = check_schedule(stats)

    def run(self, fn: Any, args: tuple) -> Any:
        """Runs the jitted step ``fn(*args)``, observing it as the level says."""
        if self.level is None:
            return self._first_call(fn, args)
        return self._sample(fn, args)

    def _sample(self, fn: Any, args: tuple) -> Any:
        out, sampled = self.runtime.run(fn, args, args[self._batch_arg])
        if sampled and self.level >= DebugLevel.INFO:
            logger.info("%s: %s", self._kind, self.runtime.summary())
        return out

    def _first_call(self, fn: Any, args: tuple) -> Any:
        level = debug_level()
        schedule = self._schedule or (StatsSchedule() if level >= DebugLevel.INFO else None)
        if schedule is None:
            self.level, self.on = level, False
            return fn(*args)
        # Tracing first gives the plan and usage before anything runs; the call
        # below finds this trace in jit's cache and does not trace again.
        lowered = fn.trace(*args).lower()
        collectives = collective_stats(lowered)
        runtime = RuntimeStats(
            schedule, collectives=collectives.summary(), sent_bytes=collectives.sent_bytes()
        )
        if level >= DebugLevel.INFO:
            logger.info("%s", self.render(self.logging_data()))
        if level >= DebugLevel.DETAIL:
            logger.debug(
                "%s: collectives per step, per device, in the lowered program: %s",
                self._kind,
                collectives.summary(),
            )
            named = dict(zip(self._arg_names, args, strict=True))
            fingerprint = _fingerprint.step_fingerprint(self._step, self._kind, named, lowered)
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
        return self._sample(fn, args)

    def stats(self) -> dict[str, Any]:
        """The runtime statistics, or ``{"enabled": False}`` when none are sampled."""
        if self.runtime is None:
            return {"enabled": False}
        return {"enabled": True, **self.runtime.as_dict()}

    def logging_data(self) -> dict[str, Any]:
        """The step's settings, as DDP's ``_get_ddp_logging_data`` gives them.

        Raises:
          RuntimeError: the step has not been traced yet.
        """
        step = self._step
        if step.plan is None:
            raise RuntimeError(
                f"{type(step).__name__}.logging_data() needs the traced step: call the step "
                "(or its .lower(...)) once first."
            )
        cfg, plan, usage = step.config, step.plan, step.usage
        devices = list(cfg.mesh.devices.flat)
        shapes, dtypes_ = plan.leaf_shapes, plan.leaf_dtypes
        leaf_bytes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes_, strict=True)]
        unused = usage.unused if usage is not None else ()
        dtypes = collections.Counter(str(d) for d in plan.leaf_dtypes)
        return {
            "step": self._kind,
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "device_count": len(devices),
            "local_device_count": sum(d.process_index == jax.process_index() for d in devices),
            "mesh": dict(cfg.mesh.shape),
            "axis_name": cfg.axis_name,
            "num_replicas": cfg.num_replicas,
            "num_parameter_leaves": len(plan.leaf_shapes),
            "total_parameter_size_bytes": sum(leaf_bytes),
            "dtypes": dict(sorted(dtypes.items())),
            "bucket_cap_mb": cfg.bucket_cap_mb,
            "first_bucket_cap_mb": cfg.first_bucket_cap_mb,
            "bucket_cap_bytes": plan.bucket_cap_bytes,
            "first_bucket_cap_bytes": plan.first_bucket_cap_bytes,
            "num_buckets": len(plan.buckets),
            "bucket_sizes": [b.nbytes for b in plan.buckets],
            "comm_hook": cfg.comm_hook.name,
            "layout": cfg.layout,
            "accumulate_steps": cfg.accumulate_steps,
            "find_unused_parameters": cfg.find_unused_parameters,
            "unused_parameters": list(usage.unused_key_paths) if usage is not None else [],
            "unused_parameter_size": sum(leaf_bytes[i] for i in unused),
            "conditional_parameters": list(usage.conditional_key_paths) if usage else [],
            "buffers": cfg.buffers,
            "per_example": cfg.per_example,
            "donate": cfg.donate,
        }

    def render(self, data: dict[str, Any]) -> str:
        """The INFO message: one ``key: value`` line per field."""
        head = (
            f"{self._kind} (process {data['process_index']} of {data['process_count']}), "
            "before its first step:"
        )
        return "\n".join([head, *(f"  {k}: {v}" for k, v in data.items())])
