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
inlined.

What is not folded, and stays exactly as written:

- a product whose operands are sharded over explicit mesh axes (the sequence
  dimension of ``float32[2,4@s,4]``): merging a sharded dimension into the rows
  is a reshape JAX refuses without an output sharding, and choosing one would
  move data; such products are left alone, and the reason logged;
- products inside other sub-programs (``scan``, ``remat``/``checkpoint``,
  ``cond``, ``custom_vjp``), which are bound as traced.

Part of fdp's CPU backend (:mod:`fdp.backends.cpu`). The step applies it on CPU
meshes (``StepConfig.fold_dots``: ``None`` is the backend's choice), and only to a
loss with something to fold: its plan counts the products from the loss's jaxpr
(:func:`count_in_jaxpr`, ``StepPlan.folds``, shown in the INFO log), so a model
whose dense layers all sit in a ``scan`` is traced as written. Other platforms
were not measured. At each trace it logs (logger ``"fdp"``, DEBUG; INFO when
products were left alone for their sharding) how many products it folded.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = lambda x, w: jnp.tanh(x @ w).sum()
  >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5)) / 4
  >>> bool(jnp.allclose(jax.grad(fold_leading_dims(f), 1)(x, w), jax.grad(f, 1)(x, w)))
  True
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex

from fdp import _compat
from fdp._jaxpr import evaluate
from fdp.observe._debug import logger

SHARDED = "an operand sharded over explicit mesh axes"
NESTED = "inside a scan, remat, cond or custom_vjp"


class FoldCount(NamedTuple):
    """What :func:`fold_leading_dims` did with a function's dense products.

    Attributes:
      folded: products computed as 2-D matrix products.
      left: ``(reason, count)`` pairs: dense products left as written
        (``SHARDED``), and sub-programs holding products it does not enter
        (``NESTED``). A tuple, so that a count can sit in a hashable plan.
    """

    folded: int
    left: tuple[tuple[str, int], ...] = ()


def _dense_layout(eqn: Any, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> Any:
    """``(rows, k, cols, leading)`` of a dense layer's product worth folding, or None.

    A dense layer's product has no batch dimensions, contracts the trailing
    dimensions of ``lhs`` (the activation) in order, and the leading or trailing
    dimensions of ``rhs`` (the kernel: ``[in..., out...]`` as in Flax, or
    ``[out..., in...]`` as in torch) in order.
    """
    dot = _compat.dot_params(eqn)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dot.contracting, dot.batch
    c = len(lhs_contract)
    if lhs_batch or rhs_batch or c == 0 or dot.out_sharding is not None:
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
    return tuple(rows), _prod(inner), tuple(cols), leading


def _refusal(lhs: Any, rhs: Any) -> str | None:
    """Why a dense product of these operands must stay as written, or None."""
    for operand in (lhs, rhs):
        axes = _compat.sharded_axes(operand)
        if axes is None or axes:  # unreadable counts as sharded: never guess
            return SHARDED
    return None


def _folded_dot(eqn: Any, lhs: Any, rhs: Any) -> Any:
    """``lhs . rhs`` as one 2-D matrix product (see :func:`_dense_layout`).

    Folded: ``lhs`` to ``[rows, in]``, ``rhs`` to ``[in, out]`` or ``[out, in]``.
    """
    rows, k, cols, leading = _dense_layout(eqn, jax.numpy.shape(lhs), jax.numpy.shape(rhs))
    flat_rhs = (k, _prod(cols)) if leading else (_prod(cols), k)
    dot = _compat.dot_params(eqn)
    out = jax.lax.dot_general(
        jax.lax.reshape(lhs, (_prod(rows), k)),
        jax.lax.reshape(rhs, flat_rhs),
        (((1,), (0 if leading else 1,)), ((), ())),
        precision=dot.precision,
        preferred_element_type=dot.preferred_element_type,
    )
    return jax.lax.reshape(out, (*rows, *cols))


def _holds_dots(eqn: Any) -> bool:
    """Whether a sub-program of ``eqn`` (scan, remat, cond...) has a matrix product."""
    for sub in jex.jaxprs_in_params(eqn.params):
        inner = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
        for e in inner.eqns:
            if _compat.is_dot_general(e) or _holds_dots(e):
                return True
    return False


def _prod(dims: Sequence[int]) -> int:
    return functools.reduce(lambda a, b: a * b, dims, 1)


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], seen: Any) -> list[Any]:
    """Evaluates ``jaxpr`` with its dense products folded; counts into ``seen`` (a Counter)."""

    def rule(eqn: Any, invals: list[Any]) -> list[Any]:
        inner = _compat.inlinable_call(eqn)
        if inner is not None:
            return _eval(inner.jaxpr, inner.consts, invals, seen)
        if _compat.is_dot_general(eqn) and _dense_layout(
            eqn, jax.numpy.shape(invals[0]), jax.numpy.shape(invals[1])
        ):
            why = _refusal(*invals)
            seen[why or "folded"] += 1
            return _compat.bind_equation(eqn, invals) if why else [_folded_dot(eqn, *invals)]
        if _holds_dots(eqn):
            seen[NESTED] += 1
        return _compat.bind_equation(eqn, invals)

    return evaluate(jaxpr, consts, args, rule)


