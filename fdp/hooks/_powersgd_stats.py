"""PowerSGD's compression statistics, from the bucket plan (torch's ``compression_stats``).

torch counts, at every compressed iteration, the elements each bucket had and the
elements it sent; shapes are static in JAX, so the same numbers follow from the
bucket plan and the number of compressed iterations.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from fdp._validate import check_int
from fdp.bucketing import BucketPlan
from fdp.hooks._powersgd import PowerSGDConfig, matrix_shape


class PowerSGDCompressionStats(NamedTuple):
    """torch's ``PowerSGDState.compression_stats()`` tuple, field by field."""

    compress_rate: float
    total_numel_before_compression: int
    total_numel_after_compression: int


def powersgd_compression_stats(
    plan: BucketPlan,
    config: PowerSGDConfig | None = None,
    *,
    batched: bool = False,
    iterations: int = 1,
) -> PowerSGDCompressionStats:
    """What torch's ``PowerSGDState.compression_stats()`` reports for this layout.

    torch adds each compressed iteration's counts to running totals: per
    gradient, ``n * m`` elements before and ``(n + m) * r`` after if it is
    compressed (``r = min(n, m, matrix_approximation_rank)``), else ``n * m``
    both; for :func:`fdp.hooks.batched_powersgd` (``batched=True``), per
    bucket of ``size`` elements, ``size`` before and ``2 * side * rank`` after
    (``side = ceil(sqrt(size))``, ``rank`` not capped, as in torch). The rate is
    ``before / after``, or 0 before anything was compressed. The orientation
    does not change the counts (``n + m`` is symmetric).

    torch views a vector of ``n`` elements as an ``n x 1`` matrix, so with
    ``min_compression_rate < n / (n + 1)`` it "compresses" it into ``n + 1``
    elements (exact up to rounding); fdp's hook all-reduces vectors, so it
    then sends one element per vector less than these counts, torch's.

    Args:
      plan: the bucket plan of the step (``step.plan`` after its first call,
        or :func:`fdp.plan_buckets` with the step's caps).
      config: the hook's settings (default: torch's defaults). Only
        ``matrix_approximation_rank`` and ``min_compression_rate`` count.
      batched: the counts of ``batched_powersgd`` instead of ``powersgd``.
      iterations: compressed iterations so far, that is ``max(0, iter -
        start_powersgd_iter)`` with ``iter`` the hook state's counter.

    Returns:
      ``(compress_rate, total_numel_before_compression,
      total_numel_after_compression)``, as torch.

    Raises:
      ValueError: ``iterations`` is negative.

    Example:
      >>> import jax, jax.numpy as jnp, fdp
      >>> params = {"w": jnp.zeros((20, 24)), "b": jnp.zeros((24,))}
      >>> plan = fdp.plan_buckets(params)
      >>> powersgd_compression_stats(plan, PowerSGDConfig(matrix_approximation_rank=2))
      PowerSGDCompressionStats(compress_rate=4.5, total_numel_before_compression=504,
      total_numel_after_compression=112)
    """
    cfg = PowerSGDConfig() if config is None else config
    steps = check_int(iterations, "iterations", low=0)
    before = after = 0
    for bucket in plan.buckets:
        if batched:
            side = math.isqrt(bucket.size - 1) + 1 if bucket.size > 1 else 1
            before += bucket.size
            after += 2 * side * cfg.matrix_approximation_rank
            continue
        for shape in bucket.shapes:
            # torch views a vector as an (n, 1) matrix; a scalar is never compressed.
            n, m = matrix_shape(shape) or ((shape[0], 1) if shape else (1, 1))
            r = min(n, m, cfg.matrix_approximation_rank)
            before += n * m
            compressed = len(shape) > 0 and (n + m) * r * cfg.min_compression_rate < n * m
            after += (n + m) * r if compressed else n * m
    before, after = before * steps, after * steps
    return PowerSGDCompressionStats(before / after if after > 0 else 0.0, before, after)
