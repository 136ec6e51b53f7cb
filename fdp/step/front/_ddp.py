"""``fdp.ddp``: your own step function made data-parallel, in place of ``jax.jit`` / ``nnx.jit``.

The adoption path for code that already has a step: keep the function, put
``@fdp.ddp(batch_argnums=...)`` where ``@jax.jit`` (or ``@nnx.jit``) was, and
reduce the gradients with ``grads = fdp.reduce_gradients(grads)`` right after
taking them. The arguments at ``batch_argnums`` are split over the data axis,
everything else is replicated (nothing is guessed from shapes), and the
function runs once per device on its share (``jax.shard_map`` with pmap's
semantics: ``jax.grad`` gives per-device gradients and fdp's bucketed mean is the
one reduction).

What comes back is decided per output leaf, from how it depends on the data. A
first, abstract trace (with JAX's replication tracking on) tells leaves that are
the same on every device from those that are not:

- the same on every device (updated parameters, optimizer state, a step count):
  returned as they are;
- different per device, with the local batch's leading size (logits, per-example
  losses): gathered along the batch, in the batch's order;
- different per device otherwise: floats averaged over the devices, integers and
  bools summed (counts add up), as ``fdp.train_step`` does with ``aux``;
- the variables of an ``nnx.Metric`` (totals, counts) add up their changes over
  the devices, as torchmetrics' sync does, so ``metrics.compute()`` is the whole
  batch's; other NNX variables that change per device (BatchNorm statistics)
  take device 0's values, like DDP's ``broadcast_buffers``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fdp import _compat
from fdp.collectives import is_varying
from fdp.collectives._axis import AxisName
from fdp.data._placement import DATA_AXIS, axis_names_of, check_axis, default_mesh
from fdp.hooks._bucketed import REDUCTION_TRACE, ReductionTrace
from fdp.step.core._core import reduce_leaf, sync_buffers
from fdp.step.core._in_flight import InFlight
from fdp.step.core._runner import in_flight, signature
from fdp.step.grads._keys import is_key, per_device

# REDUCE is fdp.train_step's rule for aux (floats averaged, counts summed) and FIRST its
# 'broadcast' buffers (device 0's): both from fdp.step.core._core, not written again here.
SAME, GATHER, REDUCE, FIRST, ADD_CHANGES = "same", "gather", "reduce", "first", "add"


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The static part of one call's shapes: what is split and how each output returns."""

    graphdef: Any  # the NNX objects' graph (None without any)
    node_positions: tuple[int, ...]  # arguments that are NNX objects
    # Per argument: split over the data axis (True), replicated (False), or per leaf.
    batch: tuple[bool | tuple[bool, ...], ...]
    metric_leaves: tuple[bool, ...]  # per NNX state leaf: inside an nnx.Metric
    statics: tuple[tuple[int, Any], ...] = ()  # (position, value) of static arguments
    keywords: tuple[str, ...] = ()  # names of the trailing arguments passed by keyword
    out_treedef: Any = None
    out_rules: tuple[str, ...] = ()
    state_rules: tuple[str, ...] = ()
    # The program takes the call's arguments as given and returns its outputs' tree: no
    # NNX objects, static or keyword arguments, nor an in-flight bound to feed. Then a
    # call like the last one is that program's call alone (jit's cost).
    alone: bool = False

    @property
    def call(self) -> tuple:
        """What a call's arguments decide, before their shapes: compared with the next call's."""
        return (self.graphdef, self.node_positions, self.batch, self.statics, self.keywords)

    def __hash__(self) -> int:
        # jit hashes its static arguments on every call: compute it once.
        try:
            return self.__dict__["_hash"]
        except KeyError:
            fields = dataclasses.fields(self)
            value = hash(tuple(getattr(self, f.name) for f in fields))
            object.__setattr__(self, "_hash", value)
            return value


@dataclasses.dataclass(frozen=True)
class _CallShape:
    """What a call's argument types decide (:meth:`DDPFunction._call_shape`)."""

    static: tuple[int, ...]  # positions of static arguments
    nodes: tuple[int, ...]  # positions of NNX objects
    batch: tuple[bool, ...]  # per argument: named by batch_argnums


