"""Per-device random keys: the one place a key is folded with the device's index.

DDP's ranks each seed their own dropout masks; under ``shard_map`` every device
sees the same key, so each folds in its index on the data axis. The Linen step
(its ``rng``), the NNX step (the model's ``nnx.Rngs`` keys), ``fdp.ddp`` (key
arguments and NNX streams) and ``grad_accumulator`` all call :func:`per_device`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fdp.collectives._axis import AxisName


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def per_device(keys: Any, axis_name: AxisName, *, typed_only: bool = False) -> Any:
    """``keys`` with every key folded with this device's index on ``axis_name``.

    Call it inside ``shard_map``. With ``typed_only``, leaves that are not typed
    keys (other arguments of a step) pass through; otherwise every leaf is a
    key (typed, or a raw ``uint32[2]`` one).

    Example:
      >>> import jax, numpy as np
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> f = jax.shard_map(lambda k: jax.random.key_data(per_device(k, "data"))[None],
      ...                   mesh=mesh, in_specs=jax.P(), out_specs=jax.P("data"))
      >>> data = np.asarray(f(jax.random.key(0)))
      >>> bool((data[0] != data[1]).any())
      True
    """
    if keys is None:
        return None
    index = jax.lax.axis_index(axis_name)

    def fold(x: Any) -> Any:
        return jax.random.fold_in(x, index) if not typed_only or is_key(x) else x

    return jax.tree.map(fold, keys)
