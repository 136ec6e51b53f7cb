"""Checking, before training, that every process built the same state.

DDP verifies parameter shapes across ranks before its first broadcast
(``_verify_param_shape_across_processes``): a broadcast of mismatched tensors
would hang or fail obscurely. fdp does the same for any pytree, and names the
leaf by its key path and the processes on each side.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from fdp.runtime import _host

_SHOWN = 10  # mismatching leaves listed in the message


def _dtype(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    return str(dtype if dtype is not None else np.asarray(x).dtype)


def leaf_signatures(tree: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """``(key path, shape, dtype)`` of every leaf, in flattening order.

    Example:
      >>> import numpy as np
      >>> leaf_signatures({"w": np.zeros((2, 3), np.float32), "step": np.int32(0)})
      [("['step']", (), 'int32'), ("['w']", (2, 3), 'float32')]
    """
    return [
        (jax.tree_util.keystr(path) or "<root>", tuple(np.shape(x)), _dtype(x))
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _describe(key: str, per_process: list[dict]) -> str | None:
    groups: dict[Any, list[int]] = {}
    for process, leaves in enumerate(per_process):
        groups.setdefault(leaves.get(key), []).append(process)
    if len(groups) == 1:
        return None
    sides = []
    for signature, processes in groups.items():
        what = "missing" if signature is None else f"{tuple(signature[0])} {signature[1]}"
        sides.append(f"{what} on process(es) {processes}")
    return f"  {key}: " + ", ".join(sides)


def check_consistent(
    tree: Any, *, what: str = "state", timeout: float = _host.DEFAULT_TIMEOUT
) -> None:
    """Raises if the leaves of ``tree`` differ in key path, shape or dtype across processes.

    Every process calls it with its own ``tree``. It exchanges a 32-byte hash of
    the leaves' key paths, shapes and dtypes (not their values), and the full
    list only when the hashes differ. :func:`fdp.replicate` calls it before it
    broadcasts process 0's values. In a single process it returns at once.

    Args:
      tree: the pytree (parameters, optimizer state, a ``TrainState``).
      what: what ``tree`` is, for the message.
      timeout: seconds to wait for the other processes.

    Raises:
      ValueError: some leaves differ; the message lists each by key path,
        with its shape and dtype and the processes that have it.

    Example:
      >>> import jax.numpy as jnp
      >>> import fdp
      >>> fdp.check_consistent({"w": jnp.zeros((4, 2))})  # one process: nothing to compare
    """
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return
    signatures = leaf_signatures(tree)
    digest = hashlib.sha256(repr(signatures).encode()).hexdigest()
    if len(set(_host.all_gather_object(digest, timeout=timeout))) == 1:
        return
    gathered = _host.all_gather_object(signatures, timeout=timeout)
    per_process = [{key: (shape, dtype) for key, shape, dtype in s} for s in gathered]
    keys = list(dict.fromkeys(key for s in gathered for key, _, _ in s))
    problems = [line for key in keys if (line := _describe(key, per_process)) is not None]
    if not problems:
        problems = ["  the leaves agree, but their order differs (different container types?)"]
    more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    raise ValueError(
        f"the {what} differs across processes; every process must build it with the same "
        f"key paths, shapes and dtypes (process 0's values are then copied to all):\n"
        + "\n".join(problems[:_SHOWN])
        + more
    )