def _is_node(x: Any) -> bool:
    return nnx.graph.is_graph_node(x)


def _leaf_flags(batch: bool | tuple[bool, ...], arg: Any) -> tuple[bool, ...]:
    """Per leaf of ``arg``: whether it is split over the data axis."""
    if isinstance(batch, tuple):
        return batch
    return (batch,) * len(jax.tree.leaves(arg))


def _arg_spec(batch: bool | tuple[bool, ...], arg: Any, data: P) -> Any:
    """``arg``'s ``in_specs`` entry: one spec, or one per leaf where some are replicated."""
    if not isinstance(batch, tuple):
        return data if batch else P()
    treedef = jax.tree.structure(arg)
    return jax.tree.unflatten(treedef, [data if b else P() for b in batch])


def _metric_leaves(nodes: tuple, state: Any) -> tuple[bool, ...]:
    """Per leaf of ``state``: whether it belongs to an ``nnx.Metric``."""
    metric_paths = [
        tuple(path) for path, node in nnx.iter_graph(nodes) if isinstance(node, nnx.metrics.Metric)
    ]
    flags = []
    for path, _ in nnx.to_flat_state(state):
        flags.append(any(tuple(path[: len(m)]) == m for m in metric_paths))
    return tuple(flags)


def _flatten_out(out: Any) -> tuple[list[Any], Any]:
    leaves, treedef = jax.tree.flatten(out)
    return [jnp.asarray(x) if not isinstance(x, jax.Array) else x for x in leaves], treedef


