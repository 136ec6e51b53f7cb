"""Compressed reductions that send fewer bytes: all-to-all, sum in f32, all-gather.

torch's 8-bit hooks (:func:`fdp.hooks.quantize_per_tensor`) all-gather every
device's whole quantized bucket, so each device receives ``N - 1`` buckets: on 8
devices as many bytes as a float32 all-reduce. A reduce-scatter shaped exchange
does not grow with ``N`` (the "Scatter-Reduce" of 1-bit Adam, or ZeRO++'s
quantized gradients):

1. each device cuts its bucket into ``N`` chunks and encodes them (int8 with one
   float32 scale per block of elements, or bfloat16/float16);
2. an all-to-all hands chunk ``j`` of every device to device ``j``;
3. device ``j`` decodes the ``N`` copies of its chunk and sums them in float32;
4. the reduced chunk is encoded again and all-gathered, and every device
   decodes the whole bucket.

Per device that sends ``2 (N-1)/N`` encoded buckets, as a ring all-reduce does
in float32: a quarter of its bytes for int8 (plus the scales), half for 16 bits.
Both encodings lose precision; with ``error_feedback`` each device keeps what
its encodings lost and adds it to its next bucket (the owner of a chunk also
keeps what the second encoding lost), so the error does not accumulate over
steps.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp._validate import check_int
from fdp.bucketing import BucketPlan
from fdp.collectives import axis_size
from fdp.hooks._contract import CommHook, GradBucket, HookState

ENCODINGS = ("int8", "bfloat16", "float16")
_INT8_MAX = 127.0


def _layout(size: int, n: int, encoding: str, block_size: int) -> tuple[int, int]:
    """``(chunk, block)``: elements per device's chunk, and per int8 scale.

    A chunk holds a whole number of equal blocks of at most ``block_size``
    elements, so a bucket is padded by less than one block per device.
    """
    per = max(1, math.ceil(size / n))
    if encoding != "int8":
        return per, per
    blocks = math.ceil(per / block_size)
    block = math.ceil(per / blocks)
    return blocks * block, block


def _encode(x: jax.Array, encoding: str, block: int) -> tuple[jax.Array, jax.Array | None]:
    """``x`` (``[..., chunk]`` float32) encoded, with its int8 scales per block."""
    if encoding != "int8":
        return x.astype(encoding), None
    blocks = x.reshape(*x.shape[:-1], -1, block)
    scale = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / _INT8_MAX
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(blocks / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q.reshape(x.shape), scale[..., 0]


def _decode(q: jax.Array, scale: jax.Array | None, block: int) -> jax.Array:
    if scale is None:
        return q.astype(jnp.float32)
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, block)
    return (blocks * scale[..., None]).reshape(q.shape)


def _gather(x: jax.Array | None, axis_name: Any) -> jax.Array | None:
    # 'invarying': every device ends with the same values, so JAX types them replicated.
    return None if x is None else jax.lax.all_gather(x, axis_name, to="invarying")


def compressed_mean(
    x: jax.Array,
    axis_name: Any,
    *,
    encoding: str = "int8",
    block_size: int = 256,
    residual: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The mean of a flat buffer over ``axis_name``, exchanged encoded (see module doc).

    Args:
      x: this device's 1-D buffer (any float dtype; computed in float32).
      axis_name: the axis (or tuple of axes) to average over.
      encoding: ``'int8'``, ``'bfloat16'`` or ``'float16'``.
      block_size: elements per int8 scale.
      residual: the error-feedback residual (float32, like ``x``), or None.

    Returns:
      ``(mean, new_residual)``: the mean as float32, the same on every device,
      and the new residual (None without one).
    """
    n = axis_size(axis_name)
    size = x.shape[0]
    chunk, block = _layout(size, n, encoding, block_size)
    # Divide first, as torch's fp16 hook does, so a 16-bit encoding cannot overflow.
    y = x.astype(jnp.float32) / n
    if residual is not None:
        y = y + residual
    rows = jnp.pad(y, (0, n * chunk - size)).reshape(n, chunk)
    q, scale = _encode(rows, encoding, block)
    sent = _decode(q, scale, block)
    # Row j of the result is device j's encoding of my chunk.
    q = jax.lax.all_to_all(q, axis_name, 0, 0)
    scale = None if scale is None else jax.lax.all_to_all(scale, axis_name, 0, 0)
    mine = jnp.sum(_decode(q, scale, block), axis=0)
    q2, scale2 = _encode(mine, encoding, block)
    kept = _decode(q2, scale2, block)
    everyone = _decode(_gather(q2, axis_name), _gather(scale2, axis_name), block)  # type: ignore[arg-type]
    mean = everyone.reshape(-1)[:size]
    if residual is None:
        return mean, None
    # What my encodings lost: of my whole bucket, and of the chunk I own once reduced
    # (added to my share next step, it reaches everyone's mean then).
    lost = rows - sent
    me = jax.lax.axis_index(axis_name)
    lost = lost.at[me].add(mine - kept)
    return mean, lost.reshape(-1)[:size]


