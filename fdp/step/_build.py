"""The builders: ``fdp.train_step``, ``fdp.nnx_train_step`` and ``fdp.tune``.

They sit above everything else in ``fdp/step/``: each turns its keywords into the
policies and a :class:`~fdp.step.options._config.StepConfig`, and builds a front
end's step (``front/``), or, for ``bucket_cap_mb="auto"``, that step with tuning at
its first call (``tune/``), handing itself in as the tuner's step factory. Nothing
below imports this module, so the tuner and the front ends do not know each other's
builders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from jax.sharding import Mesh

from fdp.collectives._axis import AxisName
from fdp.data._placement import DATA_AXIS
from fdp.observe._stats import StatsSchedule
from fdp.step.front._linen import DataParallelStep
from fdp.step.front._nnx import NNXDataParallelStep
from fdp.step.grads._loss import check_loss_fn
from fdp.step.options._config import BufferHook, LossFn, config_of
from fdp.step.options._policies import Accumulation, Loss, Reduction, Sharding, from_keywords
from fdp.step.tune._first_call import AutoTunedNNXStep, AutoTunedStep
from fdp.step.tune._tune import (
    DEFAULT_CAPS,
    DEFAULT_LAYOUTS,
    FINALISTS,
    MARGIN,
    RACE_ROUNDS,
    ROUNDS,
    STEPS,
    WARMUP,
    TuneResult,
    copy_tree,
    run_tune,
)


def train_step(
    loss_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    axis_name: AxisName = DATA_AXIS,
    reduction: Reduction | None = None,
    accumulation: Accumulation | None = None,
    loss: Loss | None = None,
    sharding: Sharding | None = None,
    buffers: str | BufferHook = "broadcast",
    donate: bool = True,
    stats: bool | StatsSchedule = False,
    fold_dots: bool | None = None,
    **deprecated: Any,
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
      axis_name: the data axis of ``mesh``, or ``(outer, inner)``: two mesh
        axes taken together (a host x device mesh, :func:`fdp.data_mesh`).
      reduction: how gradients are reduced (:class:`fdp.Reduction`): DDP's
        bucket caps (or ``bucket_cap_mb="auto"``: at its first call the step
        times a few caps and layouts with :func:`fdp.tune` on copies of the
        state and runs the fastest; ``step.tuned`` says which), the layout, the
        comm hook (hooks with state need :class:`fdp.TrainState`), its dtype and
        levels, and a model averager (post-local SGD). Default: DDP's.
      accumulation: micro-batches per step, accumulated locally and reduced
        once (:class:`fdp.Accumulation`, DDP's ``no_sync``). Default: one.
      loss: what ``loss_fn`` returns and how its examples weigh
        (:class:`fdp.Loss`): aux values (averaged over the data axis into
        ``metrics['aux']``, or gathered along the batch), one loss per example
        (uneven batches padded and masked; ``step(..., mask=w)`` weighs
        examples), and parameters that may not reach the loss (left
        untouched). Default: a scalar mean loss alone.
      sharding: what is sharded over the data axis (:class:`fdp.Sharding`):
        ZeRO's stage. The parameters after each step equal stage 0's. See
        docs/zero.md. Default: nothing (DDP).
      buffers: how ``state.batch_stats`` updated by the forward pass is kept:
        ``'broadcast'`` (device 0's, DDP's default), ``'mean'`` (averaged over
        the data axis), ``'local'`` (one copy per device), or a function
        ``fn(batch_stats, axis_name) -> batch_stats`` run on every device
        inside the step (DDP's buffer comm hook).
      donate: donate the input state's buffers (it must not be used after).
      stats: sample runtime statistics (``step.stats()``) at any debug level:
        ``True`` (steps 1-10, then every 100th) or a :class:`fdp.StatsSchedule`.
        They are sampled at ``FDP_DEBUG=INFO`` and above anyway.
      fold_dots: compute dense products of n-D activations (``nn.Dense`` on
        ``[batch, seq, features]``) on the activation folded to 2-D, as
        ``torch.nn.Linear`` does; XLA:CPU otherwise transposes each weight
        gradient's operand in memory. None (default): on CPU devices only.
        Values are the same products up to the summation order (float
        rounding). See docs/performance.md.
      **deprecated: fdp 0.1's flat keywords (``bucket_cap_mb=``,
        ``accumulate_steps=``, ``zero_stage=``...), for one release: each sets
        its policy's field, with a ``DeprecationWarning`` naming the new
        spelling. CHANGELOG.md has the table.

    Returns:
      A :class:`DataParallelStep`: ``state, metrics = step(state, batch)``,
      where ``metrics['loss']`` is the loss over the whole batch; with
      ``reduction=fdp.Reduction(grad_norm=True)``, ``metrics['grad_norm']`` is
      the global L2 norm of the reduced (averaged) gradient, as
      ``optax.clip_by_global_norm`` sees it.

    Raises:
      ValueError: the mesh has no ``axis_name`` axis, a cap is not positive, an
        unknown hook name or buffer mode.
      TypeError: an unknown keyword, or a flat keyword together with its policy.

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
    given = {
        "mesh": mesh,
        "axis_name": axis_name,
        "reduction": reduction,
        "accumulation": accumulation,
        "loss": loss,
        "sharding": sharding,
        "buffers": buffers,
        "donate": donate,
        "fold_dots": fold_dots,
    }
    settings = from_keywords("fdp.train_step", given, deprecated)
    cfg = config_of(settings)
    if settings["reduction"].auto:
        # It stands in for the step it builds at its first call (same calls, same attributes).
        return cast(DataParallelStep, AutoTunedStep(loss_fn, train_step, **settings, stats=stats))
    return DataParallelStep(check_loss_fn(loss_fn), cfg, stats)


def nnx_train_step(
    loss_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    axis_name: AxisName = DATA_AXIS,
    reduction: Reduction | None = None,
    accumulation: Accumulation | None = None,
    loss: Loss | None = None,
    sharding: Sharding | None = None,
    buffers: str | BufferHook = "broadcast",
    donate: bool = True,
    stats: bool | StatsSchedule = False,
    fold_dots: bool | None = None,
    **deprecated: Any,
) -> NNXDataParallelStep:
    """Builds a jitted DDP step for a Flax NNX model and its ``nnx.Optimizer``.

    Gradients are taken with respect to the optimizer's ``wrt`` variables
    (``nnx.Param`` by default), reduced over the data axis in DDP's buckets and
    applied with ``optimizer.update``. Other variables changed by the forward
    pass (batch statistics) are kept in step as ``buffers`` says (device 0's by
    default, like DDP's ``broadcast_buffers``). Random streams (``nnx.Rngs``)
    draw different numbers on each device.

    Args:
      loss_fn: ``loss_fn(model, batch)`` returning the mean loss over the local
        batch, or ``(loss, aux)`` with ``loss=fdp.Loss(has_aux=True)``.
      mesh: the mesh (default: all devices on one ``'data'`` axis).
      axis_name: the data axis of ``mesh``, or ``(outer, inner)``: two mesh
        axes taken together (a host x device mesh, :func:`fdp.data_mesh`).
      reduction: how gradients are reduced (:class:`fdp.Reduction`; see
        :func:`fdp.train_step`). ``bucket_cap_mb="auto"`` times candidate caps
        and layouts on copies of the model and optimizer and keeps the fastest
        (:func:`fdp.tune`; docs/bucketing.md). Hooks whose replicas diverge
        (``noop``, ``post_local_sgd``) and model averagers need one model per
        device, which an NNX model object is not: use :func:`fdp.train_step`.
      accumulation: micro-batches per step, reduced once
        (:class:`fdp.Accumulation`, ``no_sync``).
      loss: what ``loss_fn`` returns and how its examples weigh
        (:class:`fdp.Loss`; see :func:`fdp.train_step`).
      sharding: ZeRO's stage (:class:`fdp.Sharding`; docs/zero.md).
      buffers: ``'broadcast'`` (device 0's batch statistics), ``'mean'``
        (averaged over the data axis) or a function ``fn(state, axis_name) ->
        state`` of the non-parameter state. ``'local'`` needs one model per
        device: use :func:`fdp.train_step`.
      donate: donate the model's and optimizer's arrays to the step (``nnx.jit``
        donates nothing by default): an array read out of the model before a
        step (``w = model.linear.kernel[...]``) is deleted by it. Copy what you
        keep, or pass ``False``.
      stats: sample runtime statistics (``step.stats()``) at any debug level;
        see :func:`fdp.train_step`.
      fold_dots: 2-D dense products on CPU (see :func:`fdp.train_step`).
      **deprecated: fdp 0.1's flat keywords, for one release (see
        :func:`fdp.train_step`).

    Returns:
      An :class:`NNXDataParallelStep`: ``metrics = step(model, optimizer, batch)``,
      with ``metrics['loss']`` (and ``metrics['grad_norm']``) as in :func:`fdp.train_step`.
      A comm hook that keeps state (PowerSGD) keeps it in the
      :class:`fdp.NNXCommState` that ``step.init(model, optimizer)`` returns,
      passed as ``step(model, optimizer, batch, comm_state=comm_state)``.

    Raises:
      ValueError: a hook whose replicas diverge, a model averager, or
        ``buffers='local'``.
      TypeError: an unknown keyword, or a flat keyword together with its policy.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import fdp
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def loss_fn(model, batch):
      ...     return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)
      >>> step = fdp.nnx_train_step(loss_fn)
      >>> batch = fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones(8)})
      >>> metrics = step(model, optimizer, batch)
      >>> int(optimizer.step[...])
      1
    """
    given = {
        "mesh": mesh,
        "axis_name": axis_name,
        "reduction": reduction,
        "accumulation": accumulation,
        "loss": loss,
        "sharding": sharding,
        "buffers": buffers,
        "donate": donate,
        "fold_dots": fold_dots,
    }
    settings = from_keywords("fdp.nnx_train_step", given, deprecated)
    cfg = config_of(settings)
    if cfg.buffers == "local":
        raise ValueError(
            "buffers='local' keeps batch statistics once per device, which an NNX model "
            "object cannot hold; use fdp.train_step with a Linen TrainState, or "
            "buffers='broadcast' / 'mean'."
        )
    if cfg.per_device_state:
        raise ValueError(
            f"comm hook {cfg.comm_hook.name!r} lets replicas diverge, which needs one model "
            "per device; an NNX model object holds one. Use fdp.train_step with a Linen "
            "TrainState for this hook."
        )
    if cfg.model_averager is not None:
        raise ValueError(
            f"Reduction.model_averager={type(cfg.model_averager).__name__} averages "
            "per-device parameters, which needs one model per device; an NNX model object "
            "holds one. Use fdp.train_step with a Linen TrainState for post-local SGD."
        )
    if settings["reduction"].auto:
        # It stands in for the step it builds at its first call (same calls, same attributes).
        return cast(
            NNXDataParallelStep, AutoTunedNNXStep(loss_fn, nnx_train_step, **settings, stats=stats)
        )
    return NNXDataParallelStep(check_loss_fn(loss_fn), cfg, stats)


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
        make_step = train_step
    return run_tune(
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
        copy=copy_tree,
        step_kwargs=step_kwargs,
    )
