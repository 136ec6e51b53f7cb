"""Choosing ``bucket_cap_mb`` and ``layout`` by timing the step (Horovod autotune's job).

:func:`fdp.tune` compiles the step at a few candidate caps and layouts, times the distinct
programs in interleaved rounds (a short screening of all, then a longer race between
DDP's default and the fastest few) on copies of the state (one per distinct state
shape, shared by the candidates of that shape and released as soon as no candidate
left uses it), and returns the fastest, keeping
DDP's default unless another candidate beats it by more than ``margin``. Results are
cached per model signature, batch, mesh, platform and step settings, in this process.
``fdp.train_step(bucket_cap_mb="auto")`` does the same at its first call.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from fdp.backends import release_free_memory
from fdp.data._abstract import is_abstract
from fdp.observe._debug import logger
from fdp.step.options._policies import Reduction, with_candidate, with_cap

DEFAULT_CAPS: tuple[float, ...] = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0)
DEFAULT_LAYOUTS: tuple[str, ...] = ("auto", "flat", "leaves")
# How "auto" times candidates (fdp.tune's defaults): every distinct program for ROUNDS
# rounds of STEPS steps, then the default and the FINALISTS - 1 fastest others for
# RACE_ROUNDS more (the screening alone was too short to separate caps 3-8% apart on a
# 2-process CPU run, where one round's time varies by 5-10%).
STEPS, ROUNDS, WARMUP, MARGIN = 3, 3, 1, 0.02
FINALISTS, RACE_ROUNDS = 3, 8
DEFAULT = (25.0, "auto")

_CACHE: dict[tuple, TuneResult] = {}


class TuneResult(NamedTuple):
    """What :func:`fdp.tune` chose, and what it measured.

    Attributes:
      bucket_cap_mb: the chosen cap (MiB).
      layout: the chosen layout.
      step_s: median step seconds of each timed candidate in the screening,
        ``{(cap, layout): s}`` (with several processes, the slowest process's time).
        Candidates that compiled to the same program as an earlier one are not
        timed again.
      same_program: ``{(cap, layout): (cap, layout)}``: candidates whose
        compiled program equals the timed one they map to.
      race_s: median step seconds of the finalists in the race that decided
        (empty when there was one distinct program, ``finalists=1`` or
        ``race_rounds=0``: then the screening decided).
      cached: the result came from this process's cache; nothing was timed.
    """

    bucket_cap_mb: float
    layout: str
    step_s: dict[tuple[float, str], float]
    same_program: dict[tuple[float, str], tuple[float, str]]
    race_s: dict[tuple[float, str], float]
    cached: bool = False

    def kwargs(self) -> dict[str, Any]:
        """``{"reduction": fdp.Reduction(bucket_cap_mb=..., layout=...)}``, for a builder.

        ``fdp.train_step(loss_fn, **result.kwargs())``; with other reduction
        settings, ``fdp.train_step(loss_fn, reduction=result.reduction(mine))``.
        """
        return {"reduction": self.reduction()}

    def reduction(self, base: Reduction | None = None) -> Reduction:
        """``base`` (default: DDP's) with the chosen cap and layout."""
        return with_cap(base, self.bucket_cap_mb, self.layout)


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return (
        str(treedef),
        tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x)))) for x in leaves),
    )


def _cache_key(
    loss_fn: Any, state: Any, batch: Any, mesh: Any, settings: dict[str, Any], candidates: tuple
) -> tuple:
    devices = jax.devices()
    mesh_key = None if mesh is None else (tuple(mesh.shape.items()), mesh.devices.shape)
    return (
        # The loss by identity: another loss is another program, whatever its shapes.
        # (A fingerprint of its code would merge closures over different models.)
        loss_fn,
        _signature(getattr(state, "params", state)),
        _signature(batch),
        mesh_key,
        devices[0].platform,
        devices[0].device_kind,
        jax.device_count(),
        jax.process_count(),
        tuple(sorted((k, repr(v)) for k, v in settings.items())),
        candidates,
    )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def copy_tree(tree: Any) -> Any:
    # The step donates its state: time it on copies, never on the caller's arrays.
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def _same_everywhere(value: Any) -> Any:
    """Process 0's ``value`` on every process (choices must agree, or steps would hang)."""
    if jax.process_count() == 1:
        return value
    from fdp.runtime._host import broadcast_object

    return broadcast_object(value, purpose="fdp.tune's choice")


