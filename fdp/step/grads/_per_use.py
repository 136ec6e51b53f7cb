"""ZeRO stage 3 with parameters gathered where they are used, and freed after.

At stage 3 each device holds ``1/N`` of every shardable parameter between steps.
Gathering all of them at the start of the step and keeping them for the backward
pass (:func:`fdp.step.layout._zero.gather_params`) peaks as high as stage 1: every
parameter is whole on every device from the first layer's forward to the last
layer's backward. PyTorch FSDP2 (``reshard_after_forward=True``) and DeepSpeed
ZeRO-3 instead gather a layer's parameters just before it runs, free them after,
and gather them again for its backward pass.

fdp's step sees a loss function of a pytree, not layers, so it finds the uses in
the loss's traced program:

- **Deferred gathers.** The objective is traced once with every sharded leaf
  all-gathered at its start (one collective per leaf: a DDP bucket of 25 MiB
  spans many layers). That program is run again (:func:`_interpret`) with each
  gather left undone (:class:`_Lazy`) until an equation mixes the parameter
  with an activation; equations on parameters alone (a transpose, a cast) stay
  deferred, and nested ``jit`` calls are entered.
- **A custom VJP per use** (:func:`_use`): the equation runs on the gathered
  value, and its backward pass gathers it again from the shards (a residual,
  with the equation's other inputs) and differentiates the equation there. No
  backward pass but the last group's (below) reads the gathered value, so XLA
  frees it after the equation. The shards' gradient is the
  all-gather's transpose, a reduce-scatter: summed over the data axis, this
  device's share, sent as soon as that layer's backward is done.
- **Order by data** (:class:`_Prefetch`, :func:`_tied`): on CPU, where
  collectives block, the forward gather depends on its own use's inputs and the
  backward one on its own cotangent, so neither runs early and XLA cannot merge
  the two. On GPU consecutive uses form groups of about ``group_bytes`` of
  parameters, each gathered one group ahead: a group's forward gathers depend on
  the first use of the group before it, its backward gathers on cotangents that
  the group after the next hands back as its backward starts (each use outputs a
  zero token for that). A group's gathers, tied to one value and tagged with one
  combiner key, become one all-gather in XLA:GPU's program, and its gradients
  one reduce-scatter.

- **Layer stacks** (``nn.scan``/``nnx.scan``: one stacked parameter per leaf,
  used by one ``scan`` equation): the scan is run again with each stacked
  parameter's shards as its scanned-over input (:func:`_scan`), so the body
  gathers one layer per iteration, in the forward loop and again in the
  backward loop, which reduce-scatters that layer's gradient. fdp's rule
  splits a stack of three or more dimensions along a later dimension than its
  layer axis where one qualifies (:func:`fdp.step.layout._zero.shard_dim`), so each
  device already holds a share of every layer. A stack split along its layer
  axis (``[L, d]`` with ``L`` divisible by ``N``: device ``k`` holds whole
  layers) is first re-split by one all-to-all along another dimension, so
  that each layer is one all-gather away; the gradient goes back by the
  transpose, another all-to-all.

The price: a second all-gather per leaf (the backward one), and with
``accumulate_steps=K`` the gathers and reduce-scatters run in every micro-batch;
the accumulated gradient is a share, ``1/N`` of stage 0's. On GPU with
prefetch, the forward pass's last group (the output layer, where it closes a
group) is the exception: used again as soon as the backward pass starts, it
keeps its gathered values (:meth:`_Prefetch.keeps`), as FSDP2 keeps its root
module unsharded after the forward pass.

Limits: a stack with no other dimension divisible by ``N``, or one that is
transformed (transposed, cast) before its ``scan``, is gathered whole for the
scan, and gathered again in its backward pass. Leaves kept whole at stage 3 (no
dimension divisible by ``N``) are not gathered; their local gradients are
all-reduced after the backward pass, bucket by bucket
(:func:`finish_gradients`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import PartitionSpec as P

from fdp import _compat as compat
from fdp._jaxpr import evaluate
from fdp.bucketing import BucketPlan
from fdp.bucketing._plan import WHOLE
from fdp.collectives import axis_size, vary
from fdp.collectives._axis import AxisName
from fdp.hooks._bucketed import no_gradient
from fdp.hooks._contract import mean_reduce_scatter
from fdp.step.grads._local_grads import Objective
from fdp.step.grads._mixed import low_gather
from fdp.step.layout._zero import gather, gather_leaf


class _Lazy:
    """A value computed from parameter shards alone: where it is, nothing is gathered yet.

    ``shards`` are the shard values it needs and ``make(shards)`` computes it
    (all-gathers included); it is materialised only inside the custom VJP of
    the equation that mixes it with an activation.

    ``layers``, where set, says how a stacked layer parameter of this form is
    scanned over one layer at a time (:func:`_scan`): ``layers()`` returns the
    array to scan over and a function making the lazy value of one of its
    slices, or None where it cannot.
    """

    def __init__(self, shards: tuple[Any, ...], make: Any, layers: Layers | None = None) -> None:
        self.shards = shards
        self.make = make
        self.layers = layers


Layers = Callable[[], "tuple[Any, Callable[[Any], _Lazy]] | None"]


def _merge(values: list[Any]) -> tuple[tuple[Any, ...], Any]:
    """The shards that the lazy ``values`` need, and a function making all of ``values``."""
    shards: list[Any] = []
    spans = []
    for v in values:
        if isinstance(v, _Lazy):
            spans.append((len(shards), len(v.shards)))
            shards.extend(v.shards)
        else:
            spans.append(None)

    def make(args: tuple[Any, ...], others: list[Any]) -> list[Any]:
        it = iter(others)
        return [
            next(it) if span is None else v.make(args[span[0] : span[0] + span[1]])
            for v, span in zip(values, spans, strict=True)
        ]

    return tuple(shards), make


def _tied(shards: tuple[Any, ...], to: Any, barrier: bool = False) -> tuple[Any, ...]:
    """``shards`` made to depend on ``to`` (a pytree of arrays), values unchanged.

    Adds ``0 * t`` for one element ``t`` of ``to``: the gather of the result
    cannot start before ``to`` exists, and is not the same computation as the
    gather of the bare shard. An optimization barrier says the same on GPU, but
    XLA:CPU removes barriers before common-subexpression elimination, which
    then merges the backward pass's gathers into the forward pass's (every
    parameter whole from the first layer to the last: stage 1's peak).

    With ``barrier`` (GPU, a mesh with model axes: :func:`per_use_objective`),
    an optimization barrier over ``shards`` and the whole of ``to``: one element
    of an activation split over a model axis lives on one device of that axis,
    and reading it costs an all-reduce over the axis at every tie.
    """
    if barrier:
        leaves = _arrays(to)
        return jax.lax.optimization_barrier((shards, leaves))[0] if leaves else shards
    token = _first_number(to)
    if token is None:
        return shards
    zero = token * 0
    return tuple(s + zero.astype(s.dtype) if _inexact(s) else s for s in shards)


class _Token:
    """A use's zero scalar, which the use that opens the group two groups later takes.

    ``value`` is the output (set once the use has run); ``taken`` says whether
    a later use took it. That
    use's backward, which runs before this one's, returns a zero made from its
    own cotangent as the token's cotangent as soon as it starts, and this use's
    backward gather is tied to it (:class:`_Prefetch`).
    """

    def __init__(self) -> None:
        self.value: Any = None
        self.taken = False


class _Group:
    """Consecutive uses whose gathers XLA:GPU merges into one (:class:`_Prefetch`)."""

    def __init__(self, anchor: Any) -> None:
        self.anchor = anchor  # a token of its first use's inputs: the next group's anchor
        self.nbytes = 0
        self.tokens: list[_Token] = []
        self.sealed = False  # before a loop: its tokens are taken by no later use


class _Prefetch:
    """Uses in groups of about ``cap`` shard bytes, each gathered ``ahead`` groups early.

    Tied to its own equation's inputs, a gather cannot start before the work just
    before its use is done, so nothing hides it, and each leaf's gather is its
    own small collective (about 10 us on a GPU, whatever its size). With
    ``ahead`` (GPU), consecutive uses form groups of about ``cap`` bytes of
    shards (a group closes once it holds ``cap`` or more, so a use larger than
    ``cap`` closes the group it joins), and, for ``ahead = 1``:

    - every forward gather of group ``g`` is tied to a token of the first use of
      group ``g - 1``: they may start while that group computes, and no
      earlier, and being tied to one value, XLA:GPU merges them into one
      collective (their combiner key names the group: :func:`_use`);
    - each use outputs a zero token (:class:`_Token`), which the first use of
      group ``g + 2`` takes: in the backward pass that use, the last of group
      ``g + 2`` to run, hands a cotangent back for it as it starts, and group
      ``g``'s backward gathers are tied to those (merged, likewise), so they run
      while group ``g + 1``'s backward computes. The last groups' tokens are
      taken by the trace's output (:meth:`finish`): from the start of the
      backward pass;
    - a loop over layers (:meth:`boundary`) ends a group: the first group after
      it is not gathered before the loop, and the groups before it are not
      gathered for the backward pass before the backward loop.

    A later use whose backward never runs (its outputs reach no loss: an
    ``aux`` metric) hands back a symbolic zero; the gathers tied to it then
    wait for their own uses' cotangents, as they would unprefetched.

    Without ``ahead`` (CPU, whose collectives block, so an early gather hides
    nothing) a gather is tied to its own use's inputs, and its backward one to
    its own cotangent.
    """

    def __init__(
        self, ahead: int, cap: int = 0, barrier: bool = False, keep_last: bool = False
    ) -> None:
        self.ahead = ahead
        self.cap = cap
        self.barrier = barrier  # ties read no element (:func:`_tied`)
        self.keep_last = keep_last  # the last group is not gathered again (:meth:`keeps`)
        self.groups: list[_Group] = []

    def keeps(self, group: int | None) -> bool:
        """Whether the uses of ``group`` keep their gathered values for their backward pass.

        With ``keep_last`` (a trace outside loops, with groups), the forward pass's
        last group (the output layer, where it closes a group) is used again as
        soon as the backward pass starts: its backward gather, tied to the loss,
        would have nothing to hide behind. Its gathered values are kept instead,
        as FSDP2 keeps its root module's parameters unsharded after the forward
        pass. A group before a loop over layers is never the last. Read when the
        backward pass is traced, once the forward pass has made every group.
        """
        last = len(self.groups) - 1
        return (
            self.keep_last and group is not None and group == last and not self.groups[last].sealed
        )

    def join(self, nbytes: int, others: list[Any]) -> tuple[Any, list[_Token], _Token, int | None]:
        """A use of ``nbytes`` of shards joins a group.

        Returns its forward anchor, the tokens it takes, its own token, and its
        group's index (None without ``ahead``).
        """
        mine = _Token()
        if not self.ahead:
            return _token(others, self.barrier), [], mine, None
        taken: list[_Token] = []
        if not self.groups or self.groups[-1].nbytes >= self.cap:
            self.groups.append(_Group(_token(others, self.barrier)))
            back = len(self.groups) - 2 - self.ahead
            if back >= 0 and not self.groups[back].sealed:
                taken = self.groups[back].tokens
        index = len(self.groups) - 1
        self.groups[index].nbytes += nbytes
        self.groups[index].tokens.append(mine)
        for token in taken:
            token.taken = True
        return self.groups[max(index - self.ahead, 0)].anchor, taken, mine, index

    def boundary(self, outs: list[Any]) -> None:
        """A loop over layers ran: the next group's gathers wait for its outputs.

        Tied one group back, the first group after a loop would otherwise be
        gathered before the loop (the output layer, whole through every layer),
        and the last group before it, whose tokens a use after the loop would
        take, gathered for the backward pass before the backward loop. The
        groups before the loop are sealed: their backward gathers wait for their
        own uses' cotangents.
        """
        if self.ahead:
            for group in self.groups:
                group.sealed = True
            group = _Group(_token(outs, self.barrier))
            group.nbytes = self.cap
            self.groups.append(group)

    def finish(self, outs: list[Any]) -> list[Any]:
        """``outs`` (a trace's outputs), taking the tokens no use took (:func:`_collect`)."""
        left = [t for g in self.groups if not g.sealed for t in g.tokens if not t.taken]
        return _collect(outs, left) if left else outs


def _collect(outs: list[Any], tokens: list[_Token]) -> list[Any]:
    """``outs``, whose backward pass hands ``tokens`` their cotangents as it starts.

    The last groups' tokens, which no later use takes (:class:`_Prefetch`), are
    taken by an identity on the trace's first floating output (the loss; in a
    loop body, what the iteration returns). Its backward returns, for each, a
    zero made from a saved element of that output: there from the start of the
    backward pass (of the iteration), and never a constant, which would leave
    the gathers tied to it free to run anywhere, the forward pass included.
    """
    i = next(
        (i for i, x in enumerate(outs) if getattr(x, "size", 0) and _inexact(x)),
        None,
    )
    if i is None:
        return outs
    for token in tokens:
        token.taken = True

    @jax.custom_vjp
    def collect(x: Any, taken: list[Any]) -> Any:
        return x

    def fwd(x: Any, taken: list[Any]) -> tuple[Any, Any]:
        return x, jnp.ravel(x)[0]

    def bwd(element: Any, ct: Any) -> tuple[Any, list[Any]]:
        return ct, [_finite_zero(element) for _ in tokens]

    collect.defvjp(fwd, bwd)
    return [*outs[:i], collect(outs[i], [t.value for t in tokens]), *outs[i + 1 :]]


def _inexact(x: Any) -> bool:
    """Whether ``x`` is a floating (or complex) array."""
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _arrays(to: Any) -> list[Any]:
    """The non-empty arrays of ``to``: what a barrier tie waits for (:func:`_tied`)."""
    return [x for x in jax.tree.leaves(to) if getattr(x, "size", 0)]


def _first_number(to: Any) -> Any:
    """One element of the first numeric array of ``to`` (None if it has none)."""
    x = next(
        (
            x
            for x in jax.tree.leaves(to)
            if getattr(x, "size", 0) and jnp.issubdtype(x.dtype, jnp.number)
        ),
        None,
    )
    # Indexed, not raveled: a reshape of an activation split over a model axis (a
    # tensor-parallel layer's) would make XLA all-gather it over that axis first.
    return None if x is None else x[(0,) * x.ndim]


def _token(to: Any, barrier: bool = False) -> Any:
    """:func:`_first_number` of ``to``, no gradient through it (a prefetch anchor).

    With ``barrier``, :func:`_zero` of ``to``: a scalar that reads no element.
    """
    if barrier:
        return _zero(jax.lax.stop_gradient(to), barrier)
    x = _first_number(to)
    return None if x is None else jax.lax.stop_gradient(x)


def _zero(to: Any, barrier: bool = False) -> Any:
    """A float32 zero computed from one element of ``to`` (a constant if it has none).

    Zero even where that element is not finite (``0 * inf`` is NaN), so a tie to it
    never changes a value. With ``barrier``, a zero passed through an optimization
    barrier with the whole of ``to`` (:func:`_tied`): it exists once ``to`` does.
    """
    if barrier:
        leaves = _arrays(to)
        zero = jnp.zeros((), jnp.float32)
        if not leaves:
            return zero
        # Typed as an element of ``to`` would be (varying over its axes): a custom
        # VJP checks that a token's cotangent has its primal's type.
        axes = sorted(frozenset().union(*(compat.varying_axes(x) for x in leaves)))
        zero = vary(zero, tuple(axes)) if axes else zero
        return jax.lax.optimization_barrier((leaves, zero))[1]
    x = _first_number(to)
    return jnp.zeros((), jnp.float32) if x is None else _finite_zero(x)


def _finite_zero(x: Any) -> Any:
    """``0 * x`` as float32, computed from ``x`` (a scalar), and 0 where ``x`` is not finite."""
    return (jnp.where(jnp.isfinite(x), x, 0) * 0).astype(jnp.float32)


def _use(eqn: Any, values: list[Any], prefetch: _Prefetch) -> list[Any]:
    """``eqn`` on ``values``, some lazy: gathered just before it, again in its backward.

    A custom VJP whose residuals are the equation's other inputs and the shards
    (and, with ``keep_last``, the gathered inputs, which only the last group's
    backward pass reads: for any other use XLA frees them after the equation);
    the gradient of the shards is the all-gather's transpose, a reduce-scatter.
    Besides the equation's outputs it returns a zero token (:class:`_Token`).
    The forward gather is tied to the anchor :class:`_Prefetch` gives, the
    backward one to the cotangent a later use hands back for this use's token,
    or to its own cotangent where no later use took it (:func:`_tied`). On GPU
    both are tagged with their group's combiner key, so XLA merges a group's
    gathers (and its reduce-scatters) into one collective each.
    """
    shards, make = _merge(values)
    lazy = [isinstance(v, _Lazy) for v in values]
    others = [v for v in values if not isinstance(v, _Lazy)]
    nbytes = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shards))
    anchor, taken, mine, group = prefetch.join(nbytes, others)
    barrier = prefetch.barrier
    keep = prefetch.keep_last  # whether the gathered values may be kept (Prefetch.keeps)

    def keyed(way: str) -> Any:
        if group is None:
            return contextlib.nullcontext()
        return compat.combiner_key_scope(f"fdp_{way}_{group}")

    def apply(others: list[Any], shards: tuple[Any, ...]) -> list[Any]:
        return compat.bind_equation(eqn, make(shards, others))

    @jax.custom_vjp
    def run(others: list[Any], shards: tuple[Any, ...], anchor: Any, taken: Any) -> Any:
        return apply(others, shards), _zero(others, barrier)

    def fwd(*primals: Any) -> Any:
        others, shards, anchor, taken = _primal_values(primals)
        with keyed("forward"):
            inputs = make(_tied(shards, anchor, barrier), others)
            outs = compat.bind_equation(eqn, inputs)
        # The gathered values, for a backward pass that keeps them (the last group's);
        # any other's never reads them, and XLA frees them after this equation.
        kept = [x for x, z in zip(inputs, lazy, strict=True) if z] if keep else []
        return (outs, _zero(others, barrier)), (others, shards, anchor, taken, kept)

    def bwd(res: Any, ct: tuple[list[Any], Any]) -> tuple[Any, ...]:
        others, shards, anchor, taken, kept = res
        given, token = ct
        real = [c for c in given if not isinstance(c, SymbolicZero)]
        if not real:  # outputs that reach no loss (symbolic zeros): nothing to do
            return None, None, None, [None for _ in taken]
        # Read when the backward pass is traced, after the whole forward one: by
        # then a later use has taken this use's token, or none will. A symbolic
        # zero: the use that took it has no backward (its outputs reach no loss).
        handed = mine.taken and not isinstance(token, SymbolicZero)
        tie = token if handed else real
        with keyed("backward"):
            tied = _tied(shards, tie, barrier)
            tie_gradients = group is not None
            gathered = kept if prefetch.keeps(group) else None
            grads = _backward(
                eqn, make, lazy, others, tied, given, tie_gradients, barrier, gathered
            )
        # The taken tokens' cotangents, as soon as this backward starts: their
        # uses' backward gathers are tied to them. None (a zero) where this use has
        # no cotangent of its own: a constant would leave those gathers untied.
        if barrier:
            early = [_zero(real, barrier) for _ in taken]
        else:
            x = _first_number(real)
            early = [None if x is None else _finite_zero(x) for _ in taken]
        return (*grads, jax.tree.map(jnp.zeros_like, anchor), early)

    run.defvjp(fwd, bwd, symbolic_zeros=group is not None)
    outs, mine.value = run(others, shards, anchor, [t.value for t in taken])
    return outs


