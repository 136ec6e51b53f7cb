"""Runtime statistics of a step, sampled as DDP samples its logging data.

DDP times iterations 1 to 10 and then every ``ddp_runtime_logging_sample_rate``
(100) iterations, so that measuring stays cheap. fdp samples the same way, and
measures a sampled step as its wall time from the moment the previous step's
results are ready to the moment this step's are: a sampled step waits for the
device twice, an unsampled one never (blocking every step would stop the host
from running ahead of the devices).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from fdp._compat import jit_cache_size


class StatsSchedule(NamedTuple):
    """Which steps are timed: the first ``first``, then every ``every``-th.

    Steps are counted from 1. The first step also compiles; it is reported on its
    own (``first_step_seconds``) and left out of the averages, as is any other
    sampled step that compiled the step again (``compiled_steps``).

    Attributes:
      first: steps timed from the start.
      every: after those, steps whose number is a multiple of this are timed.
      tokens_per_example: tokens in one example (a language model's sequence
        length); when given, throughput is reported in tokens per second too.
        None: examples per second only.
    """

    first: int = 10
    every: int = 100
    tokens_per_example: int | None = None

    def sampled(self, step: int) -> bool:
        """Whether step number ``step`` (from 1) is timed.

        Example:
          >>> from fdp import StatsSchedule
          >>> [n for n in range(1, 400) if StatsSchedule(first=3, every=100).sampled(n)]
          [1, 2, 3, 100, 200, 300]
        """
        return step <= self.first or step % self.every == 0


def check_schedule(stats: bool | StatsSchedule) -> StatsSchedule | None:
    """The schedule that ``stats=`` asks for, or None.

    Raises:
      TypeError: ``stats`` is neither a bool nor a :class:`StatsSchedule`.
      ValueError: a schedule with ``first < 1``, ``every < 1`` or
        ``tokens_per_example < 1``.
    """
    if stats is False:
        return None
    if stats is True:
        return StatsSchedule()
    if not isinstance(stats, StatsSchedule):
        raise TypeError(f"stats must be a bool or a fdp.StatsSchedule, got {stats!r}.")
    for name in ("first", "every"):
        value = getattr(stats, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"StatsSchedule.{name} must be an int >= 1, got {value!r}.")
    tokens = stats.tokens_per_example
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
    ):
        raise ValueError(
            f"StatsSchedule.tokens_per_example must be None or an int >= 1 (tokens in one "
            f"example, e.g. the sequence length), got {tokens!r}."
        )
    return stats


@dataclasses.dataclass
class RuntimeStats:
    """Timings of sampled steps, and the collectives every step runs.

    Attributes:
      schedule: which steps are timed.
      steps: steps run so far.
      collectives: ``{kind: {"count": n, "bytes": b}}`` of one step, per
        device, from the lowered program (what fdp emitted), or None before
        the first step.
      sent_bytes: bytes each device sends per step (ring estimate), or None.
      first_step_seconds: wall time of step 1, which traced and compiled.
      compiled_steps: sampled steps that compiled (step 1 and any step whose
        inputs changed type or sharding); they are left out of the averages.
    """

    schedule: StatsSchedule
    steps: int = 0
    collectives: dict[str, dict[str, int]] | None = None
    sent_bytes: float | None = None
    first_step_seconds: float | None = None
    compiled_steps: list[int] = dataclasses.field(default_factory=list)
    _last_compiled: float = 0.0
    _seconds: list[float] = dataclasses.field(default_factory=list)
    _examples: list[int] = dataclasses.field(default_factory=list)

    def run(
        self, fn: Callable[..., Any], args: tuple, batch: Any, *, compiles: bool = True
    ) -> tuple[Any, bool]:
        """Runs ``fn(*args)`` as the next step, timing it if it is sampled.

        ``batch`` is the step's global batch; its leading size counts the
        examples. ``compiles``: ``fn`` is a ``jax.jit`` function, whose calls may
        compile (such a step is not averaged); False for a compiled program.

        Returns:
          ``(fn's result, whether this step was timed)``.
        """
        # Counted once ``fn`` returned: a call that raised (a step refusing a
        # signature it must plan for first, then called again) is not a step.
        if not self.schedule.sampled(self.steps + 1):
            out = fn(*args)
            self.steps += 1
            return out, False
        # The previous step's results first: its time is not this step's.
        jax.block_until_ready(args)
        # A jitted function's cache grows when a call compiles; such a call
        # times the compiler, not the step.
        cached = jit_cache_size(fn) if compiles else 0
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        seconds = time.perf_counter() - start
        self.steps += 1
        examples = int(jax.tree.leaves(batch)[0].shape[0])
        if self.steps == 1:
            self.first_step_seconds = seconds
        if self.steps == 1 or (compiles and jit_cache_size(fn) > cached):
            self.compiled_steps.append(self.steps)
            self._last_compiled = seconds
        else:
            self._seconds.append(seconds)
            self._examples.append(examples)
        return out, True

    def as_dict(self) -> dict[str, Any]:
        """The statistics as plain data (see :meth:`fdp.DataParallelStep.stats`)."""
        timed = len(self._seconds)
        total = sum(self._seconds)
        tokens = self.schedule.tokens_per_example
        # fdp's shared-memory sums are all-reduces too (the default on CPU processes of
        # one host).
        kinds = [(self.collectives or {}).get(k, {}) for k in ("all-reduce", "shm-sum")]
        allreduce = {key: sum(k.get(key, 0) for k in kinds) for key in ("count", "bytes")}
        return {
            "steps": self.steps,
            "sampled_steps": timed,
            "schedule": {
                "first": self.schedule.first,
                "every": self.schedule.every,
                "tokens_per_example": self.schedule.tokens_per_example,
            },
            "first_step_seconds": self.first_step_seconds,
            "compiled_steps": list(self.compiled_steps),
            "avg_step_seconds": total / timed if timed else None,
            "last_step_seconds": self._seconds[-1] if timed else None,
            "avg_examples_per_second": sum(self._examples) / total if total else None,
            "last_examples_per_second": (
                self._examples[-1] / self._seconds[-1] if timed and self._seconds[-1] else None
            ),
            "examples_per_step": self._examples[-1] if timed else None,
            "avg_tokens_per_second": (
                tokens * sum(self._examples) / total if tokens and total else None
            ),
            "last_tokens_per_second": (
                tokens * self._examples[-1] / self._seconds[-1]
                if tokens and timed and self._seconds[-1]
                else None
            ),
            "tokens_per_step": tokens * self._examples[-1] if tokens and timed else None,
            "allreduce_bytes_per_step": None if self.collectives is None else allreduce["bytes"],
            "allreduce_count_per_step": None if self.collectives is None else allreduce["count"],
            "sent_bytes_per_step": self.sent_bytes,
            "collectives": self.collectives,
        }

    def summary(self) -> str:
        """One log line about the last sampled step and the averages."""
        d = self.as_dict()
        if self.compiled_steps and self.compiled_steps[-1] == self.steps:
            again = "" if self.steps == 1 else ", not averaged; its inputs changed type or sharding"
            return f"step {self.steps} compiled the step: {self._last_compiled:.4g} s{again}"
        last = f"{d['last_examples_per_second']:.4g} examples/s"
        avg = f"{d['avg_examples_per_second']:.4g} examples/s"
        if d["last_tokens_per_second"] is not None:
            last += f" ({d['last_tokens_per_second']:.4g} tokens/s)"
            avg += f" ({d['avg_tokens_per_second']:.4g} tokens/s)"
        return (
            f"step {self.steps}: {d['last_step_seconds'] * 1e3:.4g} ms, {last}; average over "
            f"{d['sampled_steps']} sampled step(s): {d['avg_step_seconds'] * 1e3:.4g} ms, "
            f"{avg}; all-reduced {d['allreduce_bytes_per_step']} bytes per device per step"
        )
