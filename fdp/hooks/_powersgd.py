"""PowerSGD (Vogels et al., NeurIPS 2019): low-rank gradient compression.

A functional transcription of torch's ``powerSGD_hook`` and ``batched_powerSGD_hook``
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``). For each bucket:

1. before ``start_powersgd_iter`` iterations: a plain mean all-reduce;
2. add the carried local error (error feedback) to the gradients;
3. gradients whose matrix ``M`` (n x m) would shrink by at least
   ``min_compression_rate`` at rank r (``(n + m) * r * rate < n * m``) are
   compressed; the rest (and every 1-D gradient) are mean all-reduced;
4. ``P = M Q`` (Q random, or last step's Q with warm start; orthogonalised);
   all-reduce P; orthogonalise P; ``Q = M^T P``; all-reduce Q and divide by the
   world size; the result is ``P Q^T``;
5. the new local error is the input minus the result.

fdp views a gradient of shape ``(..., k)`` as the matrix ``(prod(...), k)``: Flax keeps
output features last, so this is the matrix torch builds from its ``(out, ...)``
layout with ``view(shape[0], -1)``, transposed. ``orientation='torch'`` compresses the
transpose, ``(k, prod(...))``, torch's orientation: the same gradients are compressed
at the same rank, but P (orthogonalised) and Q change sides, so the results differ.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fdp.bucketing import Bucket, BucketPlan, pack
from fdp.collectives import vary
from fdp.hooks._contract import CommHook, GradBucket, HookState, mean_all_reduce


@dataclasses.dataclass(frozen=True)
class PowerSGDConfig:
    """PowerSGD's settings, named and defaulted as torch's ``PowerSGDState``.

    Attributes:
      matrix_approximation_rank: the rank r of the approximation.
      start_powersgd_iter: iterations of plain all-reduce before compressing.
      min_compression_rate: compress a matrix only if it shrinks at least this
        much: ``(n + m) * r * rate < n * m``.
      use_error_feedback: carry each device's compression error to its next step.
      warm_start: reuse last step's Q instead of drawing a new random one.
      orthogonalization_epsilon: added to column norms in Gram-Schmidt, to avoid
        dividing by zero for vanishing gradients.
      random_seed: seed of the random Q (the same on every device).
      orientation: ``'kernel'``: a gradient ``(..., k)`` as the matrix
        ``(prod(...), k)``; ``'torch'``: its transpose, as torch views the same
        weight stored ``(out, in...)``.
      batch_tensors_with_same_shape: compress the matrices of a bucket that
        have the same shape as one stacked batch (torch's option of that name):
        fewer, larger operations, the same results up to rounding.
    """

    matrix_approximation_rank: int = 1
    start_powersgd_iter: int = 1000
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0
    orientation: str = dataclasses.field(default="kernel", kw_only=True)
    batch_tensors_with_same_shape: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if self.orientation not in ("kernel", "torch"):
            raise ValueError(f"orientation must be 'kernel' or 'torch', got {self.orientation!r}.")
        rank = self.matrix_approximation_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"matrix_approximation_rank must be an integer >= 1, got {rank!r}.")
        start = self.start_powersgd_iter
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start_powersgd_iter must be an integer >= 0, got {start!r}.")
        if (self.use_error_feedback or self.warm_start) and start <= 1:
            raise ValueError(
                "start_powersgd_iter must be > 1 when use_error_feedback or warm_start is on "
                f"(torch's rule: PowerSGD starts after DDP's first iterations), got {start}."
            )
        if not self.min_compression_rate >= 0:
            raise ValueError(
                f"min_compression_rate must be >= 0, got {self.min_compression_rate!r}."
            )
        if not self.orthogonalization_epsilon >= 0:
            raise ValueError(
                f"orthogonalization_epsilon must be >= 0, got {self.orthogonalization_epsilon!r}."
            )


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The (n, m) matrix a gradient is compressed as, or None for 0-D and 1-D."""
    if len(shape) < 2:
        return None
    return math.prod(shape[:-1]), shape[-1]


def _as_matrix(shape: tuple[int, ...], orientation: str = "kernel") -> tuple[int, int]:
    """The matrix of a gradient that :func:`compressed_leaves` chose (at least 2-D)."""
    n, m = math.prod(shape[:-1]), shape[-1]
    return (m, n) if orientation == "torch" else (n, m)


def _to_matrix(grad: jax.Array, orientation: str) -> jax.Array:
    matrix = grad.reshape(_as_matrix(grad.shape))
    return matrix.T if orientation == "torch" else matrix


def _from_matrix(matrix: jax.Array, shape: tuple[int, ...], orientation: str) -> jax.Array:
    return (matrix.T if orientation == "torch" else matrix).reshape(shape)


def compressed_leaves(bucket: Bucket, cfg: PowerSGDConfig) -> tuple[int, ...]:
    """Positions (within the bucket) of the gradients PowerSGD compresses."""
    out = []
    for pos, shape in enumerate(bucket.shapes):
        nm = matrix_shape(shape)
        if nm is None:
            continue
        n, m = nm
        r = min(n, m, cfg.matrix_approximation_rank)
        if (n + m) * r * cfg.min_compression_rate < n * m:
            out.append(pos)
    return tuple(out)


def orthogonalize(matrix: jax.Array, epsilon: float = 0.0) -> jax.Array:
    """Orthonormal columns: Gram-Schmidt for rank <= 2 or low precision, else QR (as torch)."""
    rank = matrix.shape[1]
    if rank > 2 and matrix.dtype not in (jnp.float16, jnp.bfloat16):
        return jnp.linalg.qr(matrix)[0]
    cols = [matrix[:, i] for i in range(rank)]
    for i in range(rank):
        cols[i] = cols[i] / (jnp.linalg.norm(cols[i]) + epsilon)
        for j in range(i + 1, rank):
            cols[j] = cols[j] - jnp.sum(cols[i] * cols[j]) * cols[i]
    return jnp.stack(cols, axis=1)


def _power_step(
    matrices: list[jax.Array], qs: list[jax.Array], cfg: PowerSGDConfig, bucket: GradBucket
) -> tuple[list[jax.Array], list[jax.Array]]:
    """P and Q of one power iteration from orthogonalised ``qs`` (2-D, or stacked 3-D)."""
    axis, eps = bucket.axis_name, cfg.orthogonalization_epsilon
    if not matrices:
        return [], []

    def orth(x: jax.Array) -> jax.Array:
        if x.ndim == 2:
            return orthogonalize(x, eps)
        return jax.vmap(lambda y: orthogonalize(y, eps))(x)

    def t(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x, -1, -2)

    # P need not be divided by the world size: it is orthogonalised next.
    ps = jax.lax.psum([m @ q for m, q in zip(matrices, qs, strict=True)], axis)
    ps = [orth(p) for p in ps]
    qs = jax.lax.psum([t(m) @ p for m, p in zip(matrices, ps, strict=True)], axis)
    return ps, [q / bucket.num_replicas for q in qs]


def same_shape_groups(shapes: list[tuple[int, ...]]) -> list[list[int]]:
    """Positions of equal shapes, grouped in order of first appearance (torch's batching)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, shape in enumerate(shapes):
        groups.setdefault(tuple(shape), []).append(k)
    return list(groups.values())


def _power_step_by_shape(
    matrices: list[jax.Array], qs: list[jax.Array], cfg: PowerSGDConfig, bucket: GradBucket
) -> tuple[list[jax.Array], list[jax.Array]]:
    """:func:`_power_step` on the same-shaped matrices stacked, results unstacked."""
    groups = same_shape_groups([m.shape for m in matrices])
    stacked_ps, stacked_qs = _power_step(
        [jnp.stack([matrices[k] for k in g]) for g in groups],
        [jnp.stack([qs[k] for k in g]) for g in groups],
        cfg,
        bucket,
    )
    ps_at, qs_at = {}, {}
    for g, p_batch, q_batch in zip(groups, stacked_ps, stacked_qs, strict=True):
        for j, k in enumerate(g):
            ps_at[k], qs_at[k] = p_batch[j], q_batch[j]
    return [ps_at[k] for k in range(len(matrices))], [qs_at[k] for k in range(len(matrices))]


def _random_q(cfg: PowerSGDConfig, it: jax.Array, bucket: int, leaf: int, shape: tuple, dtype: Any):
    # Same on every device (seed, iteration and position are), new at every step.
    key = jax.random.fold_in(jax.random.key(cfg.random_seed), it)
    key = jax.random.fold_in(jax.random.fold_in(key, bucket), leaf)
    return jax.random.normal(key, shape, dtype)


def _leaves_mean(state: dict, bucket: GradBucket) -> tuple[list[jax.Array], dict]:
    # Before start_powerSGD_iter torch runs DDP's default all-reduce: divide, then sum.
    return mean_all_reduce(list(bucket.gradients), bucket.axis_name), state


def _flat_mean(state: dict, bucket: GradBucket) -> tuple[jax.Array, dict]:
    return mean_all_reduce([bucket.buffer], bucket.axis_name)[0], state


def _advance(state: dict, bucket: GradBucket) -> dict:
    if bucket.is_last:
        return {**state, "iter": state["iter"] + 1}
    return state


def _with_start(cfg: PowerSGDConfig, plain: Any, compress: Any) -> Any:
    """``plain`` (a mean all-reduce) before ``start_powersgd_iter``, ``compress`` after.

    Both have the signature of a hook's ``reduce`` and return the same structure.
    The iteration counter advances after the last bucket, as torch's
    ``maybe_increase_iter``.
    """

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        if cfg.start_powersgd_iter == 0:
            out, state = compress(state, bucket)
        else:
            out, state = jax.lax.cond(
                state["iter"] < cfg.start_powersgd_iter,
                lambda s: _typed(plain(s, bucket), bucket),
                lambda s: _typed(compress(s, bucket), bucket),
                state,
            )
        return out, _advance(state, bucket)

    return reduce


def _typed(result: tuple[Any, dict], bucket: GradBucket) -> tuple[Any, dict]:
    out, state = result
    return out, vary(state, bucket.axis_name)


def powersgd(
    matrix_approximation_rank: int = 1,
    start_powersgd_iter: int = 1000,
    min_compression_rate: float = 2.0,
    use_error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    random_seed: int = 0,
    *,
    orientation: str = "kernel",
    batch_tensors_with_same_shape: bool = False,
) -> CommHook:
    """DDP's ``powerSGD_hook``: layer-wise rank-r compression of each bucket.

    Args:
      matrix_approximation_rank: rank r.
      start_powersgd_iter: iterations of plain all-reduce first (> 1 with error
        feedback or warm start).
      min_compression_rate: compress a gradient only if ``(n+m)*r*rate < n*m``.
      use_error_feedback: carry the local compression error to the next step.
      warm_start: reuse last step's Q.
      orthogonalization_epsilon: epsilon of Gram-Schmidt.
      random_seed: seed of the initial Q.
      orientation: ``'kernel'`` (default): a Flax kernel ``(in..., out)`` as
        the matrix ``(prod(in...), out)``; ``'torch'``: ``(out, prod(in...))``,
        the matrix torch compresses for the same layer (its weight is
        ``(out, in...)``). The columns of torch's matrix are ordered
        ``(in, h, w)`` and fdp's ``(h, w, in)`` for convolutions, which is the
        same compression given the matching rows of Q.
      batch_tensors_with_same_shape: compress the same-shaped matrices of a
        bucket as one stacked batch (torch's option): fewer, larger matrix
        products and collectives; the results equal the unbatched ones up to
        rounding (each matrix keeps its own random Q).

    Returns:
      The hook. Its state holds the iteration count, each bucket's error buffer
      and each compressed gradient's Q.

    Raises:
      ValueError: a setting is out of range (for example rank < 1).

    Example:
      >>> hook = powersgd(matrix_approximation_rank=2, start_powersgd_iter=10)
      >>> hook.name
      'powersgd(rank=2, start=10)'
    """
    cfg = PowerSGDConfig(
        matrix_approximation_rank,
        start_powersgd_iter,
        min_compression_rate,
        use_error_feedback,
        warm_start,
        orthogonalization_epsilon,
        random_seed,
        orientation=orientation,
        batch_tensors_with_same_shape=batch_tensors_with_same_shape,
    )

    def init(params: Any, plan: BucketPlan) -> HookState:
        del params
        qs = []
        for bucket in plan.buckets:
            bucket_qs = []
            for pos in compressed_leaves(bucket, cfg):
                n, m = _as_matrix(bucket.shapes[pos], orientation)
                bucket_qs.append(
                    jnp.zeros((m, min(n, m, cfg.matrix_approximation_rank)), bucket.dtype)
                )
            qs.append(tuple(bucket_qs))
        errors = tuple(
            jnp.zeros((b.size,), b.dtype) if cfg.use_error_feedback else () for b in plan.buckets
        )
        return {"iter": jnp.zeros((), jnp.int32), "error": errors, "q": tuple(qs)}

    def compress(state: dict, bucket: GradBucket) -> tuple[list[jax.Array], dict]:
        axis, b = bucket.axis_name, bucket.index
        flat_in = bucket.buffer + state["error"][b] if cfg.use_error_feedback else None
        grads = list(bucket.gradients) if flat_in is None else bucket.unpack(flat_in)
        chosen = compressed_leaves(bucket.meta, cfg)
        plain = [i for i in range(len(grads)) if i not in chosen]
        out: list[Any] = [None] * len(grads)
        # The uncompressed tensors: summed, then divided (as torch).
        plain_means = mean_all_reduce([grads[i] for i in plain], axis, divide_first=False)
        for i, mean in zip(plain, plain_means, strict=True):
            out[i] = mean

        matrices = [_to_matrix(grads[i], orientation) for i in chosen]
        randomize = (not cfg.warm_start) or (state["iter"] == cfg.start_powersgd_iter)
        qs = []
        for k, (matrix, stored) in enumerate(zip(matrices, state["q"][b], strict=True)):
            fresh = _random_q(cfg, state["iter"], b, k, stored.shape, matrix.dtype)
            q = jnp.where(randomize, fresh, stored)
            qs.append(orthogonalize(q, cfg.orthogonalization_epsilon))
        step = _power_step_by_shape if cfg.batch_tensors_with_same_shape else _power_step
        ps, qs = step(matrices, qs, cfg, bucket)
        for i, p, q in zip(chosen, ps, qs, strict=True):
            out[i] = _from_matrix(p @ q.T, bucket.shapes[i], orientation)

        new = dict(state)
        if cfg.warm_start:
            new["q"] = (*state["q"][:b], tuple(qs), *state["q"][b + 1 :])
        if flat_in is not None:
            new_error = flat_in - pack(bucket.meta, out)
            new["error"] = (*state["error"][:b], new_error, *state["error"][b + 1 :])
        return out, new

    extra = ", orientation=torch" if orientation == "torch" else ""
    extra += ", batch_tensors_with_same_shape" if batch_tensors_with_same_shape else ""
    name = f"powersgd(rank={matrix_approximation_rank}, start={start_powersgd_iter}{extra})"
    return CommHook(name, init, _with_start(cfg, _leaves_mean, compress))


def batched_powersgd(
    matrix_approximation_rank: int = 1,
    start_powersgd_iter: int = 1000,
    use_error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    random_seed: int = 0,
) -> CommHook:
    """DDP's ``batched_powerSGD_hook``: the whole flat bucket as one square matrix.

    The buffer is zero-padded to ``side**2`` elements (``side = ceil(sqrt(len))``)
    and compressed as a ``side x side`` matrix at rank ``min(r, side)``. There is
    no minimum compression rate: every bucket is compressed.

    Args:
      matrix_approximation_rank: rank r.
      start_powersgd_iter: iterations of plain all-reduce first.
      use_error_feedback: carry the local compression error to the next step.
      warm_start: reuse last step's Q.
      orthogonalization_epsilon: epsilon of Gram-Schmidt.
      random_seed: seed of the initial Q.

    Returns:
      The hook.
    """
    cfg = PowerSGDConfig(
        matrix_approximation_rank,
        start_powersgd_iter,
        0.0,
        use_error_feedback,
        warm_start,
        orthogonalization_epsilon,
        random_seed,
    )

    def side_of(bucket: Bucket) -> int:
        return math.isqrt(bucket.size - 1) + 1 if bucket.size > 1 else 1

    def init(params: Any, plan: BucketPlan) -> HookState:
        del params
        qs, errors = [], []
        for bucket in plan.buckets:
            side = side_of(bucket)
            qs.append(jnp.zeros((side, min(side, cfg.matrix_approximation_rank)), bucket.dtype))
            errors.append(jnp.zeros((side * side,), bucket.dtype) if use_error_feedback else ())
        return {"iter": jnp.zeros((), jnp.int32), "error": tuple(errors), "q": tuple(qs)}

    def compress(state: dict, bucket: GradBucket) -> tuple[jax.Array, dict]:
        n_dev, axis, b = bucket.num_replicas, bucket.axis_name, bucket.index
        side = side_of(bucket.meta)
        flat = jnp.pad(bucket.buffer, (0, side * side - bucket.size))
        if cfg.use_error_feedback:
            flat = flat + state["error"][b]
        matrix = flat.reshape(side, side)
        randomize = (not cfg.warm_start) or (state["iter"] == cfg.start_powersgd_iter)
        stored = state["q"][b]
        fresh = _random_q(cfg, state["iter"], b, 0, stored.shape, matrix.dtype)
        q = orthogonalize(jnp.where(randomize, fresh, stored), cfg.orthogonalization_epsilon)
        p = orthogonalize(jax.lax.psum(matrix @ q, axis), cfg.orthogonalization_epsilon)
        q = jax.lax.psum(matrix.T @ p, axis) / n_dev
        approx = (p @ q.T).reshape(-1)
        new = dict(state)
        if cfg.warm_start:
            new["q"] = (*state["q"][:b], q, *state["q"][b + 1 :])
        if cfg.use_error_feedback:
            new["error"] = (*state["error"][:b], flat - approx, *state["error"][b + 1 :])
        return approx[: bucket.size], new

    name = f"batched_powersgd(rank={matrix_approximation_rank}, start={start_powersgd_iter})"
    return CommHook(name, init, _with_start(cfg, _flat_mean, compress))
