"""What the Linen and NNX steps share: settings, batch placement, loss and metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp.bucketing import cap_limits
from fdp.collectives import broadcast
from fdp.collectives._axis import axis_size, is_varying, mean_over, sum_over
from fdp.data._placement import check_axis, data_mesh
from fdp.hooks import CommHook, PeriodicModelAverager, resolve
from fdp.hooks._contract import Layout

StepLayout = Literal["auto", "leaves", "flat"]
# Keeps each of fdp's all-reduces apart in XLA:CPU's compiled program.
_KEEP_BUCKETS = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def resolve_layout(layout: str, mesh: Mesh) -> Layout:
    """``'auto'``: DDP's flat buckets on CPU with several processes, else in place.

    Measured on 2 processes x 1 CPU device (gloo, an 8.4M-parameter MLP): one
    combined all-reduce after the backward pass gave 683-718 examples/s; flat
    buckets kept apart, so each all-reduce can start while the backward pass
    goes on, 725-798 (25 MiB buckets) and 983-1006 (2.5 MiB). In one process the
    buckets gain nothing and their packing costs a copy.
    """
    if layout not in ("auto", "leaves", "flat"):
        raise ValueError(f"layout must be one of ('auto', 'leaves', 'flat'), got {layout!r}.")
    if layout != "auto":
        return layout
    platform = mesh.devices.flat[0].platform
    return "flat" if platform == "cpu" and jax.process_count() > 1 else "leaves"


LossFn = Callable[..., Any]
BUFFER_MODES = ("broadcast", "mean", "local")


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
      accumulate_steps: micro-batches per step (DDP's ``no_sync``).
      accum_dtype: gradient accumulation dtype (None: float32 for 16-bit params).
      per_example: the loss function returns one loss per example, which lets
        batches be padded and masked.
      find_unused_parameters: leave parameters that do not reach the loss (and
        their optimizer state) untouched.
      buffers: how model state changed by the forward pass (``batch_stats``) is
        kept in step: ``'broadcast'`` from device 0, ``'mean'`` over the data
        axis, or ``'local'`` (each device its own).
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
    accumulate_steps: int = 1
    accum_dtype: Any = None
    per_example: bool = False
    find_unused_parameters: bool = False
    buffers: str = "broadcast"

    @property
    def num_replicas(self) -> int:
        """Devices along the data axis."""
        return int(self.mesh.shape[self.axis_name])

    @property
    def check_vma(self) -> bool:
        """Whether the step's shard_map tracks replication.

        Off for hooks whose collectives JAX cannot type, and on a 1-device axis,
        where fdp's reductions become identities.
        """
        return self.comm_hook.vma_safe and self.num_replicas > 1

    @property
    def compiler_options(self) -> dict[str, str] | None:
        """XLA options for the step: on CPU, the flat layout keeps DDP's buckets apart."""
        if self.layout == "flat" and self.mesh.devices.flat[0].platform == "cpu":
            return dict(_KEEP_BUCKETS)
        return None

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
    layout: StepLayout,
    comm_hook: CommHook | str | None,
    model_averager: PeriodicModelAverager | None,
    accumulate_steps: int = 1,
    accum_dtype: Any = None,
    per_example: bool = False,
    find_unused_parameters: bool = False,
    buffers: str = "broadcast",
) -> StepConfig:
    """Validates the step settings eagerly, so mistakes surface at construction."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    mesh = data_mesh(axis_name=axis_name) if mesh is None else mesh
    check_axis(mesh, axis_name)
    cap_limits(bucket_cap_mb, first_bucket_cap_mb)
    layout = resolve_layout(layout, mesh)
    hook = resolve(comm_hook)
    if model_averager is not None and not isinstance(model_averager, PeriodicModelAverager):
        raise TypeError(
            "model_averager must be a fdp.hooks.PeriodicModelAverager, got "
            f"{type(model_averager).__name__}."
        )
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int):
        raise TypeError(f"accumulate_steps must be an int >= 1, got {accumulate_steps!r}.")
    if accumulate_steps < 1:
        raise ValueError(f"accumulate_steps must be >= 1, got {accumulate_steps}.")
    if accum_dtype is not None and not jnp.issubdtype(jnp.dtype(accum_dtype), jnp.floating):
        raise ValueError(f"accum_dtype must be a floating dtype, got {accum_dtype!r}.")
    if buffers not in BUFFER_MODES:
        raise ValueError(f"buffers must be one of {BUFFER_MODES}, got {buffers!r}.")
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
        accumulate_steps,
        accum_dtype,
        per_example,
        find_unused_parameters,
        buffers,
    )


def _place(tree: Any, cfg: StepConfig) -> Any:
    sharding = NamedSharding(cfg.mesh, P(cfg.axis_name))
    if cfg.mesh.axis_types[cfg.mesh.axis_names.index(cfg.axis_name)] == AxisType.Explicit:
        return jax.reshard(tree, sharding)
    return jax.lax.with_sharding_constraint(tree, sharding)


def prepare_batch(batch: Any, mask: Any, cfg: StepConfig) -> tuple[Any, Any]:
    """Checks the global batch, pads it when allowed, and shards it over the data axis.

    A batch splits into one share per device and ``accumulate_steps`` micro-
    batches per share. With ``per_example=True`` a batch that does not split
    evenly is zero-padded and the padding masked (DataParallel's uneven
    scatter); otherwise it is an error.

    Returns:
      ``(batch, mask)``; ``mask`` is float32 ``[size]`` in per-example mode,
      else None.
    """
    split = cfg.num_replicas * cfg.accumulate_steps
    what = f"the {cfg.num_replicas} devices of axis {cfg.axis_name!r}" + (
        f" times {cfg.accumulate_steps} micro-batches" if cfg.accumulate_steps > 1 else ""
    )
    sizes, shapes = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(leaf)
        name = jax.tree_util.keystr(path) or "batch"
        if not shape:
            raise ValueError(f"batch leaf {name} is a scalar; every leaf needs a batch axis.")
        sizes[name], shapes[name] = shape[0], shape
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch leaves must share one leading batch size, got {sizes}.")
    name, size = next(iter(sizes.items()))
    if mask is not None and not cfg.per_example:
        raise ValueError(
            "mask= weighs examples and needs per_example=True (a loss_fn returning one "
            "loss per example)."
        )
    if not cfg.per_example:
        if size % split:
            raise ValueError(
                f"batch leaf {name} has shape {shapes[name]}; "
                f"its leading (batch) size must be divisible by {what} ({split}). Use a "
                f"multiple of {split}, or per_example=True to pad and mask an uneven batch."
            )
        return _place(batch, cfg), None
    if mask is None:
        mask = jnp.ones((size,), jnp.float32)
    elif jnp.shape(mask) != (size,):
        raise ValueError(f"mask must have shape ({size},) like the batch, got {jnp.shape(mask)}.")
    pad = -size % split
    if pad:
        # Padding repeats the last example, so the masked-out losses stay finite
        # (a zero input could give NaN, and NaN * 0 is NaN).
        batch = jax.tree.map(
            lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), mode="edge"), batch
        )
        mask = jnp.pad(jnp.asarray(mask, jnp.float32), (0, pad))
    return _place(batch, cfg), _place(jnp.asarray(mask, jnp.float32), cfg)


def call_loss(
    loss_fn: LossFn, cfg: StepConfig, has_buffers: bool, *args: Any
) -> tuple[jax.Array, Any, Any]:
    """Calls the user's loss and splits its result into ``(loss, aux, new_buffers)``.

    ``loss_fn`` returns ``loss``, ``(loss, aux)`` (``has_aux``), ``(loss,
    new_buffers)`` (with buffers) or ``(loss, (aux, new_buffers))`` (both).
    ``loss`` is a float scalar, or one value per example with ``per_example``.
    """
    out = loss_fn(*args)
    aux = buffers = None
    if cfg.has_aux or has_buffers:
        both = cfg.has_aux and has_buffers
        shape = (
            "(loss, (aux, new_batch_stats))"
            if both
            else ("(loss, aux)" if cfg.has_aux else "(loss, new_batch_stats)")
        )
        why = " and ".join(
            ([" has_aux=True"] if cfg.has_aux else [])
            + ([" the state has batch_stats"] if has_buffers else [])
        ).strip()
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"loss_fn must return {shape} since{' ' + why}; got {_describe(out)}.")
        loss, rest = out
        if both:
            if not (isinstance(rest, tuple) and len(rest) == 2):
                raise TypeError(
                    f"loss_fn must return {shape} since {why}; got (loss, {_describe(rest)})."
                )
            aux, buffers = rest
        elif cfg.has_aux:
            aux = rest
        else:
            buffers = rest
    else:
        loss = out
    batch_size = jnp.shape(jax.tree.leaves(args[1])[0])[0] if len(args) > 1 else None
    want = (batch_size,) if cfg.per_example else ()
    if jnp.shape(loss) != want or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        if cfg.per_example:
            raise TypeError(
                "loss_fn must return one float loss per example of the local batch "
                f"(per_example=True): float[{batch_size}]; got "
                f"{jnp.result_type(loss)}{list(jnp.shape(loss))}."
            )
        raise TypeError(
            "loss_fn must return the mean loss over the local batch as a float scalar; got "
            f"{jnp.result_type(loss)}{list(jnp.shape(loss))}. Reduce it with .mean()"
            + ("" if cfg.has_aux else ", or pass has_aux=True if it returns (loss, aux)")
            + (", or per_example=True for one loss per example." if jnp.ndim(loss) == 1 else ".")
        )
    return loss, aux, buffers


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array {jnp.result_type(x)}{list(jnp.shape(x))}"
    return type(x).__name__


def reduce_metrics(loss: jax.Array, aux: Any, axis_name: str) -> dict[str, Any]:
    """The loss (already reduced) and aux averaged over the data axis.

    Integer and bool aux leaves are summed: counts add up.
    """

    def reduce_leaf(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return mean_over(x, axis_name)
        return sum_over(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, axis_name)

    metrics = {"loss": loss}
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


def sync_buffers(buffers: Any, mode: str, axis_name: str) -> Any:
    """Buffers changed per device by the forward pass, made one again.

    ``'broadcast'``: device 0's values (DDP's ``broadcast_buffers=True``).
    ``'mean'``: floating buffers averaged over the data axis (integer ones from
    device 0). ``'local'``: left as they are, one per device.
    """
    if mode == "local" or axis_size(axis_name) == 1:
        return buffers

    def leaf(x: Any) -> Any:
        # Only values known to be replicated are left alone: without replication
        # tracking (check_vma=False) nothing is known, and everything is synced.
        if is_varying(x, axis_name) is False:
            return x
        if mode == "mean" and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return jax.lax.pmean(x, axis_name)
        return broadcast(x, 0, axis_name=axis_name)

    return jax.tree.map(leaf, buffers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PerDevice:
    """A pytree kept once per device: every leaf has a leading device axis.

    fdp wraps ``batch_stats`` in it with ``buffers='local'``. Device ``i``'s
    copy is ``jax.tree.map(lambda x: x[i], per_device.value)``.
    """

    value: Any
