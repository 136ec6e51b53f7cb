"""Comm hooks by name, for ``comm_hook="bf16_compress"`` and command lines.

The hooks every platform runs. A platform backend's own hooks (the CPU backend's
``"shm_allreduce"``) are named by :func:`fdp.backends.resolve_hook`, which
``fdp.Reduction`` calls and which falls back to this table.
"""

from __future__ import annotations

from collections.abc import Callable

from fdp.hooks._basic import allreduce, bf16_compress, default_allreduce, fp16_compress, noop
from fdp.hooks._compressed import compressed_allreduce
from fdp.hooks._contract import CommHook
from fdp.hooks._powersgd import batched_powersgd, powersgd
from fdp.hooks._quantize import quantize_per_channel, quantize_per_tensor

HOOKS: dict[str, Callable[[], CommHook]] = {
    "allreduce": allreduce,
    "noop": noop,
    "fp16_compress": fp16_compress,
    "bf16_compress": bf16_compress,
    "quantize_per_tensor": quantize_per_tensor,
    "quantize_per_channel": quantize_per_channel,
    "powersgd": powersgd,
    "batched_powersgd": batched_powersgd,
    "compressed_int8": lambda: compressed_allreduce("int8"),
    "compressed_bf16": lambda: compressed_allreduce("bfloat16"),
    "compressed_fp16": lambda: compressed_allreduce("float16"),
}


def resolve(hook: CommHook | str | None) -> CommHook:
    """A :class:`CommHook` from a hook, its name (with default settings), or None.

    Raises:
      ValueError: an unknown name.
      TypeError: neither a name nor a CommHook.

    Example:
      >>> resolve("bf16_compress").name
      'bf16_compress'
      >>> resolve(None).name
      'allreduce'
    """
    if hook is None:
        return default_allreduce()
    if isinstance(hook, CommHook):
        return hook
    if isinstance(hook, str):
        if hook not in HOOKS:
            raise ValueError(
                f"comm_hook={hook!r} is not a known hook; known names: {', '.join(HOOKS)}. "
                "For settings (or post_local_sgd), pass a hook object, e.g. "
                "fdp.hooks.powersgd(matrix_approximation_rank=2). A platform backend's "
                "hooks (shm_allreduce) are named through fdp.backends.resolve_hook, as "
                "fdp.Reduction(comm_hook=...) does."
            )
        return HOOKS[hook]()
    raise TypeError(
        f"comm_hook must be a fdp.hooks.CommHook or a hook name, got {type(hook).__name__}."
    )
