"""Which parameters take part in producing the loss, read from the traced program.

DDP's ``find_unused_parameters=True`` walks the autograd graph after every forward.
fdp reads the jaxpr of the loss once, at trace time: a backward liveness walk from
the loss output marks every parameter

- **used**: it reaches the loss on every path through the program;
- **conditional**: it reaches the loss only inside a branch of ``lax.cond`` /
  ``lax.switch``, so whether it is used depends on data or on the device;
- **unused**: it never reaches the loss.

Unused parameters are left out of the buckets and, with the optimizer state that
belongs to them, untouched by the step. Conditional ones are reduced as usual, and a
per-parameter "used" flag (a non-zero local gradient) reduced over the data axis
decides at run time whether the step leaves them untouched.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from fdp import _compat as compat
from fdp.collectives._axis import AxisName

UNUSED, CONDITIONAL, USED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class ParamUsage:
    """How each parameter leaf takes part in the loss.

    Attributes:
      key_paths: key path of every parameter leaf.
      levels: ``0`` unused, ``1`` conditional, ``2`` used, per leaf.
    """

    key_paths: tuple[str, ...]
    levels: tuple[int, ...]

    @property
    def unused(self) -> tuple[int, ...]:
        """Indices of parameters that never reach the loss."""
        return tuple(i for i, lv in enumerate(self.levels) if lv == UNUSED)

    @property
    def conditional(self) -> tuple[int, ...]:
        """Indices of parameters that reach the loss only inside a branch."""
        return tuple(i for i, lv in enumerate(self.levels) if lv == CONDITIONAL)

    @property
    def unused_key_paths(self) -> tuple[str, ...]:
        """Key paths of the unused parameters."""
        return tuple(self.key_paths[i] for i in self.unused)

    @property
    def conditional_key_paths(self) -> tuple[str, ...]:
        """Key paths of the conditional parameters."""
        return tuple(self.key_paths[i] for i in self.conditional)


def _levels(jaxpr: Any, out_levels: Sequence[int]) -> list[int]:
    """Liveness level of every input of ``jaxpr`` given the levels of its outputs."""
    level: dict[Any, int] = {}

    def bump(var: Any, lv: int) -> None:
        if not isinstance(var, jex.Literal) and lv > level.get(var, UNUSED):
            level[var] = lv

    for var, lv in zip(jaxpr.outvars, out_levels, strict=True):
        bump(var, lv)
    for eqn in reversed(jaxpr.eqns):
        out = max((level.get(v, UNUSED) for v in eqn.outvars), default=UNUSED)
        if out == UNUSED:
            continue
        if compat.is_cond(eqn):
            branch_levels = [
                _levels(b, [level.get(v, UNUSED) for v in eqn.outvars])
                for b in compat.cond_branches(eqn)
            ]
            bump(eqn.invars[0], out)  # the branch index
            for pos, var in enumerate(eqn.invars[1:]):
                per_branch = [lv[pos] for lv in branch_levels]
                if min(per_branch) > UNUSED:
                    bump(var, min(out, min(per_branch)))
                elif max(per_branch) > UNUSED:
                    bump(var, min(out, CONDITIONAL))
            continue
        sub = compat.call_body(eqn)
        if sub is not None:
            sub_out = [min(out, level.get(v, UNUSED)) for v in eqn.outvars]
            for var, lv in zip(eqn.invars, _levels(sub, sub_out), strict=True):
                bump(var, lv)
            continue
        # Loops and everything else: every input may reach every output.
        for var in eqn.invars:
            bump(var, out)
    return [level.get(v, UNUSED) for v in jaxpr.invars]


def trace_loss(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    axis_env: Sequence[tuple[str, int]] = (),
    mesh: Any = None,
) -> Any:
    """The closed jaxpr of ``loss_fn(params, *args)``'s loss (the first output of a tuple).

    Its first inputs are the leaves of ``params``, in ``jax.tree.leaves`` order. The
    step reads it once per input shape, for the usage (:func:`usage_of`) and the
    gradient-ready order (:func:`fdp.step.grads._ready.ready_order_of`). With ``mesh``,
    traced under its abstract mesh, as the step's ``shard_map`` traces the loss:
    a bare ``PartitionSpec`` in a sharding constraint resolves against it.
    """

    def loss_only(p: Any, *rest: Any) -> jax.Array:
        out = loss_fn(p, *rest)
        return out[0] if isinstance(out, tuple) else out

    trace = jax.make_jaxpr(loss_only, axis_env=list(axis_env))
    if mesh is None:
        return trace(params, *args)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return trace(params, *args)


def usage_of(closed: Any, key_paths: tuple[str, ...]) -> ParamUsage:
    """How each of the first ``len(key_paths)`` inputs of the loss's jaxpr takes part in it."""
    levels = _levels(closed.jaxpr, [USED] * len(closed.jaxpr.outvars))
    return ParamUsage(key_paths, tuple(levels[: len(key_paths)]))


