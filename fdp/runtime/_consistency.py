"""Checking, before training, that every process built the same state.

DDP verifies parameter shapes across ranks before its first broadcast
(``_verify_param_shape_across_processes``): a broadcast of mismatched tensors
would hang or fail obscurely. fdp does the same for any pytree, and names the
leaf by its key path and the processes on each side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fdp.runtime import _host

_SHOWN = 10  # mismatching leaves listed in the message


def dtype_name(x: Any) -> str:
    """The dtype of an array or scalar, as a string."""
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
        (jax.tree_util.keystr(path) or "<root>", tuple(np.shape(x)), dtype_name(x))
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def gather_if_different(value: Any, *, timeout: float, purpose: str) -> list[Any] | None:
    """Every process's ``value`` if they differ, else None (one process: None).

    The processes exchange a sha256 of ``repr(value)`` first, and the values
    themselves only when the hashes differ, so agreeing is cheap. ``purpose``
    names the exchange to a process at another host collective.
    """
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return None
    digest = hashlib.sha256(repr(value).encode()).hexdigest()
    if len(set(_host.all_gather_object(digest, timeout=timeout, purpose=purpose))) == 1:
        return None
    return _host.all_gather_object(value, timeout=timeout, purpose=purpose)


def differences(
    per_process: Sequence[Mapping[str, Any]],
    *,
    show: Callable[[Any], str] = str,
    absent: str = "(absent)",
    sep: str = "; ",
    last: Sequence[str] = (),
) -> list[str]:
    """One line per key whose value is not the same on every process.

    Args:
      per_process: each process's ``{key: value}``, in process order.
      show: how a value is written.
      absent: what a process without the key shows.
      sep: between the groups of processes that agree.
      last: keys listed after all others (e.g. a hash that differs whenever
        anything else does).

    Example:
      >>> differences([{"bucket_cap_mb": 25.0, "layout": "leaves"},
      ...              {"bucket_cap_mb": 1.0, "layout": "leaves"}])
      ['bucket_cap_mb: 25.0 on process(es) [0]; 1.0 on process(es) [1]']
    """
    keys = list(dict.fromkeys(k for values in per_process for k in values))
    keys = [k for k in keys if k not in last] + [k for k in last if k in keys]
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for process, values in enumerate(per_process):
            shown = show(values[key]) if key in values else absent
            groups.setdefault(shown, []).append(process)
        if len(groups) > 1:
            sides = sep.join(f"{v} on process(es) {ps}" for v, ps in groups.items())
            lines.append(f"{key}: {sides}")
    return lines


def listed(lines: Sequence[str], shown: int) -> str:
    """The first ``shown`` lines, indented, and how many more there are."""
    more = f"\n  ... and {len(lines) - shown} more" if len(lines) > shown else ""
    return "\n".join(f"  {line}" for line in lines[:shown]) + more


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
    purpose = f"the check that the {what} agrees"
    gathered = gather_if_different(leaf_signatures(tree), timeout=timeout, purpose=purpose)
    if gathered is None:
        return
    per_process = [{key: (shape, dtype) for key, shape, dtype in s} for s in gathered]
    problems = differences(
        per_process, show=lambda s: f"{tuple(s[0])} {s[1]}", absent="missing", sep=", "
    )
    if not problems:
        problems = ["the leaves agree, but their order differs (different container types?)"]
    raise ValueError(
        f"the {what} differs across processes; every process must build it with the same "
        f"key paths, shapes and dtypes (process 0's values are then copied to all):\n"
        + listed(problems, _SHOWN)
    )