@functools.cache
def compressed_allreduce(
    encoding: str = "int8", *, block_size: int = 256, error_feedback: bool = False
) -> CommHook:
    """The mean of each bucket, exchanged encoded: all-to-all, sum in f32, all-gather.

    Sends about a quarter of a float32 all-reduce's bytes with int8 (one
    float32 scale per ``block_size`` elements adds ``4 / block_size``), half
    with bfloat16/float16, whatever the number of devices; see
    docs/comm-hooks.md for when to choose it over torch's all-gather hooks.
    Sums are in float32, so 16-bit encodings lose only the encoding's rounding,
    not a rounding per addition.

    Args:
      encoding: ``'int8'``, ``'bfloat16'`` or ``'float16'``.
      block_size: elements per int8 scale (ignored for 16-bit encodings).
      error_feedback: keep each device's encoding error and add it to its next
        bucket (one float32 copy of the gradients per device, in the hook state).

    Returns:
      The hook (built once per setting, so equal settings give an equal hook).

    Raises:
      ValueError: an unknown encoding, or a block size below 1.

    Example:
      >>> compressed_allreduce("int8").name
      'compressed_allreduce(int8)'
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}.")
    block_size = check_int(block_size, "block_size", low=1)

    def init(params: Any, plan: BucketPlan) -> HookState:
        del params
        if not error_feedback:
            return ()
        return tuple(jnp.zeros((b.size,), jnp.float32) for b in plan.buckets)

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        residual = state[bucket.index] if error_feedback else None
        mean, residual = compressed_mean(
            bucket.buffer,
            bucket.axis_name,
            encoding=encoding,
            block_size=block_size,
            residual=residual,
        )
        if error_feedback:
            state = tuple(residual if i == bucket.index else s for i, s in enumerate(state))
        return mean.astype(bucket.dtype), state

    settings = [encoding]
    if encoding == "int8" and block_size != 256:
        settings.append(f"block_size={block_size}")
    if error_feedback:
        settings.append("error_feedback=True")
    return CommHook(f"compressed_allreduce({', '.join(settings)})", init, reduce)


def wire_ratio(encoding: str, size: int, n: int, block_size: int = 256) -> float:
    """Bytes each device sends for :func:`compressed_mean`, over a float32 all-reduce's.

    Both are counted as ring algorithms: the all-reduce sends ``2 (n-1)/n`` of
    the buffer, the all-to-all and the all-gather ``(n-1)/n`` of theirs.

    Example:
      >>> round(wire_ratio("int8", 1 << 20, 8), 4)
      0.2539
      >>> wire_ratio("bfloat16", 1 << 20, 8)
      0.5
    """
    chunk, block = _layout(size, n, encoding, block_size)
    per_elem = np.dtype(jnp.dtype(encoding)).itemsize + (4 / block if encoding == "int8" else 0)
    return (n * chunk * per_elem) / (size * 4)
