"""fdp 0.1's NNX checkpoints: the comm hook's state saved on the optimizer, restored beside it.

fdp 0.1 kept a stateful comm hook's state (PowerSGD's) as an attribute it set on
the user's ``nnx.Optimizer``, ``fdp_comm_state``, so ``ckpt.save(n, (model,
optimizer))`` wrote it inside the optimizer's tree. It now lives in an
:class:`fdp.NNXCommState` beside the optimizer, saved as ``(model, optimizer,
comm_state)``. Restoring an old checkpoint into that template moves the hook's
state: the template is read in the old layout (the holder left out, its state
under the optimizer's ``fdp_comm_state``), and the restored value put back in
the holder. Nothing else about the checkpoint changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from fdp.runtime._ckpt_tree import flat, is_node, path_name, to_tree
from fdp.step.core._comm_state import LEGACY_ATTR, NNXCommState


@dataclasses.dataclass(frozen=True)
class Legacy:
    """A template read in fdp 0.1's layout.

    Attributes:
      template: the template without its :class:`NNXCommState` (same objects).
      holder: the :class:`NNXCommState` left out, filled after the restore.
      optimizer: the path of the optimizer in ``template``.
    """

    template: Any
    holder: NNXCommState
    optimizer: tuple


def _nodes(tree: Any, kind: type) -> list[tuple[tuple, Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]
    return [(path, x) for path, x in flat if isinstance(x, kind)]


def _key(k: Any) -> Any:
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.DictKey):
        return k.key
    return None


def _without(tree: Any, path: tuple) -> Any:
    """``tree`` without the entry at ``path`` (in tuples, lists and dicts), or None."""
    key = _key(path[0])
    if key is None:
        return None
    if type(tree) is dict:
        if len(path) == 1:
            return {k: v for k, v in tree.items() if k != key}
        inner = _without(tree[key], path[1:])
        return None if inner is None else {**tree, key: inner}
    if type(tree) in (tuple, list) and isinstance(key, int):
        items = list(tree)
        if len(path) == 1:
            del items[key]
        else:
            inner = _without(items[key], path[1:])
            if inner is None:
                return None
            items[key] = inner
        return tuple(items) if isinstance(tree, tuple) else items
    return None  # a namedtuple or another pytree: not rebuilt


def _at(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[_key(k)]
    return tree


def legacy_layout(template: Any, saved: Any) -> Legacy | None:
    """How to read ``saved`` into ``template`` if it is fdp 0.1's layout of it, else None.

    It is when ``template`` holds one :class:`NNXCommState` (filled, by
    ``step.init``) and one ``nnx.Optimizer`` in tuples, lists or dicts, and the
    checkpoint holds the hook's state under that optimizer's ``fdp_comm_state``.
    """
    holders = _nodes(template, NNXCommState)
    if len(holders) != 1 or holders[0][1].comm_state is None:
        return None
    rest = _without(template, holders[0][0])
    optimizers = [] if rest is None else _nodes(rest, nnx.Optimizer)
    if len(optimizers) != 1:
        return None
    path = optimizers[0][0]
    where = f"{path_name(path)}/{LEGACY_ATTR}/"
    if not any(p.startswith(where) for p in flat(saved)):
        return None
    return Legacy(rest, holders[0][1], path)


def legacy_tree(legacy: Legacy) -> Any:
    """The template's state trees in fdp 0.1's layout (what such a checkpoint holds)."""
    tree = to_tree(legacy.template)
    # The same HookState variable the holder has: its shape, dtype and sharding.
    _at(tree, legacy.optimizer)[LEGACY_ATTR] = nnx.state(legacy.holder)["comm_state"]
    return tree


def move_restored(legacy: Legacy, restored: Any) -> Any:
    """Puts the restored hook state into the holder; the rest of ``restored``, in place."""
    value = _at(restored, legacy.optimizer).pop(LEGACY_ATTR)
    nnx.update(legacy.holder, nnx.State({"comm_state": value}))
    return restored