def _primal_values(primals: Any) -> Any:
    """``primals`` as values (``symbolic_zeros=True`` wraps each leaf in ``CustomVJPPrimal``)."""
    return jax.tree.map(
        lambda p: p.value if isinstance(p, CustomVJPPrimal) else p,
        primals,
        is_leaf=lambda p: isinstance(p, CustomVJPPrimal),
    )


def _zeros_like(x: Any) -> Any:
    """A zero cotangent for the output ``x`` (``float0`` for an integer one)."""
    return jnp.zeros_like(x) if _inexact(x) else np.zeros(x.shape, jax.dtypes.float0)


def _backward(
    eqn: Any,
    make: Any,
    lazy: list[bool],
    others: list[Any],
    shards: Any,
    ct: list[Any],
    tie_gradients: bool,
    barrier: bool = False,
    gathered: list[Any] | None = None,
) -> tuple[list[Any], Any]:
    """The cotangents of ``others`` and ``shards`` of ``eqn``, made whole by ``make``.

    With ``tie_gradients`` (GPU), the gathered parameters' cotangents are tied
    to an element of the other inputs' cotangents (:func:`_tied`) before their
    reduce-scatter. A product's
    input cotangent reads the gathered weight (``ct @ w.T``), its weight
    cotangent does not (``x.T @ ct``): untied, XLA:GPU may fuse the gather's
    input (the shard, tied to its token) into the optimizer's update of that
    shard, which needs the shard's whole gradient, and the gather then waits
    for its own use's reduce-scatter: no backward prefetch, and no group's
    gathers merged. Tied, the update depends on the gather and cannot be fused
    with its input. A use whose backward pass needs no gathered value (a bias
    added) still gathers nothing. ``ct`` may hold symbolic zeros
    (``symbolic_zeros=True``): zeros of the outputs' types here. ``gathered``:
    the lazy inputs as the forward pass gathered them (:meth:`_Prefetch.keeps`),
    used instead of gathering them again (the gather's transpose still makes
    the shards' gradient).
    """

    def pick(xs: list[Any], gathered: bool) -> list[Any]:
        return [x for x, z in zip(xs, lazy, strict=True) if z == gathered]

    made, gather_vjp = jax.vjp(lambda s: pick(make(s, others), True), shards)
    if gathered is not None:
        # The gather above then has no use and XLA drops it, where ``make`` is linear
        # in it (a gather, a cast, a transpose); a parameter-only computation that is
        # not (``exp`` of a log-scale) still needs it for its VJP: the right gradient,
        # the gather kept.
        made = gathered
    parts = (iter(made), iter(others))
    inputs = [next(parts[0]) if z else next(parts[1]) for z in lazy]
    outs, eqn_vjp = jax.vjp(lambda xs: compat.bind_equation(eqn, xs), inputs)
    real = [
        _zeros_like(o) if isinstance(c, SymbolicZero) else c for o, c in zip(outs, ct, strict=True)
    ]
    (d_inputs,) = eqn_vjp(real)
    d_made, d_others = pick(d_inputs, True), pick(d_inputs, False)
    if tie_gradients:
        d_made = list(_tied(tuple(d_made), d_others, barrier))
    (d_shards,) = gather_vjp(d_made)
    return d_others, d_shards