def _out_paths(out: Any) -> list[str]:
    """``jax.tree_util.keystr`` of every output leaf (``output_reduction`` reads them)."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]


SUM = "sum"  # a per-device value summed over the devices (output_reduction='sum')


def _out_rule(x: Any, axis: AxisName, local_rows: frozenset[int], summed: bool) -> str:
    if not is_varying(x, axis):
        return SAME
    if is_key(x) or (not jnp.issubdtype(x.dtype, jnp.number) and x.dtype != jnp.bool_):
        return FIRST
    if jnp.ndim(x) >= 1 and jnp.shape(x)[0] in local_rows:
        return GATHER
    return SUM if summed else REDUCE


def _state_rule(x: Any, in_metric: bool, axis: AxisName) -> str:
    # A metric's totals and counts add up over devices, all of them: a count raised by
    # the local batch's (static) size is the same on every device and still counts
    # only that device's examples.
    if in_metric and jnp.issubdtype(x.dtype, jnp.number):
        return ADD_CHANGES
    return SAME if not is_varying(x, axis) else FIRST


def _apply_rule(rule: str, x: Any, old: Any, axis: AxisName) -> Any:
    if rule in (SAME, GATHER):
        return x
    if rule == REDUCE:
        return reduce_leaf(x, axis)
    if rule == SUM:
        return jax.lax.psum(x, axis)
    if rule == ADD_CHANGES:
        return old + jax.lax.psum(x - old, axis)
    return sync_buffers(x, "broadcast", axis)


class DDPFunction:
    """A step function made data-parallel by :func:`fdp.ddp`; call it as the function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        mesh: Mesh | None,
        axis_name: AxisName,
        batch_argnums: tuple[int, ...],
        *,
        static_argnums: tuple[int, ...] = (),
        static_argnames: tuple[str, ...] = (),
        output_reduction: str | Callable[[str], str] = "mean",
        replicated_leaves: Callable[[int, str], bool] | None = None,
        donate_argnums: tuple[int, ...] = (),
    ):
        self.fn = fn
        functools.update_wrapper(self, fn)
        self._mesh = mesh
        self._axis_name = axis_name
        self._batch_argnums = batch_argnums
        self._static_argnums = static_argnums
        self._static_argnames = static_argnames
        self._output_reduction = output_reduction
        self._replicated_leaves = replicated_leaves
        self._donate_argnums = donate_argnums
        self._leaf_flags: dict[Any, tuple] = {}  # _split_leaves, per argument structure
        self._call_shapes: dict[Any, _CallShape] = {}  # _call_shape, per argument types
        self._layouts: dict[Any, tuple[_Layout, Any]] = {}  # layout and program per signature
        self._jitted: Any = None
        self._fast: tuple[_Layout, Any] | None = None  # the last call's layout and program
        self._alone: Any = None  # the last program, where its layout is ``alone``
        self._jitted_alone: Any = None
        self._smallest = 0  # which of its outputs the in-flight bound holds
        self._queue: InFlight | bool | None = False  # False: not decided yet
        try:
            self._signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self._signature = None
        self._arg_names = () if self._signature is None else tuple(self._signature.parameters)

    @property
    def mesh(self) -> Mesh:
        """The mesh (made at the first use: building the step starts no backend)."""
        if self._mesh is None:
            self._mesh = default_mesh(self._axis_name)
        return self._mesh

    def _name(self, i: int) -> str:
        name = self._arg_names[i] if i < len(self._arg_names) else None
        return f"argument {i}" + (f" ({name})" if name else "")

    # -- one device's program -------------------------------------------------------------

    def _body(self, layout: _Layout, keys: Any, state: Any, others: tuple) -> tuple[Any, Any]:
        axis = self._axis_name
        # Each device draws its own random numbers (dropout): key arguments and NNX streams.
        args = [
            a if layout.batch[i] else per_device(a, axis, typed_only=True)
            for i, a in enumerate(others)
        ]
        nodes: tuple = ()
        if layout.graphdef is not None:
            nodes = nnx.merge(layout.graphdef, per_device(keys, axis), state, copy=True)
            for pos, node in zip(layout.node_positions, nodes, strict=True):
                args[pos] = node
        for pos, value in layout.statics:
            args[pos] = value
        split = len(args) - len(layout.keywords)
        out = self.fn(*args[:split], **dict(zip(layout.keywords, args[split:], strict=True)))
        new_state = nnx.split(nodes, nnx.RngKey, ...)[2] if nodes else None
        return out, new_state

    def _specs(self, layout: _Layout, args: tuple) -> tuple:
        data = P(self._axis_name)
        specs = zip(layout.batch, args, strict=True)
        return (P(), P(), tuple(_arg_spec(b, a, data) for b, a in specs))

    def _classify(self, layout: _Layout, keys: Any, state: Any, others: tuple) -> _Layout:
        """Which outputs are the same on every device: an abstract, replication-typed trace."""
        axis, n = self._axis_name, check_axis(self.mesh, self._axis_name)
        rows = frozenset(
            int(np.shape(leaf)[0]) // n
            for a, b in zip(others, layout.batch, strict=True)
            for leaf, split in zip(jax.tree.leaves(a), _leaf_flags(b, a), strict=True)
            if split
        )
        seen: dict[str, Any] = {}

        def body(keys: Any, state: Any, others: tuple) -> tuple:
            out, new_state = self._body(layout, keys, state, others)
            leaves, seen["treedef"] = _flatten_out(out)
            sums = [self._summed(path) for path in _out_paths(out)]
            seen["out"] = tuple(
                _out_rule(x, axis, rows, s) for x, s in zip(leaves, sums, strict=True)
            )
            state_leaves = jax.tree.leaves(new_state)
            seen["state"] = tuple(
                _state_rule(x, m, axis)
                for x, m in zip(state_leaves, layout.metric_leaves, strict=True)
            )
            return ()

        trace = ReductionTrace(typing_only=True)
        token = REDUCTION_TRACE.set(trace)
        try:
            closed = jax.make_jaxpr(
                jax.shard_map(
                    body,
                    mesh=self.mesh,
                    in_specs=self._specs(layout, others),
                    out_specs=(),
                    axis_names=set(axis_names_of(axis)),
                    check_vma=True,
                )
            )(keys, state, others)
        finally:
            REDUCTION_TRACE.reset(token)
        if trace.calls == 0 and _compat.has_auto_reduction(closed.jaxpr):
            raise ValueError(
                f"fdp.ddp: {getattr(self.fn, '__name__', 'the step')} takes gradients but "
                "never calls fdp.reduce_gradients, so each device would apply the gradient of "
                "its own share of the batch and the replicas would drift apart. Add "
                "`grads = fdp.reduce_gradients(grads)` right after taking them."
            )
        return dataclasses.replace(
            layout, out_treedef=seen["treedef"], out_rules=seen["out"], state_rules=seen["state"]
        )

    def _run(self, layout: _Layout, keys: Any, state: Any, others: tuple) -> tuple:
        axis = self._axis_name
        data = P(axis)

        def body(keys: Any, state: Any, others: tuple) -> tuple:
            olds = jax.tree.leaves(state)  # before the step's in-place updates
            out, new_state = self._body(layout, keys, state, others)
            leaves, _ = _flatten_out(out)
            rules = layout.out_rules
            leaves = [_apply_rule(r, x, None, axis) for r, x in zip(rules, leaves, strict=True)]
            if new_state is not None:
                flat, treedef = jax.tree.flatten(new_state)
                flat = [
                    _apply_rule(r, x, o, axis)
                    for r, x, o in zip(layout.state_rules, flat, olds, strict=True)
                ]
                new_state = jax.tree.unflatten(treedef, flat)
            return tuple(leaves), new_state

        out_specs = (tuple(data if r == GATHER else P() for r in layout.out_rules), P())
        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=self._specs(layout, others),
            out_specs=out_specs,
            axis_names=set(axis_names_of(axis)),
            check_vma=False,  # pmap's semantics: jax.grad gives per-device gradients
        )
        return mapped(keys, state, others)

    # -- the call -------------------------------------------------------------------------

    def _batch_flags(self, args: tuple, node_positions: tuple[int, ...]) -> tuple[bool, ...]:
        """Per argument: whether ``batch_argnums`` names it (checked against ``args``)."""
        chosen = set()
        for i in self._batch_argnums:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"fdp.ddp: batch_argnums={self._batch_argnums} names position {i}, but "
                    f"{getattr(self.fn, '__name__', 'the step')} was called with "
                    f"{len(args)} positional arguments."
                )
            if i % len(args) in node_positions:
                raise ValueError(
                    f"fdp.ddp: batch_argnums={self._batch_argnums} names "
                    f"{self._name(i % len(args))}, an NNX object ("
                    f"{type(args[i]).__name__}); NNX objects are replicated and updated in "
                    "place. Name only the batch arguments."
                )
            chosen.add(i % len(args))
        return tuple(i in chosen for i in range(len(args)))

    def _split_leaves(self, args: tuple, batch: tuple[bool, ...]) -> tuple:
        """``batch`` with per-leaf flags where ``replicated_leaves`` keeps some leaves whole."""
        keep = self._replicated_leaves
        if keep is None:
            return batch
        shapes = zip(args, batch, strict=True)
        key = (tuple(jax.tree.structure(a) if b else None for a, b in shapes), batch)
        if key in self._leaf_flags:  # decided once per structure: the key paths are its
            return self._leaf_flags[key]
        if len(self._leaf_flags) >= 64:
            self._leaf_flags.clear()
        out: list[bool | tuple[bool, ...]] = []
        for i, (a, b) in enumerate(zip(args, batch, strict=True)):
            if not b:
                out.append(False)
                continue
            paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
            flags = tuple(not keep(i, path) for path in paths)
            out.append(True if all(flags) else flags)
        self._leaf_flags[key] = tuple(out)
        return self._leaf_flags[key]

    def _check_batch(self, args: tuple, batch: tuple) -> None:
        n = check_axis(self.mesh, self._axis_name)
        for i, (a, b) in enumerate(zip(args, batch, strict=True)):
            if not b:
                continue
            flat = jax.tree_util.tree_flatten_with_path(a)[0]
            for (path, leaf), split in zip(flat, _leaf_flags(b, a), strict=True):
                if not split:
                    continue
                size = np.shape(leaf)[0] if np.ndim(leaf) else None
                if size is None or size % n:
                    raise ValueError(
                        f"fdp.ddp: {self._name(i)} is split over the {n} devices of axis "
                        f"{self._axis_name!r}, but {jax.tree_util.keystr(path) or 'it'} "
                        f"has shape {tuple(np.shape(leaf))}: its leading (batch) size must be a "
                        f"multiple of {n}. Use such a batch size, leave the argument out of "
                        f"batch_argnums={self._batch_argnums} (it is then replicated), or "
                        "replicate this leaf with replicated_leaves=."
                    )

    def _summed(self, path: str) -> bool:
        """Whether the output at ``path`` adds up over the devices (``output_reduction``)."""
        how = self._output_reduction
        rule = how(path) if callable(how) else how
        if rule not in OUTPUT_REDUCTIONS:
            raise ValueError(
                f"fdp.ddp: output_reduction gave {rule!r} for the output {path or '(the output)'}; "
                f"expected one of {OUTPUT_REDUCTIONS}."
            )
        return rule == "sum"

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, tuple[str, ...]]:
        """The call's arguments in the function's order, and the names of those passed by keyword.

        Positional arguments come first, as given; keyword arguments follow in the
        signature's order (``batch_argnums`` and ``static_argnums`` count them by
        their position in the signature, ``static_argnames`` by name).
        """
        if not kwargs:
            return args, ()
        if self._signature is None:
            raise TypeError(
                f"fdp.ddp: {getattr(self.fn, '__name__', 'the step')} has no signature to "
                f"place the keyword arguments {sorted(kwargs)} by; pass them positionally."
            )
        bound = self._signature.bind(*args, **kwargs)
        names = tuple(n for n in self._signature.parameters if n in kwargs)
        return (*args, *(bound.arguments[n] for n in names)), names

    def _static_positions(self, names: tuple[str, ...], count: int, keywords: tuple) -> set[int]:
        chosen = set()
        for i in self._static_argnums:
            if not -count <= i < count:
                raise ValueError(
                    f"fdp.ddp: static_argnums={self._static_argnums} names position {i}, but "
                    f"{getattr(self.fn, '__name__', 'the step')} was called with {count} "
                    "arguments."
                )
            chosen.add(i % count)
        for name in self._static_argnames:
            if name in keywords:
                chosen.add(count - len(keywords) + keywords.index(name))
            elif name in names and names.index(name) < count - len(keywords):
                chosen.add(names.index(name))
        return chosen

    def _program(self, base: _Layout, args: tuple, dynamic: tuple) -> tuple[_Layout, Any]:
        """The layout and program of a call the last one's did not fit (once per signature)."""
        keys, state, others = dynamic
        key = (base.graphdef, base.batch, base.statics, base.keywords, signature(dynamic))
        found = self._layouts.get(key)
        if found is not None:
            return found
        self._check_batch(args, base.batch)
        if base.graphdef is not None:
            nodes = tuple(args[i] for i in base.node_positions)
            base = dataclasses.replace(base, metric_leaves=_metric_leaves(nodes, state))
        layout = self._classify(base, keys, state, others)
        alone = base.graphdef is None and not base.statics and not base.keywords
        layout = dataclasses.replace(layout, alone=alone and self._queue is None)
        if len(self._layouts) >= 64:  # new shapes every call: keep memory bounded
            self._layouts.clear()
        self._layouts[key] = found = (layout, self._compile(layout, keys, state, others))
        return found

    def _run_fast(self, call: tuple, *dynamic: Any) -> tuple[_Layout, Any] | None:
        """The last call's program on ``dynamic``, where ``call`` is laid out as the last one.

        O(number of arguments) in Python: the program checks the arguments'
        signature in C++ and refuses another before anything runs (a
        ``TypeError`` or ``ValueError``), as in :mod:`fdp.step.core._runner`. None:
        the first path plans and compiles.
        """
        if self._fast is None or self._fast[0].call != call:
            return None
        layout, compiled = self._fast
        keys, state, others = dynamic
        try:
            return layout, compiled(keys, state, *others)
        except (TypeError, ValueError):
            return None

    def _run_spread(self, layout: _Layout, keys: Any, state: Any, *others: Any) -> tuple:
        """:meth:`_run` with one jit argument per argument of the call (each can be donated)."""
        return self._run(layout, keys, state, others)

    def _run_alone(self, layout: _Layout, *args: Any) -> Any:
        """:meth:`_run` for an ``alone`` layout: the arguments as given, the outputs' tree."""
        out_leaves, _ = self._run(layout, None, None, args)
        return jax.tree.unflatten(layout.out_treedef, list(out_leaves))

    def _compile(self, layout: _Layout, keys: Any, state: Any, others: tuple) -> Any:
        """The program for ``layout`` and these arguments' signature (jit's caches hold it)."""
        if self._jitted is None:
            donate = self._donate_argnums
            self._jitted = jax.jit(
                self._run_spread, static_argnums=(0,), donate_argnums=tuple(3 + i for i in donate)
            )
            self._jitted_alone = jax.jit(
                self._run_alone, static_argnums=(0,), donate_argnums=tuple(1 + i for i in donate)
            )
        token = REDUCTION_TRACE.set(ReductionTrace())
        try:
            if layout.alone:
                return self._jitted_alone.lower(layout, *others).compile()
            return self._jitted.lower(layout, keys, state, *others).compile()
        finally:
            REDUCTION_TRACE.reset(token)

    def _call_shape(self, args: tuple, keywords: tuple[str, ...]) -> _CallShape:
        """Which arguments are static, NNX objects and batches (once per argument types)."""
        key = (tuple(map(type, args)), keywords)
        shape = self._call_shapes.get(key)
        if shape is None:
            static = tuple(sorted(self._static_positions(self._arg_names, len(args), keywords)))
            kept = tuple(None if i in static else a for i, a in enumerate(args))
            nodes = tuple(i for i, a in enumerate(kept) if _is_node(a))
            self._check_donated(len(args), static, nodes)
            shape = _CallShape(static, nodes, self._batch_flags(kept, nodes))
            if len(self._call_shapes) >= 64:
                self._call_shapes.clear()
            self._call_shapes[key] = shape
        return shape

    def _donated_gone(self, args: tuple) -> bool:
        """Whether an argument at ``donate_argnums`` was donated before (its arrays deleted)."""
        for i in self._donate_argnums:
            leaves = jax.tree.leaves(args[i]) if i < len(args) else []
            gone = getattr(leaves[0], "is_deleted", None) if leaves else None
            if gone is not None and gone():
                return True
        return False

    def _check_alive(self, args: tuple) -> None:
        if self._donated_gone(args):
            names = ", ".join(self._name(i) for i in self._donate_argnums)
            raise RuntimeError(
                f"fdp.ddp: an argument at donate_argnums ({names}) was donated to an earlier "
                "call and its arrays are deleted; pass what that call returned."
            )

    def _check_donated(self, count: int, static: tuple[int, ...], nodes: tuple[int, ...]) -> None:
        """Refuses ``donate_argnums`` naming a missing, static or NNX argument, naming it."""
        for i in self._donate_argnums:
            what = (
                f"the step was called with {count} arguments"
                if i >= count
                else f"{self._name(i)} is static"
                if i in static
                else f"{self._name(i)} is an NNX object, updated in place (nothing to donate)"
                if i in nodes
                else None
            )
            if what is not None:
                raise ValueError(
                    f"fdp.ddp: donate_argnums={self._donate_argnums} names position {i}, but "
                    f"{what}. Name arrays or pytrees of arrays passed positionally."
                )

    def _check_statics(self, statics: tuple[tuple[int, Any], ...]) -> None:
        for i, value in statics:
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"fdp.ddp: {self._name(i)} is static (static_argnums/static_argnames) and "
                    f"must be hashable, as jax.jit's static arguments are; got "
                    f"{type(value).__name__}."
                ) from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        alone = self._alone
        if alone is not None and not kwargs:
            try:  # the last program, taking these arguments as they are: jit's cost
                return alone(*args)
            except (TypeError, ValueError, RuntimeError) as e:
                # Another signature, refused before it ran; or a donated argument passed
                # again (jaxlib 0.11+ raises RuntimeError), named below.
                if isinstance(e, RuntimeError) and not (
                    "deleted" in str(e) and self._donated_gone(args)
                ):
                    raise
        args, keywords = self._bind(args, kwargs)
        if self._donate_argnums:  # jaxlib 0.10 can crash on a deleted array: refuse it first
            self._check_alive(args)
        shape = self._call_shape(args, keywords)
        statics = tuple((i, args[i]) for i in shape.static)
        node_positions = shape.nodes
        nodes: tuple = ()
        graphdef = keys = state = None
        if statics or node_positions:
            args = tuple(None if i in shape.static else a for i, a in enumerate(args))
            nodes = tuple(args[i] for i in node_positions)
            others = tuple(None if i in node_positions else a for i, a in enumerate(args))
        else:
            others = args
        if nodes:
            graphdef, keys, state = nnx.split(nodes, nnx.RngKey, ...)
        batch = self._split_leaves(args, shape.batch)
        # The last call's program where the arguments fit it; else plan and compile.
        call = (graphdef, node_positions, batch, statics, keywords)
        ran = self._run_fast(call, keys, state, others)
        if ran is None:
            self._check_statics(statics)
            if self._queue is False:  # decided at the first call (the mesh's platform)
                self._queue = in_flight(self.mesh)
            base = _Layout(graphdef, node_positions, batch, (), statics, keywords)
            layout, compiled = self._program(base, args, (keys, state, others))
            if layout.alone:
                self._fast, self._alone = None, compiled
                return compiled(*others)
            self._alone = None
            ran = layout, compiled(keys, state, *others)
            self._fast = (layout, compiled)
            sizes = [x.size for x in ran[1][0]]  # the output the in-flight bound holds
            self._smallest = sizes.index(min(sizes)) if sizes else 0
        layout, (out_leaves, new_state) = ran
        if isinstance(self._queue, InFlight) and out_leaves:
            self._queue.hold(out_leaves[self._smallest])
        if nodes:
            nnx.update(nodes, new_state)
        return jax.tree.unflatten(layout.out_treedef, list(out_leaves))


