"""torch's SyncBatchNorm statistics as pure functions, and the step's example mask.

torch's ``SyncBatchNorm`` (``torch/nn/modules/_functions.py``) gathers every rank's
count, mean and variance, combines them into the mean and the *biased* variance of
the global batch (``batch_norm_gather_stats_with_counts``), normalises with the biased
variance, and moves the running variance towards the *unbiased* one,
``var * count / (count - 1)``, with ``running = (1 - momentum) * running + momentum
* batch``. Rows of padding (fdp's per-example masks, :func:`fdp.join`) are left out
of the count and the sums here, so the statistics are those of the real examples.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fdp.collectives._axis import AxisName

# A context variable, not an argument, on purpose: the step calls the user's loss, the
# loss calls the user's model, and the model calls fdp.SyncBatchNorm; no argument of the
# step's reaches the layer through code fdp does not own (a layer's own mask= argument
# is the explicit spelling, and wins). JAX's tracing does the rest: the value set here
# is a tracer of the step's trace, read only while that trace runs the loss.
_MASK: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "fdp_example_mask", default=None
)


def example_mask() -> jax.Array | None:
    """The weights of the examples of the micro-batch being traced by an fdp step.

    Inside a step built with ``per_example=True`` the loss function runs while
    this returns the micro-batch's ``[B]`` weights (0 for padding and for the
    rows of devices out of data); elsewhere it returns None (every row is real).
    """
    return _MASK.get()


@contextlib.contextmanager
def using_example_mask(mask: jax.Array | None) -> Iterator[None]:
    """Makes ``mask`` what :func:`example_mask` returns while the block is traced."""
    token = _MASK.set(mask)
    try:
        yield
    finally:
        _MASK.reset(token)


def bound_axis(axis_name: AxisName | None) -> AxisName | None:
    """``axis_name`` if it is bound here (inside the step's ``shard_map``), else None."""
    if axis_name is None:
        return None
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return None
    return axis_name


@dataclasses.dataclass(frozen=True)
class Moments:
    """Batch statistics over the (global) batch, per feature.

    Attributes:
      mean: the mean.
      var: the biased variance (what the batch is normalised with).
      unbiased_var: ``var * count / (count - 1)`` (what the running variance
        moves towards); equal to ``var`` when ``count <= 1``.
      count: the number of real values per feature (examples times the other
        reduced dimensions).
    """

    mean: jax.Array
    var: jax.Array
    unbiased_var: jax.Array
    count: jax.Array


def moments(
    x: jax.Array,
    reduction_axes: Sequence[int],
    *,
    axis_name: AxisName | None = None,
    mask: jax.Array | None = None,
) -> Moments:
    """Mean and variances of ``x`` over ``reduction_axes`` and every device of ``axis_name``.

    Two passes (the mean, then the squared deviations from it), each one
    all-reduce of a few floats per feature, so the variance does not lose
    precision as ``E[x**2] - E[x]**2`` does.

    Args:
      x: the input; its leading axis is the batch.
      reduction_axes: the axes reduced (all but the feature axes).
      axis_name: the data axis to reduce over as well, or None for local.
      mask: ``[x.shape[0]]`` weights of the examples (0 leaves one out), or None.

    Returns:
      :class:`Moments`, float32 (or ``x``'s dtype if wider).
    """
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(dtype)
    axes = tuple(a % x.ndim for a in reduction_axes)
    weights = jnp.ones((x.shape[0],), dtype) if mask is None else jnp.asarray(mask, dtype)
    weights = weights.reshape((x.shape[0],) + (1,) * (x.ndim - 1))
    rows_per_example = 1
    for a in axes:
        if a != 0:
            rows_per_example *= x.shape[a]
    count = jnp.sum(weights) * rows_per_example
    total = jnp.sum(weights * x, axis=axes)
    if axis_name is not None:
        count, total = jax.lax.psum((count, total), axis_name)
    mean = total / jnp.maximum(count, 1.0)
    deviations = jnp.sum(weights * jnp.square(x - jnp.expand_dims(mean, axes)), axis=axes)
    if axis_name is not None:
        deviations = jax.lax.psum(deviations, axis_name)
    var = deviations / jnp.maximum(count, 1.0)
    unbiased = deviations / jnp.maximum(count - 1.0, 1.0)
    return Moments(mean, var, jnp.where(count > 1, unbiased, var), count)


def update_running(running: jax.Array, batch: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Torch's running-statistic update: ``(1 - factor) * running + factor * batch``."""
    return ((1.0 - factor) * running + factor * batch).astype(running.dtype)


def normalize(
    x: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    epsilon: float,
    feature_axes: Sequence[int],
    dtype: Any,
) -> jax.Array:
    """``(x - mean) / sqrt(var + epsilon) * scale + bias`` with per-feature statistics."""
    shape = tuple(x.shape[i] if i in feature_axes else 1 for i in range(x.ndim))
    compute = jnp.promote_types(x.dtype, jnp.float32)
    y = (x.astype(compute) - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + epsilon)
    if scale is not None:
        y = y * scale.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y.astype(dtype)


def feature_axes_of(ndim: int, axis: int | Sequence[int]) -> tuple[int, ...]:
    """The feature axes, non-negative and sorted."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % ndim for a in axes))
