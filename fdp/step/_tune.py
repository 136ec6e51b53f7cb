"""Choosing ``bucket_cap_mb`` and ``layout`` by timing the step (Horovod autotune's job).

:func:`tune` compiles the step at a few candidate caps and layouts, times the distinct
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
from fdp.bucketing import plan_for
from fdp.data._abstract import is_abstract
from fdp.observe._debug import logger
from fdp.step._comm_state import NNXCommState
from fdp.step._linen import DataParallelStep
from fdp.step._nnx import NNXDataParallelStep
from fdp.step._policies import Reduction, with_candidate, with_cap
from fdp.step._state import hook_is_stateful

DEFAULT_CAPS: tuple[float, ...] = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0)
DEFAULT_LAYOUTS: tuple[str, ...] = ("auto", "flat", "leaves")
# How "auto" times candidates (fdp.tune's defaults): every distinct program for ROUNDS
# rounds of STEPS steps, then the default and the FINALISTS - 1 fastest others for
# RACE_ROUNDS more (the screening alone was too short to separate caps 3-8% apart on a
# 2-process CPU run, where one round's time varies by 5-10%).
STEPS, ROUNDS, WARMUP, MARGIN = 3, 3, 1, 0.02
FINALISTS, RACE_ROUNDS = 3, 8
_DEFAULT = (25.0, "auto")

_CACHE: dict[tuple, TuneResult] = {}


class TuneResult(NamedTuple):
    """What :func:`tune` chose, and what it measured.

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


def _copy(tree: Any) -> Any:
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


def _shape_of(tree: Any) -> tuple:
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


def tune(
    loss_fn: Callable[..., Any],
    state: Any,
    batch: Any,
    rng: Any = None,
    mask: Any = None,
    *,
    caps: Sequence[float] = DEFAULT_CAPS,
    layouts: Sequence[str] = DEFAULT_LAYOUTS,
    steps: int = STEPS,
    rounds: int = ROUNDS,
    warmup: int = WARMUP,
    margin: float = MARGIN,
    finalists: int = FINALISTS,
    race_rounds: int = RACE_ROUNDS,
    make_step: Callable[..., Any] | None = None,
    **step_kwargs: Any,
) -> TuneResult:
    """Times ``fdp.train_step`` at candidate bucket caps and layouts; returns the best.

    Each candidate's step is lowered, and compiled unless an earlier candidate
    lowered to the same program; candidates whose compiled programs are equal
    (XLA:CPU merges all-reduces on one process, so caps often do not matter there)
    are timed once. The distinct programs run ``warmup`` steps, then ``rounds``
    interleaved rounds of ``steps`` steps each on copies of ``state`` (the caller's
    arrays are not donated or changed): the screening. DDP's default
    (``bucket_cap_mb=25``, ``layout="auto"``) and the ``finalists - 1`` fastest
    other programs then race for ``race_rounds`` more interleaved rounds, and the
    race decides: the fastest median wins unless it beats the default by less than
    ``margin``, in which case the default is kept: tuning never trades the default
    for noise.
    The choice is logged at INFO on the ``"fdp"`` logger and cached in this process
    for the same model signature, batch shapes, mesh, platform and settings. With
    several processes every process must call it (it runs steps); all get process
    0's choice, made from each round's slowest process.

    Args:
      loss_fn: the loss, as for :func:`fdp.train_step`.
      state: a ``TrainState`` (not modified).
      batch: a batch as the step takes it.
      rng: the step's ``rng`` argument, if it takes one.
      mask: the step's ``mask`` argument, if it takes one.
      caps: candidate ``bucket_cap_mb`` values (MiB).
      layouts: candidate layouts (``"auto"``, ``"flat"``, ``"leaves"``).
      steps: steps per timed round.
      rounds: timed rounds (each runs every distinct program once, rotating order).
      warmup: untimed steps of each program first (one runs in any case: it
        compiles the program and shows the shape of the state it keeps).
      margin: the fraction by which a candidate must beat the default to replace it.
      finalists: programs in the race, the default included (1: no race; the
        screening decides).
      race_rounds: rounds of the race (0: no race).
      make_step: the step factory (default :func:`fdp.train_step`).
      **step_kwargs: the step's other settings (``mesh``, ``comm_hook``...).

    Returns:
      A :class:`TuneResult`; ``fdp.train_step(loss_fn, **result.kwargs(), ...)``
      builds the chosen step.

    Raises:
      ValueError: no candidates, ``steps``/``rounds``/``finalists`` below 1, or
        ``warmup``/``race_rounds`` below 0.

    Example:
      >>> import jax.numpy as jnp, optax, fdp
      >>> from flax.training.train_state import TrainState
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> state = fdp.replicate(TrainState.create(
      ...     apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1)))
      >>> batch = fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones(8)})
      >>> result = fdp.tune(loss_fn, state, batch, caps=(1.0, 25.0), steps=1, rounds=1)
      >>> result.bucket_cap_mb in (1.0, 25.0)
      True
    """
    if make_step is None:
        from fdp.step._linen import train_step as make_step
    return _tune(
        loss_fn,
        state,
        batch,
        (rng, mask),
        caps=caps,
        layouts=layouts,
        steps=steps,
        rounds=rounds,
        warmup=warmup,
        margin=margin,
        finalists=finalists,
        race_rounds=race_rounds,
        make_step=make_step,
        copy=_copy,
        step_kwargs=step_kwargs,
    )