OUTPUT_REDUCTIONS = ("mean", "sum")


def _check_argnums(value: Any, what: str) -> tuple[int, ...]:
    """``static_argnums`` as a tuple of ints, or an error naming it."""
    nums = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(nums, tuple | list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in nums
    ):
        raise TypeError(f"fdp.ddp: {what} must be an int or a tuple of ints, got {value!r}.")
    return tuple(nums)


def _check_argnames(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, tuple | list) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"fdp.ddp: static_argnames must be a str or a tuple of strs, got {value!r}."
        )
    return tuple(names)


def _check_batch_argnums(batch_argnums: Any, fn: Callable[..., Any]) -> tuple[int, ...]:
    """``batch_argnums`` as a tuple of ints; an error naming it (and ``fn``'s arguments) else."""
    name = getattr(fn, "__name__", "step")
    try:
        params = ", ".join(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = "..."
    if batch_argnums is None:
        raise TypeError(
            f"fdp.ddp: batch_argnums is required: name the positions of {name}({params})'s "
            "arguments to split over the data axis, e.g. @fdp.ddp(batch_argnums=(1, 2)) for "
            "step(state, images, labels) or @fdp.ddp(batch_argnums=1) for step(state, batch); "
            "every other argument is replicated. (fdp.ddp no longer guesses the batches from "
            "their shapes: a replicated table with one row per device was split.)"
        )
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums
    if (
        isinstance(batch_argnums, bool)
        or not isinstance(nums, tuple | list)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in nums)
    ):
        raise TypeError(
            "fdp.ddp: batch_argnums must be an int or a tuple of ints (positions of "
            f"{name}({params})'s arguments to split), got {batch_argnums!r}."
        )
    return tuple(nums)