def _slowest(times: list[float]) -> list[float]:
    """Each round's time on the slowest process: the step waits for it."""
    if jax.process_count() == 1:
        return times
    from fdp.runtime._host import all_gather_object

    gathered = all_gather_object([float(t) for t in times], purpose="fdp.tune's timings")
    return [max(ts) for ts in zip(*gathered, strict=True)]


class _States:
    """The candidates' states: one copy per distinct shape, shared by its candidates.

    Every candidate computes the same update (only the buckets differ), so
    candidates whose states agree in structure, shapes, dtypes and shardings
    advance one copy in turn; a stateful hook whose state follows the buckets, or
    ZeRO's sharding, gives a candidate a copy of its own. A copy goes as soon as
    no candidate left uses it.
    """

    def __init__(self) -> None:
        self._pool: dict[tuple, Any] = {}
        self._home: dict[tuple[float, str], tuple] = {}

    def add(self, cand: tuple[float, str], state: Any, shape: tuple) -> None:
        self._home[cand] = shape
        self._pool.setdefault(shape, state)  # an equal shape held already: ``state`` is dropped

    def keep(self, cands: Sequence[tuple[float, str]]) -> None:
        self._home = {c: self._home[c] for c in cands}
        self._pool = {k: v for k, v in self._pool.items() if k in self._home.values()}

    def copies(self) -> int:
        return len(self._pool)

    def __getitem__(self, cand: tuple[float, str]) -> Any:
        return self._pool[self._home[cand]]

    def __setitem__(self, cand: tuple[float, str], state: Any) -> None:
        self._pool[self._home[cand]] = state


def shape_of(tree: Any) -> tuple:
    """Structure, shapes, dtypes and shardings of ``tree``: what decides a step's program."""
    leaves, treedef = jax.tree.flatten(tree)
    return (
        treedef,
        tuple(
            (
                getattr(x, "shape", None),
                str(getattr(x, "dtype", type(x))),
                getattr(x, "sharding", None),
            )
            for x in leaves
        ),
    )


def _time_rounds(
    steps_of: dict[tuple[float, str], Any],
    states: _States,
    cands: list[tuple[float, str]],
    rounds: int,
    steps: int,
    args: tuple,
) -> dict[tuple[float, str], float]:
    """Median seconds per step of each of ``cands`` over ``rounds`` interleaved rounds.

    Each round runs ``steps`` steps of every candidate, in an order rotated by one
    each round; ``states`` holds each candidate's state (a :class:`_States`) and is
    advanced in place.
    """
    times: dict[tuple[float, str], list[float]] = {c: [] for c in cands}
    for r in range(rounds):
        for cand in cands[r % len(cands) :] + cands[: r % len(cands)]:
            start = time.perf_counter()
            for _ in range(steps):
                states[cand], _ = steps_of[cand](states[cand], *args)
            jax.block_until_ready(states[cand])
            times[cand].append((time.perf_counter() - start) / steps)
    return {c: statistics.median(_slowest(times[c])) for c in cands}


