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

from fdp.runtime import _host

CHECK_TIMEOUT = 300.0
"""Seconds the DETAIL check waits for the other processes to reach their first step."""

PROGRAM = "program (StableHLO sha256)"
_SHOWN = 20  # differing fields listed in the message


def _dtype(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    return str(dtype if dtype is not None else np.asarray(x).dtype)


def _signature(x: Any) -> str:
    return f"{_dtype(x)}{list(np.shape(x))}"


def step_fingerprint(
    step: Any, kind: str, args: dict[str, Any], lowered: Any
) -> dict[str, str | int | float | bool | None]:
    """What this process is about to run, as a flat ``{field: value}`` dict.

    Args:
      step: a traced train step (it has ``config``, ``plan`` and ``usage``).
      kind: the step's name, e.g. ``"fdp.train_step"``.
      args: the step's arguments by name (``state``, ``batch``, ...); every
        array leaf gives a field ``name<key path>`` with its dtype and shape.
      lowered: the step's lowered program; its text is hashed.

    Returns:
      Plain values only (str, int, float, bool, None), so that processes can
      exchange and compare them.
    """
    cfg, plan, usage = step.config, step.plan, step.usage
    hook = cfg.comm_hook
    fp: dict[str, Any] = {
        "step": kind,
        "mesh": repr(dict(cfg.mesh.shape)),
        "mesh device ids": repr([int(d.id) for d in cfg.mesh.devices.flat]),
        "axis_name": cfg.axis_name,
        "bucket_cap_mb": float(cfg.bucket_cap_mb),
        "first_bucket_cap_mb": float(cfg.first_bucket_cap_mb),
        "layout": cfg.layout,
        "comm_hook": hook.name,
        "comm_hook flags": (
            f"replicated_output={hook.replicated_output}, vma_safe={hook.vma_safe}"
        ),
        "model_averager": repr(getattr(cfg, "model_averager", None)),
        "accumulate_steps": cfg.accumulate_steps,
        "accum_dtype": None if cfg.accum_dtype is None else str(np.dtype(cfg.accum_dtype)),
        "per_example": cfg.per_example,
        "find_unused_parameters": cfg.find_unused_parameters,
        "buffers": cfg.buffers,
        "has_aux": cfg.has_aux,
        "donate": cfg.donate,
        "unused parameters": repr(list(usage.unused_key_paths)) if usage is not None else None,
        "buckets": len(plan.buckets),
        "bucket caps (bytes)": f"first {plan.first_bucket_cap_bytes}, then {plan.bucket_cap_bytes}",
        "leaves in no bucket": repr(list(plan.excluded_key_paths)),
    }
    for b in plan.buckets:
        fp[f"bucket {b.index}"] = (
            f"{b.dtype}, {len(b.leaf_indices)} leaf(s), {b.nbytes} bytes, "
            f"{b.key_paths[0]} .. {b.key_paths[-1]}"
        )
    for name, tree in args.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                fp[f"{name}{jax.tree_util.keystr(path)}"] = _signature(leaf)
    fp[PROGRAM] = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    return fp


def digest(fingerprint: dict[str, Any]) -> str:
    """A sha256 of a fingerprint (processes compare these first)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def _show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


_MISSING = "(absent)"


def differences(fingerprints: list[dict[str, Any]]) -> list[str]:
    """One line per field whose value is not the same on every process.

    Example:
      >>> differences([{"bucket_cap_mb": 25.0, "layout": "leaves"},
      ...              {"bucket_cap_mb": 1.0, "layout": "leaves"}])
      ['bucket_cap_mb: 25.0 on process(es) [0]; 1.0 on process(es) [1]']
    """
    keys = list(dict.fromkeys(k for fp in fingerprints for k in fp))
    if PROGRAM in keys:  # last: it differs whenever anything above does
        keys = [k for k in keys if k != PROGRAM] + [PROGRAM]
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for process, fp in enumerate(fingerprints):
            groups.setdefault(_show(fp[key]) if key in fp else _MISSING, []).append(process)
        if len(groups) > 1:
            sides = "; ".join(f"{value} on process(es) {ps}" for value, ps in groups.items())
            lines.append(f"{key}: {sides}")
    return lines


def mismatch_message(fingerprints: list[dict[str, Any]]) -> str:
    """The error for fingerprints that differ: every differing field and its processes."""
    lines = differences(fingerprints)
    hint = ""
    if lines and all(line.startswith(PROGRAM) for line in lines):
        hint = (
            "\nSettings, buckets and shapes agree but the traced programs differ: the "
            "processes run different code (loss function, model, optimizer or hook settings)."
        )
    more = f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
    return (
        "Detected mismatch between processes before the first step (FDP_DEBUG=DETAIL); "
        "running it would hang or fail in a mismatched collective. Every process must build "
        "the same step with the same settings and shapes. Differences:\n"
        + "\n".join(f"  {line}" for line in lines[:_SHOWN])
        + more
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
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return mine
    try:
        digests = _host.all_gather_object(mine, timeout=timeout)
        if len(set(digests)) == 1:
            return mine
        gathered = _host.all_gather_object(fingerprint, timeout=timeout)
    except TimeoutError as e:
        raise TimeoutError(
            f"FDP_DEBUG=DETAIL compares every process's step before the first one, but {e} "
            "Every process must run with the same FDP_DEBUG and reach its first step."
        ) from None
    raise RuntimeError(mismatch_message(gathered))
