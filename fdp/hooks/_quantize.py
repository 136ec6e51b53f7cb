"""DDP's 8-bit quantization hooks: quantize, all-gather, dequantize and average.

Each device quantizes its bucket to uint8 with its own affine parameters (torch's
``MinMaxObserver``: the range always includes 0, ``scale = (max - min) / 255``,
``zero_point = -round(min / scale)``), all devices all-gather the uint8 values and
the parameters, and every device dequantizes each rank's values and averages them
in rank order. The error per element is at most half a quantization step of each
rank, averaged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fdp.hooks._contract import CommHook, GradBucket, HookState, stateless_init

_QMAX = 255.0
_EPS = float(jnp.finfo(jnp.float32).eps)


def qparams(x: jax.Array, axis: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Affine uint8 parameters ``(scale, zero_point)`` as torch's ``MinMaxObserver``.

    Args:
      x: float32 values.
      axis: reduce over this axis (per-channel) or over everything (``None``).

    Returns:
      ``scale`` and ``zero_point`` (float32, integral values in ``[0, 255]``).
    """
    lo = jnp.minimum(jnp.min(x, axis=axis), 0.0)
    hi = jnp.maximum(jnp.max(x, axis=axis), 0.0)
    scale = jnp.maximum((hi - lo) / _QMAX, _EPS)
    zero_point = jnp.clip(-jnp.round(lo / scale), 0.0, _QMAX)
    return scale, zero_point


def quantize(x: jax.Array, scale: jax.Array, zero_point: jax.Array) -> jax.Array:
    """``clamp(round(x / scale) + zero_point, 0, 255)`` as uint8 (round half to even)."""
    return jnp.clip(jnp.round(x / scale) + zero_point, 0.0, _QMAX).astype(jnp.uint8)


def dequantize(q: jax.Array, scale: jax.Array, zero_point: jax.Array) -> jax.Array:
    """``scale * (q - zero_point)`` as float32."""
    return scale * (q.astype(jnp.float32) - zero_point)


def _gathered_mean(
    q: jax.Array, scale: jax.Array, zero_point: jax.Array, bucket: GradBucket
) -> jax.Array:
    axis = bucket.axis_name
    params = jax.lax.all_gather(jnp.stack([scale, zero_point]), axis)
    all_q = jax.lax.all_gather(q, axis)
    total = dequantize(all_q[0], params[0, 0], params[0, 1])
    for r in range(1, bucket.num_replicas):  # rank order, as torch aggregates
        total = total + dequantize(all_q[r], params[r, 0], params[r, 1])
    return total / bucket.num_replicas


def _per_tensor(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
    x = bucket.buffer.astype(jnp.float32)
    scale, zero_point = qparams(x)
    mean = _gathered_mean(quantize(x, scale, zero_point), scale, zero_point, bucket)
    return mean.astype(bucket.dtype), state


def quantize_per_tensor() -> CommHook:
    """DDP's ``quantization_pertensor_hook``: one scale for the whole bucket buffer.

    Sends 1 byte per gradient element (an all-gather of uint8) plus 8 bytes of
    parameters, instead of 4 bytes per element for a float32 all-reduce.
    """
    return CommHook("quantize_per_tensor", stateless_init, _per_tensor, vma_safe=False)


def quantize_per_channel(bucket_size: int = 512) -> CommHook:
    """DDP's ``quantization_perchannel_hook``: one scale per row of ``bucket_size``.

    The flat buffer is zero-padded by ``bucket_size - len % bucket_size`` (a full
    row when it divides evenly, as torch does) and viewed as rows of
    ``bucket_size`` elements; each row gets its own scale and zero point.

    Args:
      bucket_size: elements per quantization row (torch's default 512).

    Raises:
      ValueError: ``bucket_size`` is not a positive integer.
    """
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive integer, got {bucket_size!r}.")

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        x = bucket.buffer.astype(jnp.float32)
        pad = bucket_size - x.shape[0] % bucket_size
        rows = jnp.pad(x, (0, pad)).reshape(-1, bucket_size)
        scale, zero_point = qparams(rows, axis=1)
        q = quantize(rows, scale[:, None], zero_point[:, None])
        mean = _gathered_mean(q, scale[:, None], zero_point[:, None], bucket)
        return mean.reshape(-1)[: x.shape[0]].astype(bucket.dtype), state

    return CommHook(
        f"quantize_per_channel(bucket_size={bucket_size})", stateless_init, reduce, vma_safe=False
    )
