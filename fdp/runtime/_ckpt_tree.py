"""What a checkpoint holds: NNX objects as state trees; templates checked leaf by leaf."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from fdp._extended import is_extended, to_raw
from fdp.step.core._comm_state import LEGACY_ATTR, NNXCommState

# Top-level keys of ``nnx.state(optimizer)`` in flax 0.12 (plus the comm hook state
# fdp 0.1 set on it).
_OPTIMIZER_KEYS = frozenset({"opt_state", "step", LEGACY_ATTR})
_SHOWN = 8  # differences listed in an error


def is_node(x: Any) -> bool:
    """Whether ``x`` is an NNX object (saved as its ``nnx.State``)."""
    return isinstance(x, nnx.Pytree)


def has_nnx(state: Any) -> bool:
    """Whether ``state`` is, or holds, NNX objects (a model, an optimizer)."""
    return any(is_node(x) for x in jax.tree.leaves(state, is_leaf=is_node))


def refuse_optimizer_alone(state: Any) -> None:
    """Raises if ``state`` would save an NNX optimizer's state without its model.

    In flax 0.12 ``nnx.Optimizer`` no longer holds the model, so
    ``nnx.state(optimizer)`` is the optimizer state and step only: a run
    resumed from it trains on from its freshly initialised parameters.
    """
    fix = (
        "Save the model with it: ckpt.save(step, (model, optimizer)), and restore with "
        "ckpt.restore((model, optimizer)), which updates both in place."
    )
    nodes = [x for x in jax.tree.leaves(state, is_leaf=is_node) if is_node(x)]
    # An fdp.NNXCommState beside the optimizer is no model either.
    nodes = [x for x in nodes if not isinstance(x, NNXCommState)]
    if nodes and all(isinstance(x, nnx.Optimizer) for x in nodes):
        raise ValueError(
            "state holds an nnx.Optimizer but no model: in flax 0.12 an optimizer's state is "
            "its moments and step only, so a run resumed from it would train on from stale "
            f"parameters. {fix}"
        )
    if isinstance(state, Mapping) and state and "opt_state" in state:
        keys = {str(k) for k in state}
        if keys <= _OPTIMIZER_KEYS:
            raise ValueError(
                f"state looks like nnx.state(optimizer) (keys {sorted(keys)}), which in flax "
                "0.12 leaves the model's parameters and buffers out, so a run resumed from it "
                f"would train on from stale parameters. {fix}"
            )


def to_tree(state: Any) -> Any:
    """``state`` with every NNX object replaced by its whole ``nnx.State`` (a pytree of arrays)."""
    return jax.tree.map(lambda x: nnx.state(x) if is_node(x) else x, state, is_leaf=is_node)


def update_nnx(state: Any, restored: Any) -> None:
    """Writes ``restored`` (in the trees :func:`to_tree` made) into ``state``'s NNX objects."""
    nodes = jax.tree.leaves(state, is_leaf=is_node)
    values = jax.tree.structure(state, is_leaf=is_node).flatten_up_to(restored)
    for node, value in zip(nodes, values, strict=True):
        if is_node(node):
            nnx.update(node, value)


def _name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple) -> str:
    """A key path as a checkpoint names it: ``1/opt_state/0/mu``."""
    return "/".join(_name(k) for k in path) or "<root>"


def flat(tree: Any) -> dict[str, Any]:
    """``tree``'s leaves by :func:`path_name`."""
    return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    """The shape and dtype the leaf has on disk (a PRNG key is stored as its key data)."""
    if not isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return None
    if is_extended(leaf):
        data = jax.eval_shape(to_raw, leaf)
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _describe(shape_dtype: tuple[tuple[int, ...], np.dtype]) -> str:
    shape, dtype = shape_dtype
    return f"{dtype.name}{list(shape)}"


def zero_padding(path: str, template: tuple[int, ...], saved: tuple[int, ...]) -> bool:
    """Whether two shapes of one leaf differ only as ZeRO's padding makes them differ.

    The step keeps an optimizer-state leaf that no dimension of the number of
    devices divides padded with zeros at the end of one dimension
    (``fdp.step.layout._padding``); which dimension, and by how much, depends on the
    number of devices. A checkpoint of it restores onto another stage or device
    count by padding or cutting the ends of its dimensions: the leaf's own values
    sit at the start of each dimension, zeros after them. Only optimizer-state
    leaves (an ``opt_state`` in the path) of the same rank qualify: parameters
    are never padded, so a parameter of another shape is still refused (and the
    optimizer state mirrors the parameters).

    Example:
      >>> zero_padding("opt_state/0/mu/b", (16,), (10,)), zero_padding("params/b", (16,), (10,))
      (True, False)
    """
    return "opt_state" in path.split("/") and len(template) == len(saved)


def padded_leaves(template: Any, saved: Any) -> list[str]:
    """The paths whose shapes differ by ZeRO padding only (:func:`zero_padding`)."""
    want, have = flat(template), flat(saved)
    out = []
    for path in sorted(want.keys() & have.keys()):
        t, shape = _shape_dtype(want[path]), getattr(have[path], "shape", None)
        if t is None or shape is None:
            continue
        if t[0] != tuple(shape) and zero_padding(path, t[0], tuple(shape)):
            out.append(path)
    return out


def differences(template: Any, saved: Any) -> list[str]:
    """The leaves where ``template`` and the saved tree metadata disagree, one line each.

    Shapes that differ by ZeRO's padding only (:func:`zero_padding`) agree.
    """
    want, have = flat(template), flat(saved)
    out = []
    for path in sorted(want.keys() | have.keys()):
        if path not in have:
            out.append(f"{path}: in the template, not in the checkpoint")
            continue
        if path not in want:
            out.append(f"{path}: in the checkpoint, not in the template")
            continue
        t = _shape_dtype(want[path])
        meta = have[path]
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if t is None or shape is None or dtype is None:
            continue
        s = (tuple(shape), np.dtype(dtype))
        if t[0] != s[0] and not zero_padding(path, t[0], s[0]):
            out.append(f"{path}: saved {_describe(s)}, template {_describe(t)} (shape differs)")
        elif t[1] != s[1]:
            lossy = "a lossy cast" if np.dtype(t[1]).itemsize < s[1].itemsize else "a cast"
            out.append(
                f"{path}: saved {_describe(s)}, template {_describe(t)} (dtype differs: "
                f"restoring would be {lossy})"
            )
    return out


def mismatch_message(problems: list[str], step: int, step_dir: str) -> str:
    """The error for a template that does not match checkpoint ``step``."""
    shown = "\n  ".join(problems[:_SHOWN])
    more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    legacy = ""
    if any(f"/{LEGACY_ATTR}/" in p for p in problems):
        legacy = (
            f"\nThe checkpoint holds a comm hook's state on the optimizer ({LEGACY_ATTR}), "
            "where fdp 0.1 kept it: restore it into (model, optimizer, comm_state) with "
            "comm_state = step.init(model, optimizer), and fdp moves it into comm_state."
        )
    return (
        f"the template passed to restore does not match checkpoint step={step} in {step_dir}; "
        f"{len(problems)} leaf/leaves differ:\n  {shown}{more}{legacy}\nBuild the template "
        "the way the saved state was built (the same model, optimizer, dtypes and comm hook; "
        "for NNX with a stateful hook, (model, optimizer, comm_state) with comm_state = "
        "step.init(model, optimizer)), and cast after restoring if you want other dtypes."
    )