def run_tune(
    loss_fn: Callable[..., Any],
    state: Any,
    batch: Any,
    extra: tuple,
    *,
    caps: Sequence[float],
    layouts: Sequence[str],
    steps: int,
    rounds: int,
    warmup: int,
    margin: float,
    finalists: int,
    race_rounds: int,
    make_step: Callable[..., Any],
    copy: Callable[[Any], Any],
    step_kwargs: dict[str, Any],
    shape_of: Callable[[Any], tuple] = shape_of,
) -> TuneResult:
    """:func:`fdp.tune` for any step called ``step(state, batch, *extra) -> (state, metrics)``."""
    if is_abstract((state, batch)):
        raise ValueError(
            "bucket_cap_mb='auto' (fdp.tune) times candidate steps by running them, and "
            "got shapes only (jax.ShapeDtypeStruct: a step lowered for compile-only devices, "
            "such as fdp.observe.gpu_mesh's). Tune on a machine with those devices, or pick "
            "bucket_cap_mb from the compiled programs (benchmarks/gpu_programs.py, "
            "docs/gpu.md)."
        )
    candidates = tuple(dict.fromkeys((float(c), str(lay)) for c in caps for lay in layouts))
    if not candidates:
        raise ValueError(
            f"tune needs at least one candidate; got caps={caps!r}, layouts={layouts!r}."
        )
    if steps < 1 or rounds < 1 or finalists < 1 or warmup < 0 or race_rounds < 0:
        raise ValueError(
            "tune needs steps >= 1, rounds >= 1, finalists >= 1, warmup >= 0 and "
            f"race_rounds >= 0; got steps={steps}, rounds={rounds}, finalists={finalists}, "
            f"warmup={warmup}, race_rounds={race_rounds}."
        )
    # DDP's default is always a candidate, and first: it wins ties.
    candidates = (DEFAULT, *(c for c in candidates if c != DEFAULT))
    timing = (steps, rounds, warmup, margin, finalists, race_rounds)
    key = _cache_key(
        loss_fn, state, batch, step_kwargs.get("mesh"), step_kwargs, (candidates, timing)
    )
    if key in _CACHE:
        return _CACHE[key]._replace(cached=True)

    steps_of: dict[tuple[float, str], Any] = {}
    digests: dict[tuple[float, str], str] = {}
    lowered_first: dict[str, tuple[float, str]] = {}
    for cand in candidates:
        cap, layout = cand
        step = make_step(loss_fn, **with_candidate(step_kwargs, cap, layout))
        lowered = step.lower(state, batch, *extra)
        steps_of[cand] = step
        # Equal lowered programs compile to equal programs: only the first is compiled
        # (caps above the model's size, or "auto" where it means "flat").
        twin = lowered_first.setdefault(_digest(lowered.as_text()), cand)
        digests[cand] = digests[twin] if twin != cand else _digest(lowered.compile().as_text())
    # Candidates with the same compiled program are timed once (process 0 decides,
    # so that every process runs the same steps in the same order).
    first_of: dict[str, tuple[float, str]] = {}
    same: dict[tuple[float, str], tuple[float, str]] = {}
    for cand in candidates:
        same[cand] = first_of.setdefault(digests[cand], cand)
    agreed = _same_everywhere([[list(k), list(v)] for k, v in same.items()])
    same = {(float(k[0]), str(k[1])): (float(v[0]), str(v[1])) for k, v in agreed}
    timed = [c for c in candidates if same[c] == c]
    for cand in set(candidates) - set(timed):
        del steps_of[cand]  # a twin's step (and its jitted program) goes now

    # One untimed step at least (it compiles the program), on a copy of the state; the
    # copy is kept only where no candidate before had a state of that shape.
    states = _States()
    for cand in timed:
        warm = copy(state)
        for _ in range(max(warmup, 1)):
            warm, _ = steps_of[cand](warm, batch, *extra)
        jax.block_until_ready(warm)
        states.add(cand, warm, shape_of(warm))
        del warm
    logger.debug("fdp.tune: %d state copies for %d timed programs", states.copies(), len(timed))
    args = (batch, *extra)
    step_s = _time_rounds(steps_of, states, timed, rounds, steps, args)
    # The race: the default and the fastest others of the screening, timed for longer
    # (the others' state copies are dropped first).
    others = sorted((c for c in timed if c != DEFAULT), key=lambda c: step_s[c])
    finals = [DEFAULT, *others[: finalists - 1]]
    finals = [(float(c), str(lay)) for c, lay in _same_everywhere([list(c) for c in finals])]
    for cand in set(timed) - set(finals):
        del steps_of[cand]
    states.keep(finals)
    race_s = {}
    if len(finals) > 1 and race_rounds:
        race_s = _time_rounds(steps_of, states, finals, race_rounds, steps, args)
    decided = race_s or step_s
    states.keep(())
    steps_of.clear()
    # The candidates' state copies were a one-off peak: with fdp's malloc tuning glibc
    # would keep it mapped for the whole run (measured: RSS 1.2 GiB against 0.57).
    release_free_memory()
    best = min(decided, key=lambda c: decided[c])
    if decided[best] > (1.0 - margin) * decided[DEFAULT]:
        best = DEFAULT
    cap, layout = _same_everywhere(list(best))
    best = (float(cap), str(layout))
    result = TuneResult(best[0], best[1], step_s, {k: v for k, v in same.items() if k != v}, race_s)
    _CACHE[key] = result
    logger.info(
        "fdp.tune: chose bucket_cap_mb=%g layout=%r: %.2f ms per step against %.2f ms at "
        "the default (25, 'auto')%s; %d candidates, %d distinct programs screened (%s)",
        result.bucket_cap_mb,
        result.layout,
        1e3 * decided[best],
        1e3 * decided[DEFAULT],
        f" in a race of {race_rounds} rounds" if race_s else "",
        len(candidates),
        len(timed),
        ", ".join(f"{c[0]:g}/{c[1]}: {1e3 * s:.2f} ms" for c, s in step_s.items()),
    )
    return result


