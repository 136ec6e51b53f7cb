"""Mixed-precision parameters: gathered and computed in a low dtype, kept and updated in f32.

``fdp.Sharding(param_dtype=jnp.bfloat16)`` is FSDP2's
``MixedPrecisionPolicy(param_dtype=...)``: the master parameters and the optimizer
state stay in their own dtype (float32) and sharded as the stage says, the loss
sees its floating parameters cast to ``param_dtype``, and at stage 3 the
all-gathers move ``param_dtype`` (half the bytes for bfloat16). The gradient
flows back through the cast, so it reaches the master parameters in their dtype
and is reduced as the :class:`fdp.Reduction` says (its ``reduce_dtype``), as
without ``param_dtype``:

- stages 0-2 and stage 3 without per-use gathers: the loss casts the parameters
  (stage 3: the shards are cast, then gathered, so the gather is in
  ``param_dtype``); the local gradients are cast back to the master dtype before
  the bucketed reduction (:func:`master_gradients`).
- stage 3 with per-use gathers: each gather is :func:`low_gather`: the shard is
  cast and gathered in ``param_dtype``, and its backward pass reduce-scatters the
  gradient in the master dtype.

The numbers equal a plain-JAX step whose loss reads ``param.astype(bfloat16)``
of float32 parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fdp.step.grads._local_grads import Objective


def cast_floats(tree: Any, dtype: Any) -> Any:
    """``tree`` with its floating leaves cast to ``dtype`` (other leaves as they are)."""

    def cast(x: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.result_type(x) != dtype:
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def compute_in(objective: Objective, dtype: Any) -> Objective:
    """``objective`` reading its parameters cast to ``dtype`` (the gradient flows back)."""

    def run(params: Any, micro: Any, carry: Any, key: Any) -> tuple[Any, Any, Any]:
        return objective(cast_floats(params, dtype), micro, carry, key)

    return run


def master_gradients(grads: Any, params: Any) -> Any:
    """``grads`` (of parameters cast for compute) cast back to the master ``params``' dtypes."""
    return jax.tree.map(lambda g, p: g.astype(p.dtype) if g.dtype != p.dtype else g, grads, params)


def low_gather(gather: Callable[[Any], Any], dtype: Any) -> Callable[[Any], Any]:
    """``gather`` (an all-gather of a shard) moving ``dtype``, its gradient the master's.

    The shard is cast to ``dtype`` and gathered; the result is cast back to the
    shard's dtype, which the loss's own cast to ``dtype`` then undoes exactly
    (XLA drops the pair). The backward pass is the plain gather's transpose, a
    reduce-scatter in the shard's (master) dtype, so ``param_dtype`` changes the
    gather's bytes, not the reduction's.
    """

    def impl(shard: Any) -> Any:
        return gather(shard.astype(dtype)).astype(shard.dtype)

    run = jax.custom_vjp(impl)

    def fwd(shard: Any) -> tuple[Any, Any]:
        return impl(shard), shard

    def bwd(shard: Any, ct: Any) -> tuple[Any]:
        _, vjp = jax.vjp(gather, shard)
        return vjp(ct.astype(shard.dtype))

    run.defvjp(fwd, bwd)
    return run
