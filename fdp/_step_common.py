"""What the Linen and NNX steps share: settings, batch placement, loss and metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp._placement import check_axis, data_mesh
from fdp.bucketing import cap_limits
from fdp.collectives._axis import is_varying
from fdp.hooks import CommHook, PeriodicModelAverager, resolve
from fdp.hooks._contract import Layout, check_layout

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
      comm_hook: the comm hook applied to every bucket.
      model_averager: averages parameters periodically (local SGD), or None.
    """

    mesh: Mesh
    axis_name: str
    bucket_cap_mb: float
    first_bucket_cap_mb: float
    has_aux: bool
    donate: bool
    layout: Layout
    comm_hook: CommHook
    model_averager: PeriodicModelAverager | None

    @property
    def num_replicas(self) -> int:
        """Devices along the data axis."""
        return int(self.mesh.shape[self.axis_name])

    @property
    def per_device_state(self) -> bool:
        """Whether replicas may diverge, so the state is kept once per device."""
        return not self.comm_hook.replicated_output


def make_config(
    loss_fn: LossFn,
    *,
    mesh: Mesh | None,
    axis_name: str,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    has_aux: bool,
    donate: bool,
    layout: Layout,
    comm_hook: CommHook | str | None,
    model_averager: PeriodicModelAverager | None,
) -> StepConfig:
    """Validates the step settings eagerly, so mistakes surface at construction."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    mesh = data_mesh(axis_name=axis_name) if mesh is None else mesh
    check_axis(mesh, axis_name)
    cap_limits(bucket_cap_mb, first_bucket_cap_mb)
    check_layout(layout)
    hook = resolve(comm_hook)
    if model_averager is not None and not isinstance(model_averager, PeriodicModelAverager):
        raise TypeError(
            "model_averager must be a fdp.hooks.PeriodicModelAverager, got "
            f"{type(model_averager).__name__}."
        )
    return StepConfig(
        mesh,
        axis_name,
        bucket_cap_mb,
        first_bucket_cap_mb,
        has_aux,
        donate,
        layout,
        hook,
        model_averager,
    )


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


def per_device(tree: Any, axis_name: str) -> Any:
    """Marks every leaf device-varying (a no-op for leaves that already are).

    Parameters are made per-device before ``jax.grad`` so that the gradient is
    per-device and the bucketed reduction is the only one (the double-reduction
    trap in docs/design.md).
    """

    def leaf(x: Any) -> Any:
        if is_varying(x, axis_name) is False:
            return jax.lax.pcast(x, axis_name, to="varying")
        return x

    return jax.tree.map(leaf, tree)


def strip_device_axis(tree: Any) -> Any:
    """Inside shard_map: a per-device leaf ``[1, ...]`` as ``[...]``."""
    return jax.tree.map(lambda x: x[0], tree)


def add_device_axis(tree: Any) -> Any:
    """Inside shard_map: ``[...]`` as this device's ``[1, ...]`` block."""
    return jax.tree.map(lambda x: x[None], tree)


def has_leaves(tree: Any) -> bool:
    """Whether a pytree holds any array."""
    return bool(jax.tree.leaves(tree))
