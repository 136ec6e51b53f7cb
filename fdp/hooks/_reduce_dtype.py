"""Reducing gradients in another dtype (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``)."""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from fdp.hooks._compressed import compressed_mean
from fdp.hooks._contract import CommHook, GradBucket, HookState, as_leaves


@functools.cache
def reduce_in(hook: CommHook, dtype: np.dtype) -> CommHook:
    """``hook`` (a stateless mean reduction) run with each bucket in ``dtype``.

    A bucket whose dtype is narrower than ``dtype`` (bfloat16 gradients,
    ``dtype=float32``) is cast up, reduced by ``hook`` and cast back, so the
    sum accumulates in ``dtype`` and rounds to the gradient's dtype once. A
    bucket wider than ``dtype`` (float32 gradients, ``dtype=bfloat16``) is sent
    in ``dtype`` and summed in float32 (:func:`fdp.hooks.compressed_allreduce`'s
    exchange), so only the encoding rounds, not every partial sum. Buckets
    already in ``dtype`` go to ``hook`` as they are.

    Args:
      hook: a stateless hook computing the mean (the default all-reduce, or
        :func:`fdp.hooks.hierarchical` of it).
      dtype: the reduction dtype.

    Returns:
      The hook.
    """
    dtype = np.dtype(dtype)

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        if bucket.dtype == dtype:
            return hook.reduce(state, bucket)
        if dtype.itemsize > bucket.dtype.itemsize:
            wide = bucket.astype(dtype)
            result, state = hook.reduce(state, wide)
            return [x.astype(bucket.dtype) for x in as_leaves(hook, wide, result)], state
        if hook.name != "allreduce":
            raise ValueError(
                f"reduce_dtype={dtype.name} is narrower than bucket {bucket.index}'s "
                f"{bucket.dtype.name}, which sends it in {dtype.name} and sums in float32 over "
                f"the whole data axis; with {hook.name!r} use outer_hook="
                f"fdp.hooks.compressed_allreduce({dtype.name!r}) instead."
            )
        encoding = str(jnp.dtype(dtype))
        mean, _ = compressed_mean(bucket.buffer, bucket.axis_name, encoding=encoding)
        return mean.astype(bucket.dtype), state

    # No reduce-scatter form: ZeRO stages 2 and 3 refuse reduce_dtype (StepConfig).
    name = f"{hook.name}(reduce_dtype={dtype.name})"
    return hook._replace(name=name, reduce=reduce, reduce_scatter=None)
