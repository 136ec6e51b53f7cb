"""The order in which the backward pass completes each parameter's gradient.

DDP builds its first buckets in the reverse of the parameters' registration order,
then, after the first iteration, rebuilds them in the order their gradients became
ready (``Reducer::rebuild_buckets``), so the first bucket is the first to fill. In
JAX the parameters' order is ``jax.tree.leaves``, which for Flax sorts module
names: in a GPT its reverse puts the token embedding, whose gradient backprop
completes last, in bucket 0, and ``Block_10`` before ``Block_2``.

fdp reads the order from the loss's forward program, the one it already traces
for the parameters' usage: the backward pass runs the forward equations in
reverse, so a parameter's gradient is complete when it passes the parameter's
*first* use (every later use has contributed by then; a shared or tied
parameter counts from its earliest use). Parameters are ordered by their first
use, latest first. Uses inside calls (``jit``, ``remat``, custom derivatives) are
ordered by their own position, so a loss wrapped in ``jax.jit`` orders as well as
a plain one. Parameters first used by the same equation (a scanned layer stack)
or never used keep the reverse of the leaf order among themselves, after the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex

from fdp import _compat as compat
from fdp.step.grads._usage import trace_loss

Position = tuple[int, ...]


def _first_uses(jaxpr: Any, invars: Sequence[Any], depth: int = 0) -> list[Position | None]:
    """Per variable, the (nested) position of the first equation of ``jaxpr`` that reads it."""
    wanted = {v: k for k, v in enumerate(invars) if not isinstance(v, jex.Literal)}
    found: list[Position | None] = [None] * len(invars)
    for i, eqn in enumerate(jaxpr.eqns):
        for pos, var in enumerate(eqn.invars):
            k = wanted.get(var) if not isinstance(var, jex.Literal) else None
            if k is None or found[k] is not None:
                continue
            body = compat.call_body(eqn) if depth < 16 else None
            inner = _first_uses(body, [body.invars[pos]], depth + 1)[0] if body else None
            found[k] = (i, *(inner or ()))
        if all(f is not None for f in found):
            break
    return found


def ready_order_of(jaxpr: Any, n: int) -> tuple[int, ...]:
    """Indices of the first ``n`` inputs of a loss's ``jaxpr``, in gradient-ready order."""
    firsts = _first_uses(jaxpr, jaxpr.invars[:n])
    # Latest first use first; ties and unused parameters: the higher leaf index first.
    return tuple(sorted(range(n), key=lambda i: (firsts[i] or (-1,), i), reverse=True))


def ready_order(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    axis_env: Sequence[tuple[str, int]] = (),
) -> tuple[int, ...]:
    """Parameter leaf indices in the order the backward pass completes their gradients.

    Args:
      loss_fn: ``loss_fn(params, *args)`` returning the loss, or a tuple starting
        with it.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      *args: the loss's other arguments (arrays or ``jax.ShapeDtypeStruct``).
      axis_env: mapped axes the loss may use, as ``(name, size)``.

    Returns:
      Every leaf index of ``params`` once, earliest-ready first.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = {"a_last": jnp.ones((3, 3)), "b_first": jnp.ones((3, 3))}
      >>> def loss(p, x):  # b_first is applied first, a_last last
      ...     return jnp.sum(jnp.tanh(jnp.tanh(x @ p["b_first"]) @ p["a_last"]))
      >>> ready_order(loss, params, jnp.ones((2, 3)))  # a_last's gradient is ready first
      (0, 1)
    """
    closed = trace_loss(loss_fn, params, *args, axis_env=axis_env)
    return ready_order_of(closed.jaxpr, len(jax.tree.leaves(params)))