def _gathered(
    shard: Any,
    dim: int,
    axis_name: AxisName,
    make: Any = None,
    low: Any = None,
    layout: P = WHOLE,
) -> _Lazy:
    """``shard`` all-gathered along ``dim``, lazily; ``make`` does it (default: all_gather).

    ``low``: a dtype a floating shard is gathered in (:func:`fdp.step.grads._mixed.low_gather`).
    ``layout``: the leaf's split over the model axes; with one, it is gathered on
    its blocks (:func:`fdp.step.layout._zero.gather_leaf`) and ``make`` is not used.
    """

    def gather_one(s: tuple[Any, ...]) -> Any:
        return gather_leaf(s[0], dim, axis_name, layout)

    whole = gather_one if len(layout) else make or gather_one
    if low is not None and jnp.issubdtype(shard.dtype, jnp.floating):
        cast = low_gather(lambda x, w=whole: w((x,)), low)
        whole = lambda s: cast(s[0])  # noqa: E731
    return _Lazy((shard,), whole, lambda: _layer_shards(shard, dim, axis_name, low, layout))


def _layer_shards(
    shard: Any, dim: int, axis_name: AxisName, low: Any = None, layout: P = WHOLE
) -> tuple[Any, Callable[[Any], _Lazy]] | None:
    """A stacked parameter's shards with a share of every layer, and one layer's lazy value.

    A leaf split along a dimension other than the layer axis (0) already holds
    a share of every layer: layer ``i``'s share is ``shard[i]``, gathered along
    ``dim - 1`` (fdp's rule splits stacks of three or more dimensions so where
    it can). A leaf split along the layer axis (a ``[L, d]`` stack) holds whole
    layers (device ``k`` the ``k``-th block of them); one all-to-all re-splits it along its
    first other dimension that the axis size divides, so that each layer is
    again one all-gather away. Its transpose, an all-to-all back, returns the
    gradient to the leaf's own layout after the backward loop. None where no
    dimension qualifies (the stack is then gathered whole, before the loop).
    """
    if dim > 0:
        layer = P(*tuple(layout)[1:])  # one layer's split over the model axes
        return shard, lambda x: _gathered(x, dim - 1, axis_name, low=low, layout=layer)
    if len(layout):  # an all-to-all would meet the model split as a plain gather does
        return None
    n = axis_size(axis_name)
    split = next((d for d in range(1, shard.ndim) if shard.shape[d] % n == 0), None)
    if split is None:
        return None
    moved = jax.lax.all_to_all(shard, axis_name, split, 0, tiled=True)
    return moved, lambda x: _gathered(x, split - 1, axis_name, low=low)


