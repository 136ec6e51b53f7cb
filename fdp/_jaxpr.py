"""Running a jaxpr again, one equation at a time, through a rule of the caller's.

Two of fdp's transformations trace a function once and then re-run its jaxpr with
some equations changed: ZeRO stage 3's per-use gathers (:mod:`fdp.step.grads._per_use`)
and the CPU backend's ``fold_dots`` (:mod:`fdp.backends.cpu._fold`). Both walk the
equations as ``jax.core.eval_jaxpr`` does; this is that walk, written once.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fdp._compat import bind_equation
  >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
  >>> out = evaluate(closed.jaxpr, closed.consts, [0.0], bind_equation)
  >>> [float(x) for x in out]
  [0.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core as jex

Rule = Callable[[Any, list[Any]], list[Any]]
"""``rule(eqn, invals) -> outvals``: what one equation computes from its input values."""


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rule: Rule) -> list[Any]:
    """The outputs of ``jaxpr`` on ``consts`` and ``args``, each equation run by ``rule``.

    Args:
      jaxpr: the jaxpr (``closed.jaxpr``).
      consts: values of its constants (``closed.consts``).
      args: values of its inputs, flat.
      rule: computes an equation's output values from its input values
        (literals are read as their values); ``fdp._compat.bind_equation`` runs
        it as traced.

    Returns:
      The values of ``jaxpr``'s outputs, as a list.
    """
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        outs = rule(eqn, [read(v) for v in eqn.invars])
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]
