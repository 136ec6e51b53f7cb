"""Arrays of JAX's extended dtypes (typed PRNG keys) as their raw data, and back.

``jax.random.key(0)`` has dtype ``key<fry>``: numpy, msgpack and the XLA
reductions know no such type, so wherever fdp moves an array to the host or
between processes it moves the key's raw data (``jax.random.key_data``: uint32
words in a trailing dimension) and wraps it again with the same implementation.
A legacy ``jax.random.PRNGKey`` is a plain uint32 array and passes unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_extended(x: Any) -> bool:
    """Whether ``x`` (an array, a ``ShapeDtypeStruct`` or a dtype) has an extended dtype."""
    dtype = getattr(x, "dtype", x)
    try:
        return bool(jnp.issubdtype(dtype, jax.dtypes.extended))
    except TypeError:  # not a dtype at all (None, a Python object)
        return False


def key_impl(x: Any) -> str | Any:
    """The PRNG implementation of a typed key array (a name for JAX's built-in ones).

    Raises:
      TypeError: ``x`` has an extended dtype that is not a PRNG key.
    """
    if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"fdp moves arrays of extended dtype {x.dtype} only if they are PRNG keys "
            "(jax.random.key); got another extended dtype. Convert it to a standard "
            "dtype before passing it to fdp."
        )
    return jax.random.key_impl(x)


def to_raw(x: Any) -> Any:
    """``x``'s raw data if it is a typed key array (traced or not), else ``x`` unchanged.

    Example:
      >>> import jax
      >>> to_raw(jax.random.key(0)).dtype, to_raw(jax.random.key(0)).shape
      (dtype('uint32'), (2,))
    """
    if not is_extended(x):
        return x
    key_impl(x)  # raises for an extended dtype that is not a key
    return jax.random.key_data(x)


def from_raw(raw: Any, impl: Any) -> Any:
    """The typed key array whose raw data is ``raw``; ``impl=None`` returns ``raw``.

    ``impl`` is :func:`key_impl` of the original array, so the round trip
    ``from_raw(to_raw(x), key_impl(x))`` keeps dtype, implementation and bits.
    """
    return raw if impl is None else jax.random.wrap_key_data(raw, impl=impl)


def impl_of(x: Any) -> Any:
    """:func:`key_impl` of a typed key array, or None for any other leaf."""
    return key_impl(x) if is_extended(x) else None


def to_numpy(x: Any) -> np.ndarray:
    """``x`` as a numpy array; a typed key array as its raw data."""
    return np.asarray(to_raw(x))