class Use:
    """Runs an equation that mixes lazy parameters with other values.

    ``run(eqn, values, prefetch)`` does it (default :func:`_use`: gathered just
    before, again in the backward pass). It keeps the prefetch state
    (:class:`_Prefetch`) of one trace: a loop body is another trace, whose
    activations must not anchor gathers outside it, so it gets its own
    (:meth:`inside`).
    """

    def __init__(
        self,
        ahead: int = 0,
        run: Callable[[Any, list[Any], _Prefetch], list[Any]] | None = None,
        cap: int = 0,
        barrier: bool = False,
        keep_last: bool = False,
    ) -> None:
        self.prefetch = _Prefetch(ahead, cap, barrier, keep_last)
        self.run = _use if run is None else run

    def __call__(self, eqn: Any, values: list[Any]) -> list[Any]:
        return self.run(eqn, values, self.prefetch)

    def inside(self) -> Use:
        """The same, with prefetch state of its own (for a loop body).

        A loop body keeps no group gathered (``keep_last``): its residuals are
        stacked over the iterations, every layer's gathered values.
        """
        return Use(self.prefetch.ahead, self.run, self.prefetch.cap, self.prefetch.barrier)


def _scan(eqn: Any, values: list[Any], use: Use) -> list[Any] | None:
    """A ``scan`` over stacked parameters, each layer made inside the loop body.

    The scan is run again with each lazy scanned-over input (a layer stack)
    replaced by what its :attr:`_Lazy.layers` gives (at stage 3, its per-layer
    shards): the body sees layer ``i`` as a lazy value, so its uses in the body
    (``use``: :func:`_use` at stage 3) gather that one layer, in the forward
    loop and again in the backward loop, whose reduce-scatter sends that
    layer's gradient share as the loop produces it. Lazy constants (parameters
    broadcast to every iteration) stay lazy in the body: made per use, in every
    iteration. None where this does not apply (no stacked parameter, one
    carried through the loop, or one with no per-layer form): the caller makes
    what the scan needs before it.
    """
    parts = compat.scan_parts(eqn)
    split = parts.num_consts + parts.num_carry
    consts, carry, xs = values[: parts.num_consts], values[parts.num_consts : split], values[split:]
    stacked = [i for i, x in enumerate(xs) if isinstance(x, _Lazy)]
    if not stacked or any(isinstance(x, _Lazy) for x in carry):
        return None
    layers: dict[int, tuple[Any, Callable[[Any], _Lazy]]] = {}
    for i in stacked:
        layer = xs[i].layers() if xs[i].layers is not None else None
        if layer is None:
            return None
        layers[i] = layer
    loop_xs = [layers[i][0] if i in layers else x for i, x in enumerate(xs)]

    def body(carry: list[Any], sliced: list[Any]) -> tuple[list[Any], list[Any]]:
        layer = [layers[i][1](x) if i in layers else x for i, x in enumerate(sliced)]
        inner, own = parts.body, use.inside()
        args = [*consts, *carry, *layer]
        outs = own.prefetch.finish(_interpret(inner.jaxpr, list(inner.consts), args, {}, own))
        return outs[: parts.num_carry], outs[parts.num_carry :]

    # Unrolled, a body's copies would share its gather groups' combiner keys, and
    # XLA:GPU would merge the groups of several layers: one trip per layer instead.
    unroll = 1 if use.prefetch.ahead else parts.unroll
    new_carry, ys = jax.lax.scan(
        body, carry, loop_xs, length=parts.length, reverse=parts.reverse, unroll=unroll
    )
    return [*new_carry, *ys]


