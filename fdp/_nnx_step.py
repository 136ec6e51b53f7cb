"""``fdp.nnx_train_step``: the DDP step for a Flax NNX model and ``nnx.Optimizer``."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fdp._placement import DATA_AXIS
from fdp._step_common import (
    LossFn,
    StepConfig,
    add_device_axis,
    call_loss,
    constrain_batch,
    has_leaves,
    make_config,
    per_device,
    reduce_metrics,
    strip_device_axis,
)
from fdp.bucketing import BucketPlan, plan_for
from fdp.collectives import broadcast
from fdp.collectives._axis import is_varying
from fdp.hooks import CommHook, reduce_with_hook
from fdp.hooks._contract import Layout


class CommState(nnx.Variable):
    """A comm hook's state on an ``nnx.Optimizer`` (one copy per device, stacked)."""


def _sync_state(state: Any, axis_name: str) -> Any:
    """Variables a forward pass changed per device take device 0's values.

    This is DDP's ``broadcast_buffers``: batch statistics come from rank 0.
    """

    def leaf(x: Any) -> Any:
        return broadcast(x, 0, axis_name=axis_name) if is_varying(x, axis_name) else x

    return jax.tree.map(leaf, state)


class NNXDataParallelStep:
    """A compiled data-parallel step for Flax NNX; build it with :func:`nnx_train_step`.

    Call it as ``metrics = step(model, optimizer, batch)``: like ``nnx.jit``
    steps, it updates ``model`` and ``optimizer`` in place. A stateful comm
    hook keeps its state on the optimizer as ``optimizer.fdp_comm_state``.
    """

    def __init__(self, loss_fn: LossFn, cfg: StepConfig):
        self.loss_fn = loss_fn
        self.config = cfg
        self.plan: BucketPlan | None = None
        self._jitted = jax.jit(
            self._global_step, static_argnums=(0,), donate_argnums=(1, 2) if cfg.donate else ()
        )
        self._jitted_hook_init = jax.jit(self._hook_init)

    def _hook_init(self, params: Any) -> Any:
        cfg = self.config
        plan = plan_for(params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
        return jax.shard_map(
            lambda p: add_device_axis(cfg.comm_hook.init(p, plan)),
            mesh=cfg.mesh,
            in_specs=P(),
            out_specs=P(cfg.axis_name),
            axis_names={cfg.axis_name},
            check_vma=False,
        )(params)

    def init(self, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
        """Gives ``optimizer`` the comm hook's state, if the hook keeps any."""
        if not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(
                f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}. "
                "For a Linen TrainState use fdp.train_step."
            )
        if hasattr(optimizer, "fdp_comm_state"):
            return
        cfg = self.config
        params = nnx.state(model, optimizer.wrt)
        plan = plan_for(params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
        if has_leaves(jax.eval_shape(lambda p: cfg.comm_hook.init(p, plan), params)):
            optimizer.fdp_comm_state = CommState(self._jitted_hook_init(params))

    def _global_step(
        self, graphdef: Any, comm: Any, state: Any, batch: Any
    ) -> tuple[Any, Any, dict[str, Any]]:
        cfg = self.config
        batch = constrain_batch(batch, cfg)
        local = jax.shard_map(
            lambda c, s, b: self._local_step(graphdef, c, s, b),
            mesh=cfg.mesh,
            in_specs=(P(cfg.axis_name), P(), P(cfg.axis_name)),
            out_specs=(P(cfg.axis_name), P(), P()),
            axis_names={cfg.axis_name},
            check_vma=cfg.comm_hook.vma_safe,
        )
        return local(comm, state, batch)

    def _local_step(
        self, graphdef: Any, comm: Any, state: Any, batch: Any
    ) -> tuple[Any, Any, dict[str, Any]]:
        cfg = self.config
        model, optimizer = nnx.merge(graphdef, strip_device_axis(comm), state)
        model_def, params, keys, rest = nnx.split(model, optimizer.wrt, nnx.RngKey, ...)
        self.plan = plan_for(params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
        # Per-device parameters (so the reduction is ours, not jax.grad's) and
        # per-device random streams (so each device draws its own dropout masks).
        local_params = per_device(params, cfg.axis_name)
        index = jax.lax.axis_index(cfg.axis_name)
        local_keys = jax.tree.map(lambda k: jax.random.fold_in(k, index), keys)

        def loss_of(p: Any) -> tuple[jax.Array, Any]:
            # copy=True: fresh Variables at this trace level, which the forward
            # pass may mutate (batch statistics, rng counters).
            m = nnx.merge(model_def, p, local_keys, rest, copy=True)
            loss, aux = call_loss(self.loss_fn, cfg.has_aux, m, batch)
            return loss, (aux, nnx.split(m, optimizer.wrt, nnx.RngKey, ...)[3])

        (loss, (aux, new_rest)), grads = jax.value_and_grad(loss_of, has_aux=True)(local_params)
        has_comm = hasattr(optimizer, "fdp_comm_state")
        hook_state = optimizer.fdp_comm_state.get_value() if has_comm else ()
        grads, hook_state = reduce_with_hook(
            cfg.comm_hook,
            hook_state,
            grads,
            axis_name=cfg.axis_name,
            plan=self.plan,
            layout=cfg.layout,
            params=params,
        )
        nnx.update(model, _sync_state(new_rest, cfg.axis_name))
        optimizer.update(model, grads)
        if has_comm:
            optimizer.fdp_comm_state.set_value(hook_state)
        comm_out, state_out = nnx.split((model, optimizer), CommState, ...)[1:]
        return add_device_axis(comm_out), state_out, reduce_metrics(loss, aux, cfg.axis_name)

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> dict[str, Any]:
        """Runs one step in place and returns the metrics."""
        self.init(model, optimizer)
        graphdef, comm, state = nnx.split((model, optimizer), CommState, ...)
        comm, state, metrics = self._jitted(graphdef, comm, state, batch)
        nnx.update((model, optimizer), comm, state)
        return metrics

    def lower(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> Any:
        """The lowered step, without running it."""
        self.init(model, optimizer)
        graphdef, comm, state = nnx.split((model, optimizer), CommState, ...)
        return self._jitted.lower(graphdef, comm, state, batch)


def nnx_train_step(
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
) -> NNXDataParallelStep:
    """Builds a jitted DDP step for a Flax NNX model and its ``nnx.Optimizer``.

    Gradients are taken with respect to the optimizer's ``wrt`` variables
    (``nnx.Param`` by default), reduced over the data axis in DDP's buckets and
    applied with ``optimizer.update``. Other variables changed by the forward
    pass (batch statistics) take device 0's values, like DDP's
    ``broadcast_buffers``. Random streams (``nnx.Rngs``) draw different numbers
    on each device.

    Args:
      loss_fn: ``loss_fn(model, batch)`` returning the mean loss over the local
        batch, or ``(loss, aux)`` with ``has_aux=True``.
      mesh: the mesh (default: all devices on one ``'data'`` axis).
      axis_name: the data axis of ``mesh``.
      bucket_cap_mb: DDP's ``bucket_cap_mb`` (MiB).
      first_bucket_cap_mb: cap of the first bucket (MiB).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      donate: donate the state's buffers to the step.
      layout: ``'leaves'`` or ``'flat'``; see :func:`fdp.reduce_gradients`.
      comm_hook: a :class:`fdp.hooks.CommHook` or a hook name. Hooks whose
        replicas diverge (``noop``, ``post_local_sgd``) need one model per
        device, which an NNX model object is not: use :func:`fdp.train_step`.

    Returns:
      An :class:`NNXDataParallelStep`: ``metrics = step(model, optimizer, batch)``.

    Raises:
      ValueError: a hook whose replicas diverge.

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
        model_averager=None,
    )
    if cfg.per_device_state:
        raise ValueError(
            f"comm hook {cfg.comm_hook.name!r} lets replicas diverge, which needs one model "
            "per device; an NNX model object holds one. Use fdp.train_step with a Linen "
            "TrainState for this hook."
        )
    return NNXDataParallelStep(loss_fn, cfg)