def tuned_step(
    loss_fn: Callable[..., Any],
    state: Any,
    batch: Any,
    extra: tuple = (),
    *,
    make_step: Callable[..., Any],
    candidate: Callable[[Any], Any] = lambda step: step,
    copy: Callable[[Any], Any] = copy_tree,
    shape_of: Callable[[Any], tuple] = shape_of,
    **step_kwargs: Any,
) -> tuple[Any, TuneResult]:
    """Tunes with :func:`fdp.tune`'s defaults; returns the chosen step, built, and the table.

    Args:
      loss_fn: the loss.
      state: what the candidates start from (copied, never donated).
      batch: a batch.
      extra: the step's other arguments after the batch.
      make_step: the step factory (:func:`fdp.train_step`, :func:`fdp.nnx_train_step`).
      candidate: how a built step is called as ``(state, batch, *extra) -> (state, _)``.
      copy: copies ``state`` for a candidate.
      shape_of: what decides whether two candidates' states can be one copy.
      **step_kwargs: the step's other settings (``stats`` included); a
        ``layout`` other than ``"auto"`` stays, ``"auto"`` lets tuning choose.

    Returns:
      ``(step, result)``: the step at the chosen cap and layout
      and the :class:`TuneResult`.
    """
    settings = {k: v for k, v in step_kwargs.items() if k != "stats"}
    reduction = step_kwargs.get("reduction")
    layout = step_kwargs.get("layout", "auto") if reduction is None else reduction.layout
    result = run_tune(
        loss_fn,
        state,
        batch,
        extra,
        caps=DEFAULT_CAPS,
        layouts=DEFAULT_LAYOUTS if layout == "auto" else (layout,),
        steps=STEPS,
        rounds=ROUNDS,
        warmup=WARMUP,
        margin=MARGIN,
        finalists=FINALISTS,
        race_rounds=RACE_ROUNDS,
        make_step=lambda fn, **kw: candidate(make_step(fn, **kw)),  # kw may hold loss=
        copy=copy,
        step_kwargs=settings,
        shape_of=shape_of,
    )
    chosen = with_candidate(step_kwargs, result.bucket_cap_mb, result.layout)
    return make_step(loss_fn, **chosen), result