def _interpret(
    jaxpr: Any,
    consts: list[Any],
    args: list[Any],
    deferred: dict[int, Callable[[Any], _Lazy]],
    use: Use,
) -> list[Any]:
    """Runs ``jaxpr`` with the outputs of the ``deferred`` equations kept lazy until used.

    ``deferred`` maps an equation (by ``id``) to the lazy value of its output,
    made from its first input (at stage 3: the all-gathers of the shards).
    ``use(eqn, values)`` runs an equation that mixes lazy values with others.
    """

    def rule(eqn: Any, values: list[Any]) -> list[Any]:
        lazy = [isinstance(x, _Lazy) for x in values]
        literal = [isinstance(v, jex.Literal) for v in eqn.invars]
        if id(eqn) in deferred:
            return [deferred[id(eqn)](values[0])]
        if not any(lazy):
            return compat.bind_equation(eqn, values)
        if (inner := compat.inlinable_call(eqn)) is not None:  # a jit inside: its own uses
            return _interpret(inner.jaxpr, list(inner.consts), values, {}, use)
        if all(z or c for z, c in zip(lazy, literal, strict=True)):
            # Parameters (and constants) only, a transpose or a cast: still deferred.
            shards, make = _merge(values)
            consts = [x for x, z in zip(values, lazy, strict=True) if not z]
            return [
                _Lazy(
                    shards,
                    lambda s, k=k, e=eqn, m=make, c=consts: compat.bind_equation(e, m(s, c))[k],
                )
                for k in range(len(eqn.outvars))
            ]
        if compat.is_scan(eqn) and (layered := _scan(eqn, values, use)) is not None:
            use.prefetch.boundary(layered)
            return layered  # a layer stack: made one layer at a time, inside the loop
        return use(eqn, values)

    result = evaluate(jaxpr, consts, args, rule)
    # A parameter returned as it is (in aux): made whole here.
    return [x.make(x.shards) if isinstance(x, _Lazy) else x for x in result]


