"""Dense products of n-D activations computed as 2-D matrix products (for XLA:CPU).

A dense layer applied to ``[batch, seq, features]`` activations (``x @ w``,
``flax.linen.Dense``, ``DenseGeneral`` in attention, ``flax.nnx.Linear``) is
one ``dot_general`` whose operands have several free dimensions. Its weight
gradient contracts two of them, and XLA:CPU (jaxlib 0.10) canonicalizes such a
product by transposing the output gradient in memory before the matrix
product. Measured on one core of this project's 2-core x86_64 machine: the
gradient of ``tanh(x @ w)`` for ``x: f32[16, 64, 256]``, ``w: f32[256, 1024]``
took 18.3 ms, against 10.7 ms with ``x`` reshaped to ``[1024, 256]`` first.
PyTorch's ``nn.Linear`` folds the leading dimensions itself.

:func:`fold_leading_dims` does the same to a function's jaxpr: each
``dot_general`` without batch dimensions that contracts the trailing
dimensions of its left operand with the leading (or trailing) dimensions of its
right operand, in order, is computed on both operands reshaped to 2-D, and the
product reshaped back. The values are the same products; only the weight
gradient's summation order can differ (float rounding). Everything else is
bound as traced; nested ``jax.jit`` calls without shardings of their own are
inlined, other sub-programs (``checkpoint``, ``scan``) are left as written. The
step applies it on CPU meshes (``StepConfig.fold_dots``); other platforms were
not measured.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = lambda x, w: jnp.tanh(x @ w).sum()
  >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5)) / 4
  >>> bool(jnp.allclose(jax.grad(fold_leading_dims(f), 1)(x, w), jax.grad(f, 1)(x, w)))
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex

from fdp import _compat


def _folded_dot(eqn: Any, lhs: Any, rhs: Any) -> Any | None:
    """``lhs . rhs`` as one 2-D matrix product, or None if the product is not a dense layer's.

    A dense layer's product has no batch dimensions, contracts the trailing
    dimensions of ``lhs`` (the activation) in order, and the leading or trailing
    dimensions of ``rhs`` (the kernel: ``[in..., out...]`` as in Flax, or
    ``[out..., in...]`` as in torch) in order. Folded: ``lhs`` to ``[rows, in]``,
    ``rhs`` to ``[in, out]`` or ``[out, in]``.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs_shape, rhs_shape = jax.numpy.shape(lhs), jax.numpy.shape(rhs)
    c = len(lhs_contract)
    if lhs_batch or rhs_batch or c == 0 or eqn.params.get("out_sharding") is not None:
        return None
    if tuple(lhs_contract) != tuple(range(len(lhs_shape) - c, len(lhs_shape))):
        return None
    leading = tuple(rhs_contract) == tuple(range(c))
    if not leading and tuple(rhs_contract) != tuple(range(len(rhs_shape) - c, len(rhs_shape))):
        return None
    rows, inner = lhs_shape[: len(lhs_shape) - c], lhs_shape[len(lhs_shape) - c :]
    cols = rhs_shape[c:] if leading else rhs_shape[: len(rhs_shape) - c]
    if len(rows) <= 1 and c == 1 and len(cols) <= 1:
        return None  # already a matrix product
    if len(rows) == 0 or len(cols) == 0:
        return None  # a matrix-vector product: nothing to gain
    k = _prod(inner)
    flat_rhs = (k, _prod(cols)) if leading else (_prod(cols), k)
    out = jax.lax.dot_general(
        jax.lax.reshape(lhs, (_prod(rows), k)),
        jax.lax.reshape(rhs, flat_rhs),
        (((1,), (0 if leading else 1,)), ((), ())),
        precision=eqn.params.get("precision"),
        preferred_element_type=eqn.params.get("preferred_element_type"),
    )
    return jax.lax.reshape(out, (*rows, *cols))


def _prod(dims: Sequence[int]) -> int:
    return functools.reduce(lambda a, b: a * b, dims, 1)


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        out = _folded_dot(eqn, *invals) if eqn.primitive.name == "dot_general" else None
        if out is not None:
            outs = [out]
        else:
            inner = _compat.inlinable_call(eqn)
            if inner is not None:
                outs = _eval(inner.jaxpr, inner.consts, invals)
            else:
                outs = _compat.bind_equation(eqn, invals)
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def fold_leading_dims(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` with its dense products of n-D operands computed as 2-D products.

    Args:
      fun: a function of arrays (pytrees of arrays) to arrays, traceable by JAX.

    Returns:
      A function with ``fun``'s signature and values.
    """

    @functools.wraps(fun)
    def folded(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return folded
