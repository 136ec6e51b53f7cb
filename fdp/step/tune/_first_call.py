"""Tuning at a step's first call: ``bucket_cap_mb="auto"``.

The tuned steps are the front ends' step classes with one thing added: their first
call (or ``lower``) times candidate steps on copies of the state with
:func:`fdp.step.tune._tune.tuned_step`, and the step then becomes the chosen one.
They are built on the front ends and know nothing of the builders: the builder
(``fdp.train_step``, ``fdp.nnx_train_step``) hands itself in as ``make_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fdp.bucketing import plan_for
from fdp.step.core._comm_state import NNXCommState
from fdp.step.core._state import hook_is_stateful
from fdp.step.front._linen import DataParallelStep
from fdp.step.front._nnx import NNXDataParallelStep
from fdp.step.options._policies import with_cap
from fdp.step.tune._tune import DEFAULT, TuneResult, copy_tree, shape_of, tuned_step


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
        default = {**kwargs, "reduction": with_cap(reduction, DEFAULT[0], reduction.layout)}
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
    """An NNX step in :func:`~fdp.step.tune._tune.run_tune`'s calling convention, on a pair.

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
    return nnx.merge(graphdef, copy_tree(state))


def _nnx_params(model: Any, optimizer: Any) -> Any:
    from flax import nnx

    return nnx.state(model, optimizer.wrt)


def _nnx_shape_of(pair: tuple) -> tuple:
    from flax import nnx

    return shape_of(nnx.state(pair))


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
        self._tune_once(state, batch, (rng, mask), lambda step: step, copy_tree, shape_of)
        return super().__call__(state, batch, rng, mask)

    def lower(self, state: Any, batch: Any, rng: Any = None, mask: Any = None) -> Any:
        """Tunes (if not yet), then lowers the chosen step."""
        if self.tuned is None:
            _refuse_stateful_hook(self.config, state.params)
        self._tune_once(state, batch, (rng, mask), lambda step: step, copy_tree, shape_of)
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
