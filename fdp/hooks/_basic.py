"""DDP's default hook, the no-op hook, and low-precision compression."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp.bucketing import BucketPlan
from fdp.hooks._contract import (
    CommHook,
    GradBucket,
    HookState,
    as_leaves,
    mean_all_reduce,
    stateless_init,
)


def _allreduce_reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
    if bucket.layout == "flat":
        return mean_all_reduce([bucket.buffer], bucket.axis_name)[0], state
    return mean_all_reduce(list(bucket.gradients), bucket.axis_name), state


def allreduce() -> CommHook:
    """DDP's ``allreduce_hook``: the mean over the data axis (the default hook).

    With the step's ``layout='flat'`` it all-reduces the packed bucket buffer,
    with ``'leaves'`` the gradients in place (one ``psum`` call per bucket).

    Example:
      >>> hook = allreduce()
      >>> hook.name, hook.replicated_output
      ('allreduce', True)
    """
    return CommHook("allreduce", stateless_init, _allreduce_reduce)


def _noop_reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
    return list(bucket.gradients), state


def noop() -> CommHook:
    """DDP's ``noop_hook``: no communication; each device applies its own gradient.

    For headroom analysis only: if training is less than 10% faster with it,
    the all-reduce is not the bottleneck. Replicas diverge, so the step keeps
    one train state per device.
    """
    return CommHook("noop", stateless_init, _noop_reduce, replicated_output=False)


def _low(dtype: Any) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def _compress(name: str, low: np.dtype) -> CommHook:
    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        values = [bucket.buffer] if bucket.layout == "flat" else list(bucket.gradients)
        # Cast down, divide in low precision, all-reduce in low precision, cast back.
        reduced = mean_all_reduce([v.astype(low) for v in values], bucket.axis_name)
        reduced = [r.astype(bucket.dtype) for r in reduced]
        return (reduced[0] if bucket.layout == "flat" else reduced), state

    return CommHook(name, stateless_init, reduce)


def fp16_compress() -> CommHook:
    """DDP's ``fp16_compress_hook``: all-reduce in float16, then cast back.

    Halves the bytes of float32 gradients on the wire. (On CPU, XLA promotes
    low-precision all-reduces to float32; the saving is real on GPU.)
    """
    return _compress("fp16_compress", _low(jnp.float16))


def bf16_compress() -> CommHook:
    """DDP's ``bf16_compress_hook``: all-reduce in bfloat16, then cast back."""
    return _compress("bf16_compress", _low(jnp.bfloat16))


def _low_plan(plan: BucketPlan, low: np.dtype) -> BucketPlan:
    buckets = tuple(dataclasses.replace(b, dtype=low) for b in plan.buckets)
    return dataclasses.replace(plan, buckets=buckets)


def _wrapper(prefix: str, low: np.dtype, hook: CommHook) -> CommHook:
    if not isinstance(hook, CommHook):
        raise TypeError(f"{prefix}_compress_wrapper needs a CommHook, got {type(hook).__name__}.")

    def init(params: Any, plan: BucketPlan) -> HookState:
        cast = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), low), params)
        return hook.init(cast, _low_plan(plan, low))

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        low_bucket = bucket.astype(low)
        result, state = hook.reduce(state, low_bucket)
        leaves = as_leaves(hook, low_bucket, result)
        return [leaf.astype(bucket.dtype) for leaf in leaves], state

    return hook._replace(name=f"{prefix}_compress_wrapper({hook.name})", init=init, reduce=reduce)


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """DDP's ``fp16_compress_wrapper``: runs ``hook`` on a float16 copy of the bucket.

    Args:
      hook: any comm hook; it sees float16 gradients and its result is cast
        back to the gradients' dtype.

    Returns:
      The wrapped hook.
    """
    return _wrapper("fp16", _low(jnp.float16), hook)


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """DDP's ``bf16_compress_wrapper``: runs ``hook`` on a bfloat16 copy of the bucket."""
    return _wrapper("bf16", _low(jnp.bfloat16), hook)
