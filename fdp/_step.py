"""``fdp.train_step``: a jitted DDP step for a Flax ``TrainState``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp._placement import DATA_AXIS, check_axis, data_mesh
from fdp._reduction import Layout, check_layout, plan_for, reduce_gradients
from fdp.bucketing import BucketPlan, cap_limits

LossFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Settings shared by the Linen and NNX steps.

    Attributes:
      mesh: the device mesh.
      axis_name: its data axis.
      bucket_cap_mb: bucket cap in MiB.
      first_bucket_cap_mb: first-bucket cap in MiB.
      has_aux: whether the loss function returns ``(loss, aux)``.
      donate: donate the state's buffers to the step.
      layout: how buckets are reduced (see :func:`fdp.reduce_gradients`).
    """

    mesh: Mesh
    axis_name: str
    bucket_cap_mb: float
    first_bucket_cap_mb: float
    has_aux: bool
    donate: bool
    layout: Layout = "leaves"

    @property
    def num_replicas(self) -> int:
        """Devices along the data axis."""
        return int(self.mesh.shape[self.axis_name])


def make_config(
    mesh: Mesh | None,
    axis_name: str,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    has_aux: bool,
    donate: bool,
    layout: Layout,
) -> StepConfig:
    """Validates the step settings eagerly, so mistakes surface at construction."""
    mesh = data_mesh(axis_name=axis_name) if mesh is None else mesh
    check_axis(mesh, axis_name)
    cap_limits(bucket_cap_mb, first_bucket_cap_mb)
    check_layout(layout)
    return StepConfig(mesh, axis_name, bucket_cap_mb, first_bucket_cap_mb, has_aux, donate, layout)


def constrain_batch(batch: Any, cfg: StepConfig) -> Any:
    """Shards the global batch over the data axis, checking it splits evenly."""
    n = cfg.num_replicas
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(leaf)
        if not shape or shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or 'batch'} has shape {shape}; its "
                f"leading (batch) size must be divisible by the {n} devices of axis "
                f"{cfg.axis_name!r}. Use a batch size that is a multiple of {n}."
            )
    sharding = NamedSharding(cfg.mesh, P(cfg.axis_name))
    if cfg.mesh.axis_types[cfg.mesh.axis_names.index(cfg.axis_name)] == AxisType.Explicit:
        return jax.reshard(batch, sharding)
    return jax.lax.with_sharding_constraint(batch, sharding)


def call_loss(loss_fn: LossFn, has_aux: bool, *args: Any) -> tuple[jax.Array, Any]:
    """Calls the user's loss and checks that it returned a scalar."""
    out = loss_fn(*args)
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "loss_fn was declared has_aux=True and must return (loss, aux); got "
                f"{type(out).__name__}."
            )
        loss, aux = out
    else:
        loss, aux = out, None
    if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        raise TypeError(
            "loss_fn must return the mean loss over the local batch as a float scalar; got "
            f"{jnp.result_type(loss)}{list(jnp.shape(loss))}. Reduce it with .mean()"
            + ("" if has_aux else ", or pass has_aux=True if it returns (loss, aux)")
            + "."
        )
    return loss, aux


def reduce_metrics(loss: jax.Array, aux: Any, axis_name: str) -> dict[str, Any]:
    """Loss and aux averaged over the data axis (integer and bool aux leaves summed)."""

    def reduce_leaf(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, axis_name)
        return jax.lax.psum(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, axis_name)

    metrics = {"loss": jax.lax.pmean(loss, axis_name)}
    if aux is not None:
        metrics["aux"] = jax.tree.map(reduce_leaf, aux)
    return metrics


def device_rng(rng: jax.Array | None, axis_name: str) -> jax.Array | None:
    """A different key per device, as each DDP rank draws its own dropout masks."""
    if rng is None:
        return None
    return jax.random.fold_in(rng, jax.lax.axis_index(axis_name))


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
        self._jitted = jax.jit(self._global_step, donate_argnums=(0,) if cfg.donate else ())

    def _global_step(self, state: Any, batch: Any, rng: Any) -> tuple[Any, dict[str, Any]]:
        cfg = self.config
        if not (hasattr(state, "params") and hasattr(state, "apply_gradients")):
            raise TypeError(
                "state must be a flax.training.train_state.TrainState (something with "
                f".params and .apply_gradients), got {type(state).__name__}. For Flax NNX "
                "use fdp.nnx_train_step."
            )
        self.plan = plan_for(state.params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb)
        batch = constrain_batch(batch, cfg)
        local = jax.shard_map(
            self._local_step,
            mesh=cfg.mesh,
            in_specs=(P(), P(cfg.axis_name), P()),
            out_specs=(P(), P()),
            axis_names={cfg.axis_name},
        )
        return local(state, batch, rng)

    def _local_step(self, state: Any, batch: Any, rng: Any) -> tuple[Any, dict[str, Any]]:
        cfg = self.config
        # Per-device parameters, so that jax.grad gives per-device gradients and
        # the one reduction is ours (the double-reduction trap in docs/design.md).
        params = jax.lax.pcast(state.params, cfg.axis_name, to="varying")
        rng = device_rng(rng, cfg.axis_name)
        extra = () if rng is None else (rng,)

        def loss_of(p: Any) -> tuple[jax.Array, Any]:
            return call_loss(self.loss_fn, cfg.has_aux, p, batch, *extra)

        (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        grads = reduce_gradients(grads, axis_name=cfg.axis_name, plan=self.plan, layout=cfg.layout)
        return state.apply_gradients(grads=grads), reduce_metrics(loss, aux, cfg.axis_name)

    def __call__(self, state: Any, batch: Any, rng: Any = None) -> tuple[Any, dict[str, Any]]:
        """Runs one step: ``(state, batch[, rng]) -> (state, metrics)``."""
        return self._jitted(state, batch, rng)

    def lower(self, state: Any, batch: Any, rng: Any = None) -> Any:
        """The lowered step (``.as_text()``, ``.compile()``), without running it."""
        return self._jitted.lower(state, batch, rng)


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
) -> DataParallelStep:
    """Builds a jitted DDP step for a ``flax.training.train_state.TrainState``.

    The step computes per-device gradients of ``loss_fn`` on each device's share
    of the batch, averages them over the data axis in DDP's buckets, and applies
    them with ``state.apply_gradients``. The result equals one step on the whole
    batch on one device.

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

    Returns:
      A :class:`DataParallelStep`: ``state, metrics = step(state, batch)``,
      where ``metrics['loss']`` is the loss averaged over all devices.

    Raises:
      ValueError: the mesh has no ``axis_name`` axis, or a cap is not positive.

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
    cfg = make_config(mesh, axis_name, bucket_cap_mb, first_bucket_cap_mb, has_aux, donate, layout)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    return DataParallelStep(loss_fn, cfg)