def per_use_objective(
    objective: Objective,
    dims: Sequence[int | None],
    axis_name: AxisName,
    *,
    ahead: int = 0,
    group_bytes: int = 0,
    gather_dtype: Any = None,
    layouts: Sequence[P] = (),
    barriers: bool = False,
) -> Objective:
    """``objective`` taking stage 3's shards, each parameter gathered at each of its uses.

    The objective is traced once with every sharded leaf gathered at its start;
    the traced program is then run again with those gathers deferred to the
    equations that use their results (:func:`_use`). Its gradient with respect
    to a sharded leaf is the *sum* over the data axis of the local gradients,
    this device's share; :func:`finish_gradients` makes it the mean.
    ``gather_dtype``: the dtype floating shards are gathered in (mixed
    precision, :mod:`fdp.step.grads._mixed`); their gradients stay in theirs.
    ``layouts``: per leaf, its split over the model axes (empty: none), on whose
    blocks it is gathered and its gradient scattered
    (:func:`fdp.step.layout._zero.gather_leaf`). ``barriers``: the gathers are
    tied to the activations with optimization barriers, which read no element of
    them (:func:`_tied`; on GPU, with model axes, where XLA keeps barriers).
    """
    laid = tuple(layouts) or (WHOLE,) * len(dims)

    def traced(shards: Any, micro: Any, carry: Any, key: Any) -> tuple[Any, Any, Any]:
        leaves, treedef = jax.tree.flatten(shards)
        whole = [
            x if d is None else gather([x], [d], axis_name)[0]
            for x, d in zip(leaves, dims, strict=True)
        ]
        loss, aux, new_carry = objective(jax.tree.unflatten(treedef, whole), micro, carry, key)
        return loss, jax.tree.map(jnp.asarray, aux), new_carry

    def run(shards: Any, micro: Any, carry: Any, key: Any) -> tuple[Any, Any, Any]:
        args = (shards, micro, carry, key)
        closed, shape = jax.make_jaxpr(traced, return_shape=True)(*args)
        jaxpr = closed.jaxpr
        flat = jax.tree.leaves(args)
        sharded = {v: d for v, d in zip(jaxpr.invars, dims, strict=False) if d is not None}
        layout = dict(zip(jaxpr.invars, laid, strict=False))
        # The gathers `traced` made: all-gathers of the sharded leaves themselves.
        gathers = {
            id(e): functools.partial(
                _gathered,
                dim=sharded[e.invars[0]],
                axis_name=axis_name,
                make=lambda s, e=e: compat.bind_equation(e, list(s))[0],
                low=gather_dtype,
                layout=layout[e.invars[0]],
            )
            for e in jaxpr.eqns
            if compat.is_all_gather(e)
            and not isinstance(e.invars[0], jex.Literal)
            and e.invars[0] in sharded
        }
        cap = group_bytes // axis_size(axis_name)  # in bytes of shards
        # With groups (GPU), the forward pass's last group stays gathered for the backward.
        use = Use(ahead, cap=cap, barrier=barriers, keep_last=ahead > 0)
        outs = use.prefetch.finish(_interpret(jaxpr, list(closed.consts), flat, gathers, use))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def finish_gradients(
    grads: Any,
    plan: BucketPlan,
    dims: Sequence[int | None],
    done: frozenset[int],
    axis_name: AxisName,
    *,
    flat: bool = False,
) -> Any:
    """The mean gradients, as the default hook gives them, from partly reduced ones.

    ``grads`` holds, per leaf of ``done``, the sum over the data axis already
    (reduced in the backward pass: this device's share at stage 3 and for a
    scanned stack at stages 1-2, the whole sum for one at stage 0), and per
    other leaf this device's local gradient. Sums are divided by ``N`` (after
    the sum, where the hook divides before: the same values for ``N`` a power
    of two, else within rounding); local gradients are reduced bucket by bucket
    as the default hook reduces them (:func:`fdp.hooks._contract.mean_reduce_scatter`:
    reduce-scattered along ``dims[i]``, all-reduced where it is None, ``flat``
    for the flat layout); leaves in no bucket get zeros, as
    :func:`fdp.hooks.reduce_with_hook` gives them.
    """
    n = axis_size(axis_name)
    leaves, treedef = jax.tree.flatten(grads)
    out = [no_gradient(plan, i, dims[i], n) for i in range(len(leaves))]
    for bucket in plan.buckets:
        rest = [i for i in bucket.leaf_indices if i not in done]
        with jax.named_scope(f"fdp_bucket_{bucket.index}"):
            reduced = mean_reduce_scatter(
                [leaves[i] for i in rest],
                [dims[i] for i in rest],
                axis_name,
                flat=flat,
                layout=bucket.layout,
            )
            for i, x in zip(rest, reduced, strict=True):
                out[i] = x
            for i in bucket.leaf_indices:
                if i in done:
                    out[i] = leaves[i] / jnp.asarray(n, leaves[i].dtype)
    return jax.tree.unflatten(treedef, out)
