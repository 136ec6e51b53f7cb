"""DDP's default hook, the no-op hook, and low-precision compression."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp.bucketing import BucketPlan
from fdp.hooks._contract import (
    CommHook,
    GradBucket,
    HookState,
    ReduceFn,
    as_leaves,
    as_shards,
    bucket_key,
    grouped_mean_all_reduce,
    mean_all_reduce,
    mean_reduce_scatter,
    reduce_scatter_of,
    stateless_init,
    with_reduce_scatter,
)


def _allreduce_reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
    if bucket.grouped:  # one merged all-reduce, no packing (a model split's on its blocks)
        return grouped_mean_all_reduce(
            bucket.gradients, bucket.axis_name, bucket_key(bucket.index)
        ), state
    if bucket.layout == "flat":
        return mean_all_reduce([bucket.buffer], bucket.axis_name)[0], state
    return mean_all_reduce(list(bucket.gradients), bucket.axis_name), state


@functools.cache
def _scatter(low: np.dtype | None) -> ReduceFn:
    """The mean reduce-scatter (ZeRO stages 2 and 3), optionally in ``low`` precision.

    Memoised, so hooks built twice compare equal (a step config is a jit key).
    """

    def reduce_scatter(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        dims = bucket.shard_dims or (None,) * len(bucket.shapes)
        values = list(bucket.gradients)
        if low is not None:
            values = [v.astype(low) for v in values]
        shares = mean_reduce_scatter(
            values,
            dims,
            bucket.axis_name,
            flat=bucket.layout == "flat",
            layout=bucket.meta.layout,
        )
        return [s.astype(bucket.dtype) for s in shares], state

    return reduce_scatter


def allreduce() -> CommHook:
    """DDP's ``allreduce_hook``: the mean over the data axis (the default hook).

    With the step's ``layout='flat'`` it all-reduces the packed bucket buffer,
    with ``'leaves'`` the gradients in place (one ``psum`` call per bucket). A
    flat bucket marked ``grouped`` (fdp's GPU steps) is all-reduced in place
    too, each gradient's all-reduce tagged with the bucket's key, so that XLA
    merges them into one collective without the packing copy.
    Under ZeRO stages 2 and 3 it reduce-scatters each bucket instead (one
    reduce-scatter of a shard-major buffer per bucket with ``'flat'``).

    Example:
      >>> hook = allreduce()
      >>> hook.name, hook.replicated_output
      ('allreduce', True)
    """
    hook = CommHook("allreduce", stateless_init, _allreduce_reduce)
    return with_reduce_scatter(hook, _scatter(None))


def _default_reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
    return _allreduce_reduce(state, bucket)


def default_allreduce() -> CommHook:
    """What ``comm_hook=None`` means: :func:`allreduce`, marked as left to fdp.

    It reduces exactly as :func:`allreduce` does. The mark lets a step bind it,
    on CPU processes of one host, to the same mean summed through shared
    memory (:func:`fdp.backends.cpu.shm_allreduce`; docs/performance.md); a hook
    passed by name or object is run as given.

    Example:
      >>> default_allreduce().name, is_default(default_allreduce()), is_default(allreduce())
      ('allreduce', True, False)
    """
    hook = CommHook("allreduce", stateless_init, _default_reduce)
    return with_reduce_scatter(hook, _scatter(None))


def is_default(hook: CommHook) -> bool:
    """Whether ``hook`` is :func:`default_allreduce` (the step chose no hook)."""
    return hook.reduce is _default_reduce


def is_mean_all_reduce(hook: CommHook) -> bool:
    """Whether ``hook`` reduces as :func:`allreduce` does (it, or :func:`default_allreduce`)."""
    return hook.reduce in (_allreduce_reduce, _default_reduce)


def is_mean_reduce_scatter(scatter: ReduceFn | None) -> bool:
    """Whether ``scatter`` is the plain mean reduce-scatter (of :func:`allreduce`)."""
    return scatter is _scatter(None)


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

    return with_reduce_scatter(CommHook(name, stateless_init, reduce), _scatter(low))


def fp16_compress() -> CommHook:
    """DDP's ``fp16_compress_hook``: all-reduce in float16, then cast back.

    Halves the bytes of float32 gradients on the wire. (On CPU, XLA promotes
    low-precision all-reduces to float32; the saving is real on GPU.) Under ZeRO
    stages 2 and 3 it reduce-scatters in float16 the same way.
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

    inner_scatter = reduce_scatter_of(hook)

    def reduce_scatter(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        assert inner_scatter is not None  # only handed out when the inner hook has one
        low_bucket = bucket.astype(low)
        result, state = inner_scatter(state, low_bucket)
        shares = as_shards(hook, low_bucket, result)
        return [share.astype(bucket.dtype) for share in shares], state

    name = f"{prefix}_compress_wrapper({hook.name})"
    wrapped = hook._replace(name=name, init=init, reduce=reduce)
    return wrapped if inner_scatter is None else with_reduce_scatter(wrapped, reduce_scatter)


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