def ddp(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: Mesh | None = None,
    axis_name: AxisName = DATA_AXIS,
    batch_argnums: int | Sequence[int] | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    output_reduction: str | Callable[[str], str] = "mean",
    replicated_leaves: Callable[[int, str], bool] | None = None,
    donate_argnums: int | Sequence[int] = (),
) -> Any:
    """Makes your own step function data-parallel: use it where ``jax.jit`` / ``nnx.jit`` was.

    The function runs on every device with its share of the batch, jitted. Inside
    it, reduce the gradients with ``fdp.reduce_gradients(grads)`` (DDP's bucketed
    mean) before using them; everything else stays as written, metrics updated
    inside included. NNX objects among the arguments (model, optimizer,
    ``nnx.MultiMetric``, ``nnx.Rngs``) are updated in place, as ``nnx.jit`` does,
    and random keys draw different numbers on each device.

    The arguments at ``batch_argnums`` are split over the data axis (their leaves'
    leading size must be a multiple of the number of devices); every other
    argument is replicated, whatever its shape: a lookup table, a ``TrainState``,
    a model. There is no default: which argument is the batch is the one thing
    fdp cannot tell from the arguments (an earlier version guessed from shapes
    and split a replicated table of one row per device). How each output comes
    back (the same on every device, gathered along the batch, averaged or
    summed) is described in the module docs and in docs/porting.md.

    Args:
      fn: the step function (also usable as ``@fdp.ddp(batch_argnums=...)``).
      mesh: the mesh (default: all devices on one ``'data'`` axis), made at the
        first call.
      axis_name: the data axis of ``mesh``.
      batch_argnums: the position (an int) or positions (a tuple) of the
        arguments to split over the data axis; negative positions count from
        the end. Required. Arguments passed by keyword count at their
        position in ``fn``'s signature.
      static_argnums: positions of arguments that are static (hashable Python
        values: a config, a flag), as ``jax.jit``'s: passed to ``fn`` as they
        are, and a new value compiles again.
      static_argnames: the same, by name (for arguments passed by keyword too).
      output_reduction: how an output that differs per device and is not a
        per-example batch comes back: ``'mean'`` (the default: floats averaged,
        integers summed) or ``'sum'`` (added up: a sum of losses and its
        denominator, as lm1b's ``compute_metrics`` returns them); or a function
        of the output's key path (``jax.tree_util.keystr``) giving either.
      replicated_leaves: ``fn(position, key_path) -> bool``: leaves of the batch
        arguments to replicate instead of split (``key_path`` is the leaf's
        ``jax.tree_util.keystr`` inside the argument at ``position``), such as
        a decode cache's scalar ``cache_index`` beside its per-example keys
        and values.
      donate_argnums: positions (non-negative) of arguments whose buffers the
        call may reuse for its outputs, as ``jax.jit``'s: pass ``params`` and
        use the returned ones (a donated argument's arrays are deleted). Not
        static arguments, nor NNX objects (updated in place).

    Returns:
      The data-parallel function, called with the same arguments as ``fn``.

    Raises:
      TypeError: ``batch_argnums`` is missing or not an int or tuple of ints.
      ValueError: (at a call) a batch does not split over the devices,
        ``batch_argnums`` names a missing argument or an NNX object, or ``fn``
        takes gradients without calling ``fdp.reduce_gradients``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import fdp
      >>> @fdp.ddp(batch_argnums=1)
      ... def step(w, x, table):
      ...     loss, grads = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
      ...     grads = fdp.reduce_gradients(grads)
      ...     return w - 0.1 * grads, loss, table.sum()
      >>> w, loss, total = step(jnp.ones(2), jnp.arange(16.0).reshape(8, 2), jnp.arange(1.0, 9.0))
      >>> round(float(loss), 2), w.shape, float(total)
      (309.0, (2,), 36.0)
    """
    if fn is None:
        return functools.partial(
            ddp,
            mesh=mesh,
            axis_name=axis_name,
            batch_argnums=batch_argnums,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            output_reduction=output_reduction,
            replicated_leaves=replicated_leaves,
            donate_argnums=donate_argnums,
        )
    if not callable(fn):
        raise TypeError(f"fdp.ddp: fn must be callable, got {type(fn).__name__}.")
    nums = _check_batch_argnums(batch_argnums, fn)
    if not callable(output_reduction) and output_reduction not in OUTPUT_REDUCTIONS:
        raise ValueError(
            f"fdp.ddp: output_reduction must be one of {OUTPUT_REDUCTIONS} or a function of "
            f"an output's key path, got {output_reduction!r}."
        )
    if mesh is not None:
        check_axis(mesh, axis_name)
    return DDPFunction(
        fn,
        mesh,
        axis_name,
        nums,
        static_argnums=_check_argnums(static_argnums, "static_argnums"),
        static_argnames=_check_argnames(static_argnames),
        output_reduction=output_reduction,
        replicated_leaves=replicated_leaves,
        donate_argnums=_check_donate(donate_argnums),
    )


def _check_donate(value: Any) -> tuple[int, ...]:
    """``donate_argnums`` as a tuple of non-negative ints, or an error naming it."""
    nums = _check_argnums(value, "donate_argnums")
    if any(i < 0 for i in nums):
        raise ValueError(
            f"fdp.ddp: donate_argnums must be non-negative positions, got {value!r} (count "
            "from the first argument)."
        )
    return nums
