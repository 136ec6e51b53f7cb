"""Every process is about to run the same step, or an error says why not.

Processes that build different steps (another bucket cap, a leaf of another
shape, another comm hook or ZeRO stage) issue different collectives, and a
mismatched collective usually hangs. ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
all-gathers a fingerprint of each collective to turn that hang into an error.
In fdp one compiled program holds every collective of a step, so one
fingerprint of the whole step covers them all. It is compared in two parts:

- the settings (every ``StepConfig`` field, the bucket plan, every argument
  leaf's shape and dtype), at the first call of every step at any debug level,
  before anything that needs the processes to agree (placing a ZeRO state,
  setting up the shared-memory all-reduce, tracing): one exchange of a hash,
  once per step;
- a hash of the lowered program, at ``FDP_DEBUG=DETAIL``, after the trace.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import numpy as np

from fdp.runtime._consistency import differences, dtype_name, gather_if_different, listed

CHECK_TIMEOUT = 300.0
"""Seconds the DETAIL check of the program waits for the other processes."""

SETTINGS_TIMEOUT = 1800.0
"""Seconds the check of the settings waits for the other processes to reach their first
step (host collectives' default: a late first step, loading or compiling, is no error)."""

PROGRAM = "program (StableHLO sha256)"
_SHOWN = 20  # differing fields listed in the message


def settings_fingerprint(
    kind: str, config: Any, plan: Any, args: dict[str, Any]
) -> dict[str, str | int | float | bool | None]:
    """What this process is about to run, but for the program, as a flat ``{field: value}``.

    Args:
      kind: the step's name, e.g. ``"fdp.train_step"``.
      config: the step's bound :class:`fdp.step.StepConfig`; every setting is
        a field.
      plan: the :class:`fdp.step.StepPlan` of this call (None: no bucket fields).
      args: the step's arguments by name (``state``, ``batch``, ...); every
        array leaf gives a field ``name<key path>`` with its dtype and shape.

    Returns:
      Plain values only (str, int, float, bool, None), so that processes can
      exchange and compare them.
    """
    fp: dict[str, Any] = {"step": kind}
    for key, value in config.describe().items():
        fp[key] = value if value is None or isinstance(value, str | int | float) else repr(value)
    if plan is not None:
        buckets = plan.buckets
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
        if plan.folds is not None:  # the CPU backend's fold_dots, on
            fp["fold_dots products"] = plan.folds.folded
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
    return fp


def step_fingerprint(
    kind: str, config: Any, plan: Any, args: dict[str, Any], lowered: Any
) -> dict[str, str | int | float | bool | None]:
    """:func:`settings_fingerprint`, and a sha256 of the lowered program's text.

    Args:
      kind: the step's name, e.g. ``"fdp.train_step"``.
      config: the step's bound :class:`fdp.step.StepConfig`.
      plan: the :class:`fdp.step.StepPlan` of this call.
      args: the step's arguments by name.
      lowered: the step's lowered program; its text is hashed.
    """
    fp = settings_fingerprint(kind, config, plan, args)
    fp[PROGRAM] = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    return fp


def digest(fingerprint: dict[str, Any]) -> str:
    """A sha256 of a fingerprint (processes compare these first)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def _show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def mismatch_message(fingerprints: list[dict[str, Any]], *, detail: bool = True) -> str:
    """The error for fingerprints that differ: every differing field and its processes.

    Args:
      fingerprints: every process's fingerprint, in process order.
      detail: whether the level is ``DETAIL`` (said in the message).
    """
    lines = differences(fingerprints, show=_show, last=(PROGRAM,))
    hint = ""
    if lines and all(line.startswith(PROGRAM) for line in lines):
        hint = (
            "\nSettings, buckets and shapes agree but the traced programs differ: the "
            "processes run different code (loss function, model, optimizer or hook settings)."
        )
    level = " (FDP_DEBUG=DETAIL)" if detail else ""
    return (
        f"Detected mismatch between processes before the first step{level}; "
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
        gathered = gather_if_different(
            fingerprint, timeout=timeout, purpose="FDP_DEBUG=DETAIL's comparison of the step"
        )
    except TimeoutError as e:
        raise TimeoutError(
            f"FDP_DEBUG=DETAIL compares every process's step before the first one, but {e} "
            "Every process must run with the same FDP_DEBUG and reach its first step."
        ) from None
    if gathered is None:
        return mine
    raise RuntimeError(mismatch_message(gathered))


def check_settings_across_processes(
    fingerprint: dict[str, Any], *, detail: bool, timeout: float = SETTINGS_TIMEOUT
) -> None:
    """Compares a :func:`settings_fingerprint` with every other process's; raises if any differs.

    Every step calls it at its first call, at any debug level, before it places
    its state or traces (a shared-memory all-reduce or a ZeRO layout is set up
    there, and processes set up differently wait for each other). One exchange
    of a 64-character hash when the processes agree.

    Args:
      fingerprint: this process's :func:`settings_fingerprint`.
      detail: whether the level is ``DETAIL`` (said in the message).
      timeout: seconds to wait for the other processes' first step.

    Raises:
      RuntimeError: the settings differ; the message lists each differing field
        with its value on each process.
      TimeoutError: some processes did not reach their first step within ``timeout``.
    """
    try:
        purpose = f"{fingerprint.get('step', 'the step')}'s settings check"
        gathered = gather_if_different(fingerprint, timeout=timeout, purpose=purpose)
    except TimeoutError as e:
        raise TimeoutError(
            f"{fingerprint.get('step', 'the step')}: every process compares the step's settings "
            f"at its first call, but {e} Every process must call the same steps in the same "
            "order."
        ) from None
    if gathered is not None:
        raise RuntimeError(mismatch_message(gathered, detail=detail))