def _count(seen: Any) -> FoldCount:
    left = tuple((k, v) for k, v in sorted(seen.items()) if k != "folded")
    return FoldCount(seen["folded"], left)


def _count_in(jaxpr: Any, seen: Any) -> None:
    for eqn in jaxpr.eqns:
        inner = _compat.inlinable_call(eqn)
        if inner is not None:
            _count_in(inner.jaxpr, seen)
        elif _compat.is_dot_general(eqn) and _dense_layout(
            eqn, eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
        ):
            seen[_refusal(*eqn.invars[:2]) or "folded"] += 1
        elif _holds_dots(eqn):
            seen[NESTED] += 1


def count_in_jaxpr(jaxpr: Any) -> FoldCount:
    """What :func:`fold_leading_dims` does with a function of this jaxpr, read from its types.

    The step reads it from the jaxpr of the loss it already traces for its plan
    (``StepPlan.folds``): ``describe`` and the INFO log show it, and a loss with
    nothing to fold is not wrapped at all (no second pass over its equations).
    """
    seen: Any = collections.Counter()
    _count_in(jaxpr, seen)
    return _count(seen)


def _log(count: FoldCount) -> None:
    left = ", ".join(f"{n} {why}" for why, n in count.left)
    log = logger.info if SHARDED in dict(count.left) else logger.debug
    log(
        "fdp fold_dots: %d dense product(s) folded to 2-D%s",
        count.folded,
        f"; left as written: {left}" if left else "",
    )


def count_folds(fun: Callable[..., Any], *args: Any) -> FoldCount:
    """What :func:`fold_leading_dims` would do with ``fun`` on ``args`` (traced, not run).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def f(x, w):
      ...     h = x @ w  # folded
      ...     return jax.lax.scan(lambda c, _: (c @ w, None), h, None, length=2)[0].sum()
      >>> count_folds(f, jnp.ones((2, 3, 4)), jnp.ones((4, 4)))
      FoldCount(folded=1, left=(('inside a scan, remat, cond or custom_vjp', 1),))
    """
    return count_in_jaxpr(jax.make_jaxpr(fun)(*args).jaxpr)


def fold_leading_dims(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` with its dense products of n-D operands computed as 2-D products.

    Args:
      fun: a function of arrays (pytrees of arrays) to arrays, traceable by JAX.

    Returns:
      A function with ``fun``'s signature and values. Products it cannot fold
      exactly (operands sharded over explicit mesh axes) it leaves as written.
    """

    @functools.wraps(fun)
    def folded(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        seen: Any = collections.Counter()
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), seen)
        _log(_count(seen))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return folded