def key_paths_of(params: Any) -> tuple[str, ...]:
    """``jax.tree_util.keystr`` of every leaf of ``params``."""
    return tuple(
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )


def analyse_usage(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    axis_env: Sequence[tuple[str, int]] = (),
) -> ParamUsage:
    """Traces ``loss_fn(params, *args)`` and classifies every parameter leaf.

    Args:
      loss_fn: returns the loss, or a tuple whose first element is the loss
        (``(loss, aux)``); only the loss counts as a use, as in DDP.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      *args: the other arguments (arrays or ``jax.ShapeDtypeStruct``).
      axis_env: mapped axes the loss may use, as ``(name, size)`` (for example
        ``nn.BatchNorm(axis_name='data')``).

    Returns:
      A :class:`ParamUsage` for the leaves of ``params``.
    """
    closed = trace_loss(loss_fn, params, *args, axis_env=axis_env)
    return usage_of(closed, key_paths_of(params))


def find_unused_parameters(loss_fn: Callable[..., Any], params: Any, *args: Any) -> tuple[str, ...]:
    """Key paths of the parameters that do not take part in producing the loss.

    Args:
      loss_fn: ``loss_fn(params, *args)`` returning the loss (or ``(loss, aux)``).
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      *args: the other arguments, e.g. one local batch.

    Returns:
      The unused parameters' key paths (``jax.tree_util.keystr``).

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"body": jnp.ones((3, 2)), "head": jnp.ones((2,))}
      >>> find_unused_parameters(lambda p, x: jnp.sum(x @ p["body"]), params, jnp.ones((4, 3)))
      ("['head']",)
    """
    return analyse_usage(loss_fn, params, *args).unused_key_paths


def warn_if_unused(usage: ParamUsage, detecting: bool, stacklevel: int) -> None:
    """Warns, naming them, about unused parameters a step will still update."""
    if usage.unused and not detecting:
        warnings.warn(
            "These parameters do not take part in producing the loss, so they get zero "
            "gradients and the optimizer still updates them (momentum, weight decay): "
            f"{', '.join(usage.unused_key_paths)}. Pass find_unused_parameters=True to "
            "leave them and their optimizer state untouched, as DDP does.",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


def untouched_flags(usage: ParamUsage, used: jax.Array, axis_name: AxisName) -> list[Any]:
    """Per parameter leaf, whether the step must leave it (and its optimizer state) as is.

    ``True`` for statically unused leaves; for conditional ones, a traced bool
    that is true when no device used the leaf (``used`` holds this device's
    flags for ``usage.conditional``, in order); ``False`` otherwise.
    """
    keep: list[Any] = [i in usage.unused for i in range(len(usage.levels))]
    if usage.conditional:
        used_anywhere = jax.lax.psum(used.astype(jnp.int32), axis_name) > 0
        for j, i in enumerate(usage.conditional):
            keep[i] = ~used_anywhere[j]
    return keep


def keep_from_flags(usage: ParamUsage, flags: jax.Array) -> list[Any]:
    """:func:`untouched_flags` again from an array of them (one bool per leaf).

    Statically unused and used leaves become ``True`` and ``False`` again, so only
    conditional leaves cost a select.
    """
    return [
        True if i in usage.unused else (flags[i] if i in usage.conditional else False)
        for i in range(len(usage.levels))
    ]


def nonzero_flags(grads: Sequence[jax.Array]) -> jax.Array:
    """One bool per gradient: whether any element is non-zero (the run-time "used")."""
    if not grads:
        return jnp.zeros((0,), jnp.bool_)
    return jnp.stack([jnp.any(g != 0) for g in grads])


def keep_untouched(new: Any, old: Any, params_treedef: Any, keep: Sequence[Any]) -> Any:
    """``new`` with the leaves of kept parameters taken from ``old``.

    Every subtree of ``new`` with the parameters' structure (the parameters
    themselves, and optimizer state such as Adam's ``mu`` and ``nu``) gets its
    kept leaves from ``old``. ``keep[i]`` is ``True`` (statically unused), a
    traced bool (globally unused at run time) or ``False``.
    """

    def is_param_tree(x: Any) -> bool:
        try:
            return jax.tree.structure(x) == params_treedef
        except Exception:
            return False

    def select(new_sub: Any, old_sub: Any) -> Any:
        if not is_param_tree(new_sub):
            return new_sub
        new_leaves = jax.tree.leaves(new_sub)
        old_leaves = jax.tree.leaves(old_sub)
        out = []
        for n, o, k in zip(new_leaves, old_leaves, keep, strict=True):
            if k is True:
                out.append(o)
            elif k is False:
                out.append(n)
            else:
                out.append(jnp.where(k, o, n))
        return jax.tree.unflatten(params_treedef, out)

    return jax.tree.map(select, new, old, is_leaf=is_param_tree)
