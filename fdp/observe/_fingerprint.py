"""The DETAIL check: every process is about to run the same step, or an error says why not.

Processes that build different steps (another bucket cap, a leaf of another
shape, another comm hook) issue different collectives, and a mismatched
collective usually hangs. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` all-gathers a
fingerprint of each collective to turn that hang into an error. In fdp one
compiled program holds every collective of a step, so one fingerprint of the
whole step, compared once before the first step, covers them all: the settings,
the bucket plan, every leaf's shape and dtype, the mesh, and a hash of the
lowered program.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import numpy as np

from fdp.runtime._consistency import differences, dtype_name, gather_if_different, listed

CHECK_TIMEOUT = 300.0
"""Seconds the DETAIL check waits for the other processes to reach their first step."""

PROGRAM = "program (StableHLO sha256)"
_SHOWN = 20  # differing fields listed in the message


def step_fingerprint(
    kind: str, config: Any, plan: Any, args: dict[str, Any], lowered: Any
) -> dict[str, str | int | float | bool | None]:
    """What this process is about to run, as a flat ``{field: value}`` dict.

    Args:
      kind: the step's name, e.g. ``"fdp.train_step"``.
      config: the step's bound :class:`fdp.step.StepConfig`; every setting is
        a field.
      plan: the :class:`fdp.step.StepPlan` of this call.
      args: the step's arguments by name (``state``, ``batch``, ...); every
        array leaf gives a field ``name<key path>`` with its dtype and shape.
      lowered: the step's lowered program; its text is hashed.

    Returns:
      Plain values only (str, int, float, bool, None), so that processes can
      exchange and compare them.
    """
    buckets = plan.buckets
    fp: dict[str, Any] = {"step": kind}
    for key, value in config.describe().items():
        fp[key] = value if value is None or isinstance(value, str | int | float) else repr(value)
    fp.update(
        {
            "unused parameters": repr(list(plan.usage.unused_key_paths)),
            "buckets": len(buckets.buckets),
            "bucket caps (bytes)": (
                f"first {buckets.first_bucket_cap_bytes}, then {buckets.bucket_cap_bytes}"
            ),
            "leaves in no bucket": repr(list(buckets.excluded_key_paths)),
        }
    )
    for b in buckets.buckets:
        fp[f"bucket {b.index}"] = (
            f"{b.dtype}, {len(b.leaf_indices)} leaf(s), {b.nbytes} bytes, "
            f"{b.key_paths[0]} .. {b.key_paths[-1]}"
        )
    for name, tree in args.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                key = f"{name}{jax.tree_util.keystr(path)}"
                fp[key] = f"{dtype_name(leaf)}{list(np.shape(leaf))}"
    fp[PROGRAM] = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    return fp


def digest(fingerprint: dict[str, Any]) -> str:
    """A sha256 of a fingerprint (processes compare these first)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def _show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def mismatch_message(fingerprints: list[dict[str, Any]]) -> str:
    """The error for fingerprints that differ: every differing field and its processes."""
    lines = differences(fingerprints, show=_show, last=(PROGRAM,))
    hint = ""
    if lines and all(line.startswith(PROGRAM) for line in lines):
        hint = (
            "\nSettings, buckets and shapes agree but the traced programs differ: the "
            "processes run different code (loss function, model, optimizer or hook settings)."
        )
    return (
        "Detected mismatch between processes before the first step (FDP_DEBUG=DETAIL); "
        "running it would hang or fail in a mismatched collective. Every process must build "
        "the same step with the same settings and shapes. Differences:\n"
        + listed(lines, _SHOWN)
        + hint
    )


def check_across_processes(fingerprint: dict[str, Any], *, timeout: float = CHECK_TIMEOUT) -> str:
    """Compares ``fingerprint`` with every other process's; raises if any differs.

    Every process calls it once, before its first step. The processes exchange
    a hash first, and the whole fingerprints only when the hashes differ.

    Args:
      fingerprint: this process's :func:`step_fingerprint`.
      timeout: seconds to wait for the other processes.

    Returns:
      The agreed digest.

    Raises:
      RuntimeError: the fingerprints differ; the message lists each differing
        field with its value on each process.
      TimeoutError: some processes did not reach the check within ``timeout``.
    """
    mine = digest(fingerprint)
    try:
        gathered = gather_if_different(fingerprint, timeout=timeout)
    except TimeoutError as e:
        raise TimeoutError(
            f"FDP_DEBUG=DETAIL compares every process's step before the first one, but {e} "
            "Every process must run with the same FDP_DEBUG and reach its first step."
        ) from None
    if gathered is None:
        return mine
    raise RuntimeError(mismatch_message(gathered))
