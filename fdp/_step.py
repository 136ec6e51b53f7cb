"""``fdp.train_step``: a jitted DDP step for a Flax ``TrainState``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fdp._placement import DATA_AXIS
from fdp._step_common import (
    LossFn,
    StepConfig,
    add_device_axis,
    call_loss,
    constrain_batch,
    device_rng,
    has_leaves,
    make_config,
    per_device,
    reduce_metrics,
    strip_device_axis,
)
from fdp.bucketing import BucketPlan, plan_for
from fdp.hooks import CommHook, PeriodicModelAverager, reduce_with_hook
from fdp.hooks._contract import Layout


class DataParallelStep:
    """A compiled data-parallel training step; build it with :func:`train_step`.

    Call it as ``state, metrics = step(state, batch)`` (or with a third
    argument ``rng``). ``plan`` holds the bucket plan once the step has been
    traced, and ``lower`` gives the lowered program for inspection.
    """

    def __init__(self, loss_fn: LossFn, cfg: StepConfig):
        self.loss_fn = loss_fn
        self.config = cfg
        self.plan: BucketPlan | None = None
        self._hook_has_state: bool | None = None
        self._jitted = jax.jit(self._global_step, donate_argnums=(0,) if cfg.donate else ())
        self._jitted_stack = jax.jit(self._stack)
        self._jitted_hook_init = jax.jit(self._hook_init)

    # -- state preparation (once, before the first step) ---------------------------

    def _local_params(self, params: Any) -> Any:
        """Parameters as one device sees them (per-device state has a device axis)."""
        if self.config.per_device_state:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), params)
        return params

    def _plan(self, params: Any) -> BucketPlan:
        cfg = self.config
        local = self._local_params(params)
        self.plan = plan_for(local, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
        return self.plan

    def _stack(self, state: Any) -> Any:
        """One copy of a replicated state per device, stacked on the data axis."""
        cfg = self.config
        return jax.shard_map(
            add_device_axis,
            mesh=cfg.mesh,
            in_specs=P(),
            out_specs=P(cfg.axis_name),
            axis_names={cfg.axis_name},
            check_vma=False,
        )(state)

    def _hook_init(self, params: Any) -> Any:
        """The comm hook's state, initialised from the parameters on every device."""
        cfg = self.config
        plan = self._plan(params)

        def local(params: Any) -> Any:
            params = strip_device_axis(params) if cfg.per_device_state else params
            return add_device_axis(cfg.comm_hook.init(params, plan))

        return jax.shard_map(
            local,
            mesh=cfg.mesh,
            in_specs=P(cfg.axis_name) if cfg.per_device_state else P(),
            out_specs=P(cfg.axis_name),
            axis_names={cfg.axis_name},
            check_vma=False,
        )(params)

    def _needs_init(self, state: Any) -> bool:
        if self._hook_has_state is None:
            return True
        if self.config.per_device_state and jnp.ndim(state.step) == 0:
            return True
        return self._hook_has_state and getattr(state, "comm_state", None) is None

    def init(self, state: Any) -> Any:
        """Prepares ``state`` for this step: hook state, and per-device copies if needed.

        The step does this by itself when needed; call it to checkpoint or
        inspect the prepared state before training. With a hook whose replicas
        diverge (``noop``, ``post_local_sgd``) every leaf gains a leading device
        axis; with a stateful hook ``state.comm_state`` is filled in.
        """
        cfg = self.config
        _check_state(state)
        if cfg.per_device_state and jnp.ndim(state.step) == 0:
            stacked = self._jitted_stack(_without_comm(state))
            state = _with_comm(stacked, getattr(state, "comm_state", None))
        plan = self._plan(state.params)
        shape = jax.eval_shape(
            lambda p: cfg.comm_hook.init(p, plan), self._local_params(state.params)
        )
        self._hook_has_state = has_leaves(shape)
        if self._hook_has_state:
            if not hasattr(state, "comm_state"):
                raise TypeError(
                    f"comm hook {cfg.comm_hook.name!r} keeps state between steps; use "
                    "fdp.TrainState (flax's TrainState with a comm_state field) instead of "
                    f"{type(state).__module__}.{type(state).__qualname__}."
                )
            if state.comm_state is None:
                state = state.replace(comm_state=self._jitted_hook_init(state.params))
        return state

    # -- the step ---------------------------------------------------------------------

    def _global_step(self, state: Any, batch: Any, rng: Any) -> tuple[Any, dict[str, Any]]:
        cfg = self.config
        _check_state(state)
        self._plan(state.params)
        batch = constrain_batch(batch, cfg)
        comm = getattr(state, "comm_state", None)
        state_spec = P(cfg.axis_name) if cfg.per_device_state else P()
        local = jax.shard_map(
            self._local_step,
            mesh=cfg.mesh,
            in_specs=(state_spec, P(cfg.axis_name), P(cfg.axis_name), P()),
            out_specs=(state_spec, P(cfg.axis_name), P()),
            axis_names={cfg.axis_name},
            check_vma=cfg.comm_hook.vma_safe,
        )
        core, comm, metrics = local(_without_comm(state), comm, batch, rng)
        return _with_comm(core, comm), metrics

    def _local_step(
        self, state: Any, comm: Any, batch: Any, rng: Any
    ) -> tuple[Any, Any, dict[str, Any]]:
        cfg = self.config
        if cfg.per_device_state:
            state = strip_device_axis(state)
        hook_state = () if comm is None else strip_device_axis(comm)
        params = per_device(state.params, cfg.axis_name)
        rng = device_rng(rng, cfg.axis_name)
        extra = () if rng is None else (rng,)

        def loss_of(p: Any) -> tuple[jax.Array, Any]:
            return call_loss(self.loss_fn, cfg.has_aux, p, batch, *extra)

        (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        grads, hook_state = reduce_with_hook(
            cfg.comm_hook,
            hook_state,
            grads,
            axis_name=cfg.axis_name,
            plan=self.plan,
            layout=cfg.layout,
            params=state.params,
        )
        new_state = state.apply_gradients(grads=grads)
        if cfg.model_averager is not None:
            averaged = cfg.model_averager.average(new_state.params, state.step, cfg.axis_name)
            new_state = new_state.replace(params=averaged)
        if cfg.per_device_state:
            new_state = add_device_axis(new_state)
        new_comm = None if comm is None else add_device_axis(hook_state)
        return new_state, new_comm, reduce_metrics(loss, aux, cfg.axis_name)

    def __call__(self, state: Any, batch: Any, rng: Any = None) -> tuple[Any, dict[str, Any]]:
        """Runs one step: ``(state, batch[, rng]) -> (state, metrics)``."""
        if self._needs_init(state):
            state = self.init(state)
        return self._jitted(state, batch, rng)

    def lower(self, state: Any, batch: Any, rng: Any = None) -> Any:
        """The lowered step (``.as_text()``, ``.compile()``), without running it."""
        return self._jitted.lower(self.init(state), batch, rng)


def _check_state(state: Any) -> None:
    if not (hasattr(state, "params") and hasattr(state, "apply_gradients")):
        raise TypeError(
            "state must be a flax.training.train_state.TrainState (something with "
            f".params and .apply_gradients), got {type(state).__name__}. For Flax NNX "
            "use fdp.nnx_train_step."
        )


def _without_comm(state: Any) -> Any:
    return (
        state.replace(comm_state=None) if getattr(state, "comm_state", None) is not None else state
    )


def _with_comm(state: Any, comm: Any) -> Any:
    return state.replace(comm_state=comm) if comm is not None else state


def train_step(
    loss_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    axis_name: str = DATA_AXIS,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    has_aux: bool = False,
    donate: bool = True,
    layout: Layout = "leaves",
    comm_hook: CommHook | str | None = None,
    model_averager: PeriodicModelAverager | None = None,
) -> DataParallelStep:
    """Builds a jitted DDP step for a ``flax.training.train_state.TrainState``.

    The step computes per-device gradients of ``loss_fn`` on each device's share
    of the batch, reduces them over the data axis in DDP's buckets (by default
    their mean), and applies them with ``state.apply_gradients``. With the
    default hook the result equals one step on the whole batch on one device.

    Args:
      loss_fn: ``loss_fn(params, batch)`` (or ``loss_fn(params, batch, rng)``
        when the step is called with an ``rng``) returning the mean loss over
        the local batch, or ``(loss, aux)`` with ``has_aux=True``.
      mesh: the mesh (default: all devices on one ``'data'`` axis). Other mesh
        axes are left to the compiler, so parameters may be sharded over them.
      axis_name: the data axis of ``mesh``.
      bucket_cap_mb: DDP's ``bucket_cap_mb`` (MiB).
      first_bucket_cap_mb: cap of the first bucket (MiB).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is averaged over
        the data axis (integer and bool leaves summed) into ``metrics['aux']``.
      donate: donate the input state's buffers (it must not be used after).
      layout: ``'leaves'`` (no copies) or ``'flat'`` (DDP's packed bucket
        buffers); see :func:`fdp.reduce_gradients`.
      comm_hook: a :class:`fdp.hooks.CommHook` or a hook name (default: the
        mean all-reduce). Hooks with state need :class:`fdp.TrainState`.
      model_averager: a :class:`fdp.hooks.PeriodicModelAverager` that averages
        parameters over the data axis periodically (post-local SGD).

    Returns:
      A :class:`DataParallelStep`: ``state, metrics = step(state, batch)``,
      where ``metrics['loss']`` is the loss averaged over all devices.

    Raises:
      ValueError: the mesh has no ``axis_name`` axis, a cap is not positive, or
        an unknown hook name.

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
    cfg = make_config(
        loss_fn,
        mesh=mesh,
        axis_name=axis_name,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        has_aux=has_aux,
        donate=donate,
        layout=layout,
        comm_hook=comm_hook,
        model_averager=model_averager,
    )
    return DataParallelStep(loss_fn, cfg)
