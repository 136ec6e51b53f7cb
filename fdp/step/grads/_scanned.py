"""Scanned layer stacks at stages 0-2: each layer's gradient reduced inside the backward loop.

A model whose layers are one ``nn.scan``/``nnx.scan`` stack has one stacked
parameter per leaf (a leading layer axis), used by one ``scan``. DDP's step
reduces the gradients after the backward pass, bucket by bucket, so the stack's
whole local gradient is built by the backward loop first, then all-reduced into
a second buffer. Plain ``jit`` data parallelism (XLA's partitioner) all-reduces
each layer's gradient inside the backward loop instead, as the loop produces it,
and peaks lower.

fdp does the same by moving the point where a stacked parameter becomes
per-device (:func:`fdp.collectives.vary`, the ``pcast`` that makes ``jax.grad``
give local gradients): the step keeps those leaves replicated, and the loss's
traced program is run again (:func:`fdp.step.grads._per_use._interpret`) with the
``scan`` re-built so that its body makes each layer's slice per-device. The
transpose of that cast is a sum over the data axis, which ``jax.grad`` then runs
in the backward loop, once per layer: the gradient leaves the loop reduced.
:func:`fdp.step.grads._per_use.finish_gradients` divides it by ``N`` and all-reduces
every other leaf bucket by bucket, as the default hook does.

At ZeRO stages 1-2 each device keeps only its share of the reduced gradients.
The stack stays replicated for the loss to read, and the gradient is taken with
respect to this device's share of it (:func:`shares`) through a cast whose
transpose is a reduce-scatter (:func:`_scattered_gradient`); re-built the same
way, the backward loop reduce-scatters each layer's gradient as it produces it
(:func:`scattered_in_loop`), and :func:`fdp.step.grads._per_use.finish_gradients`
divides the shares by ``N`` and reduce-scatters every other leaf bucket by
bucket. A stack split along its layer axis has no per-layer share and is
reduced after the loop.

Only with the plain mean all-reduce (the default hook or ``allreduce``), one
micro-batch (``accumulate_steps=1``: with more, each micro-batch would reduce,
where DDP reduces once after ``no_sync``) and replication tracking
(``check_vma``); see :attr:`fdp.step.options._config.StepConfig.reduces_scanned_in_loop`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fdp import _compat as compat
from fdp.bucketing._plan import WHOLE
from fdp.collectives import vary
from fdp.collectives._axis import AxisName
from fdp.collectives._blocks import on_blocks
from fdp.collectives._ops import own_chunk
from fdp.step.grads._local_grads import Objective
from fdp.step.grads._per_use import Use, _interpret, _Lazy, _merge


def scanned_leaves(jaxpr: Any, count: int) -> tuple[int, ...]:
    """Which of the first ``count`` inputs of ``jaxpr`` a ``scan`` iterates over as they are.

    Nested ``jit`` calls are entered; inputs changed before the scan (a
    transpose, a cast) do not count.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def loss(stack, w, x):
      ...     return jax.lax.scan(lambda h, k: (jnp.tanh(h @ k @ w), None), x, stack)[0].sum()
      >>> closed = jax.make_jaxpr(loss)(jnp.ones((3, 4, 4)), jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> scanned_leaves(closed.jaxpr, 2)
      (0,)
    """
    found: set[int] = set()

    def walk(jaxpr: Any, index: dict[Any, int]) -> None:
        for eqn in jaxpr.eqns:
            if compat.is_scan(eqn):
                parts = compat.scan_parts(eqn)
                for v in eqn.invars[parts.num_consts + parts.num_carry :]:
                    if not isinstance(v, jex.Literal) and v in index:
                        found.add(index[v])
            elif (inner := compat.inlinable_call(eqn)) is not None:
                walk(
                    inner.jaxpr,
                    {
                        w: index[v]
                        for v, w in zip(eqn.invars, inner.jaxpr.invars, strict=True)
                        if not isinstance(v, jex.Literal) and v in index
                    },
                )

    walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:count])})
    return tuple(sorted(found))


def _varied(x: Any, axis_name: AxisName) -> _Lazy:
    """``x`` made per-device lazily; scanned over, each slice is made so in the loop body."""
    return _Lazy(
        (x,), lambda s: vary(s[0], axis_name), lambda: (x, lambda part: _varied(part, axis_name))
    )


def _made(eqn: Any, values: list[Any]) -> list[Any]:
    """``eqn`` on ``values``, the lazy ones made first, inside a remat.

    The remat keeps the replicated slice as the backward pass's residual, not
    its per-device copy: saved per iteration, the copies would stack up to the
    whole layer stack again.
    """
    shards, make = _merge(values)
    others = [v for v in values if not isinstance(v, _Lazy)]

    def apply(others: list[Any], shards: tuple[Any, ...]) -> list[Any]:
        return compat.bind_equation(eqn, make(shards, others))

    return jax.checkpoint(apply, prevent_cse=False)(others, shards)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _scattered_gradient(
    whole: Any, share: Any, dim: int, axis_name: AxisName, layout: P = WHOLE
) -> Any:
    """``whole`` made per-device; the gradient goes to ``share``, reduce-scattered along ``dim``.

    ``whole`` is a replicated parameter (no gradient of its own), ``share`` this
    device's block of it: the transpose of the cast is the sum over the data
    axis of the cotangents, of which this device keeps its block. ``layout``:
    its split over the model axes, on whose blocks the reduce-scatter runs
    (:func:`fdp.collectives._blocks.on_blocks`).
    """
    return vary(whole, axis_name)


def _scattered_fwd(
    whole: Any, share: Any, dim: int, axis_name: AxisName, layout: P
) -> tuple[Any, None]:
    return vary(whole, axis_name), None


def _scattered_bwd(dim: int, axis_name: AxisName, layout: P, _: None, ct: Any) -> tuple[None, Any]:
    scatter = functools.partial(
        jax.lax.psum_scatter, axis_name=axis_name, scatter_dimension=dim, tiled=True
    )
    return None, on_blocks(scatter, layout)(ct)


_scattered_gradient.defvjp(_scattered_fwd, _scattered_bwd)


def _scattered(whole: Any, share: Any, dim: int, axis_name: AxisName, layout: P = WHOLE) -> _Lazy:
    """``whole`` made per-device lazily, its gradient reduce-scattered into ``share``.

    Scanned over, each layer's slice is made so in the loop body (``dim`` and
    ``layout`` then count from the layer's own axes); a stack split along its
    layer axis (``dim`` 0) has no per-layer share and is made whole before its
    loop.
    """

    def layers() -> tuple[Any, Any] | None:
        if dim == 0:
            return None
        layer = P(*tuple(layout)[1:])  # one layer's split over the model axes
        return (whole, share), lambda part: _scattered(part[0], part[1], dim - 1, axis_name, layer)

    def make(s: tuple[Any, Any]) -> Any:
        return _scattered_gradient(s[0], s[1], dim, axis_name, layout)

    return _Lazy((whole, share), make, layers)


def _rerun(objective: Objective, typed: list[Any], lazy: dict[int, _Lazy]) -> Objective:
    """``objective`` traced on parameters ``typed``, run again with the leaves ``lazy`` lazy.

    The leaves of ``lazy`` are made inside the loop body of each ``scan`` over them
    (:func:`fdp.step.grads._per_use._scan`), each in a remat (:func:`_made`).
    """

    def traced(params: Any, micro: Any, carry: Any, key: Any) -> tuple[Any, Any, Any]:
        loss, aux, new_carry = objective(params, micro, carry, key)
        return loss, jax.tree.map(jnp.asarray, aux), new_carry

    def run(params: Any, micro: Any, carry: Any, key: Any) -> tuple[Any, Any, Any]:
        treedef = jax.tree.structure(params)
        args = (jax.tree.unflatten(treedef, typed), micro, carry, key)
        closed, shape = jax.make_jaxpr(traced, return_shape=True)(*args)
        flat = jax.tree.leaves(args)
        flat[: len(typed)] = [lazy.get(i, t) for i, t in enumerate(typed)]
        outs = _interpret(
            closed.jaxpr, list(closed.consts), flat, {}, Use(run=lambda e, v, _: _made(e, v))
        )
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def scattered_in_loop(
    objective: Objective,
    wholes: dict[int, Any],
    dims: dict[int, int],
    axis_name: AxisName,
    layouts: Sequence[P] = (),
) -> Objective:
    """ZeRO stages 1-2: ``objective`` whose scanned stacks' gradients are reduce-scattered in-loop.

    The leaves named by ``wholes`` (indices into ``jax.tree.leaves(params)``,
    each the replicated stack) are passed to the result as this device's
    shares along ``dims`` (:func:`shares`); the loss reads the whole stacks,
    and the gradient with respect to each share is the *sum* over the data
    axis of the local gradients, this device's block, reduce-scattered inside
    the backward loop one layer at a time as it produces them. Only stacks
    split along a later axis than the layer axis (``dims[i] > 0``) qualify.
    ``layouts``: per leaf, its split over the model axes (empty: none); a
    stack's reduce-scatter then runs on each device's block, as a bucket's does.
    """
    laid = tuple(layouts)

    def run(params: Any, micro: Any, carry: Any, key: Any) -> tuple[Any, Any, Any]:
        leaves = jax.tree.leaves(params)
        typed = [vary(wholes[i], axis_name) if i in wholes else x for i, x in enumerate(leaves)]
        lazy = {
            i: _scattered(wholes[i], leaves[i], dims[i], axis_name, laid[i] if laid else WHOLE)
            for i in wholes
        }
        return _rerun(objective, typed, lazy)(params, micro, carry, key)

    return run


def shares(params: Any, dims: dict[int, int], axis_name: AxisName) -> Any:
    """``params`` made per-device, the leaves named by ``dims`` cut to this device's share."""
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(
        treedef,
        [
            own_chunk(x, axis_name, dims[i]) if i in dims else vary(x, axis_name)
            for i, x in enumerate(leaves)
        ],
    )


def reduced_in_loop(
    objective: Objective, scanned: tuple[int, ...], axis_name: AxisName
) -> Objective:
    """``objective`` whose ``scanned`` parameter leaves come replicated and are reduced in-loop.

    The leaves named by ``scanned`` (indices into ``jax.tree.leaves(params)``)
    must be passed replicated (not made per-device); the others per-device, as
    usual. Their gradient is then the *sum* over the data axis of the local
    gradients, reduced inside the backward loop of each ``scan`` over them.

    Example (inside the step's ``shard_map``; ``objective(params, micro_batch,
    carry, key) -> (loss, aux, new_carry)``)::

        objective = reduced_in_loop(objective, (2, 3), "data")
    """
    chosen = frozenset(scanned)

    def run(params: Any, micro: Any, carry: Any, key: Any) -> tuple[Any, Any, Any]:
        leaves = jax.tree.leaves(params)
        typed = [vary(x, axis_name) if i in chosen else x for i, x in enumerate(leaves)]
        lazy = {i: _varied(leaves[i], axis_name) for i in chosen}
        return _rerun(objective, typed, lazy)(params, micro, carry, key)

    return run