def _tune(
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
    shape_of: Callable[[Any], tuple] = _shape_of,
) -> TuneResult:
    """:func:`tune` for any step called ``step(state, batch, *extra) -> (state, metrics)``."""
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
    candidates = (_DEFAULT, *(c for c in candidates if c != _DEFAULT))
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
    others = sorted((c for c in timed if c != _DEFAULT), key=lambda c: step_s[c])
    finals = [_DEFAULT, *others[: finalists - 1]]
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
    if decided[best] > (1.0 - margin) * decided[_DEFAULT]:
        best = _DEFAULT
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
        1e3 * decided[_DEFAULT],
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
    copy: Callable[[Any], Any] = _copy,
    shape_of: Callable[[Any], tuple] = _shape_of,
    **step_kwargs: Any,
) -> tuple[Any, TuneResult]:
    """Tunes with :func:`tune`'s defaults; returns the chosen step, built, and the table.

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
    result = _tune(
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


class _TunesAtFirstCall:
    """What the auto-tuned steps add to their step class: tuning at the first call.

    The object is the step class's own instance from the start, at DDP's default
    cap (``config`` says so: ``bucket_cap_mb=25.0``); the first call (or
    ``lower``) tunes on copies and then re-initialises it with the chosen cap and
    layout, before anything was compiled or placed for it.
    """

    _step_class: Any  # DataParallelStep or NNXDataParallelStep
    tuned: TuneResult | None

    def _start(
        self, loss_fn: Callable[..., Any], make_step: Callable[..., Any], kwargs: Any
    ) -> None:
        self._raw_loss = loss_fn
        self._make_step = make_step
        self._settings = dict(kwargs)
        self.tuned = None
        # Built at the default cap now: every other setting is checked when built.
        reduction = kwargs["reduction"]  # the builders pass their policies
        default = {**kwargs, "reduction": with_cap(reduction, _DEFAULT[0], reduction.layout)}
        self._become(make_step(loss_fn, **default))

    def _become(self, step: Any) -> None:
        stats = self._settings.get("stats", False)
        self._step_class.__init__(self, step.loss_fn, step._config, stats)

    def _tune_once(
        self, state: Any, batch: Any, extra: tuple, candidate: Any, copy: Any, shape_of: Any
    ) -> None:
        if self.tuned is not None:
            return
        chosen, self.tuned = tuned_step(
            self._raw_loss,
            state,
            batch,
            extra,
            make_step=self._make_step,
            candidate=candidate,
            copy=copy,
            shape_of=shape_of,
            **self._settings,
        )
        self._become(chosen)


def _refuse_stateful_hook(cfg: Any, params: Any) -> None:
    """Raises if the comm hook keeps state between steps: tuning would choose its shape.

    A stateful hook's state (PowerSGD's error feedback and factors) is shaped by
    the buckets. With ``"auto"`` the buckets are chosen by timing, at the first
    call of each run: a checkpoint's hook state would fit only a resumed run that
    happened to choose the same cap, and the state made before tuning (``init``)
    none but the default's.
    """
    buckets = plan_for(params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
    if hook_is_stateful(cfg, buckets):
        raise ValueError(
            f"reduction: bucket_cap_mb='auto' with comm hook {cfg.comm_hook.name!r}, which "
            "keeps state shaped by the buckets: the cap tuning chooses can differ from run "
            "to run, and a checkpoint's hook state would not fit a resumed run. Tune once, "
            "result = fdp.tune(loss_fn, state, batch), and pin its cap, "
            "fdp.Reduction(bucket_cap_mb=result.bucket_cap_mb, layout=result.layout, "
            "comm_hook=...); or use a hook without state."
        )


class _PairStep:
    """An NNX step in :func:`_tune`'s calling convention, on a ``(model, optimizer)`` pair.

    Each candidate keeps its own comm hook state (its buckets shape it), filled
    at its first call; copies of the pair shared between candidates hold none.
    """

    def __init__(self, step: Any):
        self._step = step
        self._comm_state = NNXCommState()

    def __call__(self, pair: tuple, batch: Any, mask: Any = None) -> tuple[tuple, Any]:
        return pair, self._step(*pair, batch, mask, comm_state=self._comm_state)

    def lower(self, pair: tuple, batch: Any, mask: Any = None) -> Any:
        return self._step.lower(*pair, batch, mask, comm_state=self._comm_state)


def _copy_nnx(pair: tuple) -> tuple:
    # New objects on copied arrays: the step donates, and mutates its objects in place.
    from flax import nnx

    graphdef, state = nnx.split(pair)
    return nnx.merge(graphdef, _copy(state))


def _nnx_params(model: Any, optimizer: Any) -> Any:
    from flax import nnx

    return nnx.state(model, optimizer.wrt)


def _nnx_shape_of(pair: tuple) -> tuple:
    from flax import nnx

    return _shape_of(nnx.state(pair))


class AutoTunedStep(_TunesAtFirstCall, DataParallelStep):
    """``fdp.train_step(bucket_cap_mb="auto")``: a :class:`fdp.DataParallelStep` that tunes.

    Until its first call (or :meth:`lower`) it is the step at DDP's default cap
    (``config.bucket_cap_mb == 25.0``); that call times the candidates on copies
    of the state (:func:`fdp.tune`), and from then on it is the chosen step
    (``tuned`` holds the table).
    """

    _step_class = DataParallelStep

    def __init__(self, loss_fn: Callable[..., Any], make_step: Callable[..., Any], **kwargs: Any):
        self._start(loss_fn, make_step, kwargs)

    def init(self, state: Any) -> Any:
        """Prepares ``state`` as :meth:`fdp.DataParallelStep.init` does.

        Raises:
          ValueError: the comm hook keeps state (its shape would depend on the tuning).
        """
        _refuse_stateful_hook(self.config, state.params)
        return super().init(state)

    def __call__(
        self, state: Any, batch: Any, rng: Any = None, mask: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """Tunes (first call only), then runs the chosen step."""
        if self.tuned is None:
            _refuse_stateful_hook(self.config, state.params)
        self._tune_once(state, batch, (rng, mask), lambda step: step, _copy, _shape_of)
        return super().__call__(state, batch, rng, mask)

    def lower(self, state: Any, batch: Any, rng: Any = None, mask: Any = None) -> Any:
        """Tunes (if not yet), then lowers the chosen step."""
        if self.tuned is None:
            _refuse_stateful_hook(self.config, state.params)
        self._tune_once(state, batch, (rng, mask), lambda step: step, _copy, _shape_of)
        return super().lower(state, batch, rng, mask)


class AutoTunedNNXStep(_TunesAtFirstCall, NNXDataParallelStep):
    """``fdp.nnx_train_step(bucket_cap_mb="auto")``: a :class:`fdp.NNXDataParallelStep` that tunes.

    The candidates run on copies of the model and optimizer; the caller's objects
    change only when the chosen step runs on them.
    """

    _step_class = NNXDataParallelStep

    def __init__(self, loss_fn: Callable[..., Any], make_step: Callable[..., Any], **kwargs: Any):
        self._start(loss_fn, make_step, kwargs)

    def init(self, model: Any, optimizer: Any, batch: Any = None) -> NNXCommState:
        """Places the objects as :meth:`fdp.NNXDataParallelStep.init` does.

        Raises:
          ValueError: the comm hook keeps state (its shape would depend on the tuning).
        """
        _refuse_stateful_hook(self.config, _nnx_params(model, optimizer))
        return super().init(model, optimizer, batch)

    def __call__(
        self, model: Any, optimizer: Any, batch: Any, mask: Any = None, *, comm_state: Any = None
    ) -> Any:
        """Tunes (first call only), then runs the chosen step in place."""
        if self.tuned is None:
            _refuse_stateful_hook(self.config, _nnx_params(model, optimizer))
        self._tune_once((model, optimizer), batch, (mask,), _PairStep, _copy_nnx, _nnx_shape_of)
        return super().__call__(model, optimizer, batch, mask, comm_state=comm_state)

    def split(self, model: Any, optimizer: Any, *, comm_state: Any = None) -> tuple[Any, Any]:
        """Places and splits the objects as :meth:`fdp.NNXDataParallelStep.split` does.

        Raises:
          ValueError: the comm hook keeps state (its shape would depend on the tuning).
        """
        _refuse_stateful_hook(self.config, _nnx_params(model, optimizer))
        return super().split(model, optimizer, comm_state=comm_state)

    def apply(self, graphdef: Any, state: Any, batch: Any, mask: Any = None) -> Any:
        """Tunes (first call only, on copies of the objects in ``state``), then runs the step."""
        if self.tuned is None:
            model, optimizer, _ = self.merge(graphdef, state)
            _refuse_stateful_hook(self.config, _nnx_params(model, optimizer))
            pair = (model, optimizer)
            self._tune_once(pair, batch, (mask,), _PairStep, _copy_nnx, _nnx_shape_of)
        return super().apply(graphdef, state, batch, mask)

    def lower(
        self, model: Any, optimizer: Any, batch: Any, mask: Any = None, *, comm_state: Any = None
    ) -> Any:
        """Tunes (if not yet), then lowers the chosen step."""
        if self.tuned is None:
            _refuse_stateful_hook(self.config, _nnx_params(model, optimizer))
        self._tune_once((model, optimizer), batch, (mask,), _PairStep, _copy_nnx, _nnx_shape_of)
        return super().lower(model, optimizer, batch, mask, comm_state=comm_state)
