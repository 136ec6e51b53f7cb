"""Platform backends: the accelerations measured on one platform, chosen by platform.

fdp's step, hooks and bucketing are written once for every platform. What was
measured to pay on one platform only (on CPU hosts: the shared-memory sum, the 2-D
dense products of ``fold_dots``, glibc's malloc tuning) lives in that platform's
backend (:mod:`fdp.backends.cpu`), and generic code never imports a backend. It
calls this module with the platform it is bound to: ``StepConfig.bind`` with its
mesh's platform at a step's first call, ``fdp.init`` with its host's (told without
starting JAX). Everything else gets :data:`GENERIC`, which changes nothing.

Example:
  >>> for_platform("cpu").name, for_platform("gpu").name
  ('cpu', 'generic')
  >>> for_platform("cuda").fold_dots
  False
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from fdp.backends import cpu
from fdp.backends._backend import GENERIC as GENERIC
from fdp.backends._backend import Backend as Backend
from fdp.backends.cpu import FoldCount as FoldCount
from fdp.backends.cpu import count_in_jaxpr as count_in_jaxpr
from fdp.backends.cpu import fold_leading_dims as fold_leading_dims
from fdp.backends.cpu import release_free_memory as release_free_memory
from fdp.hooks._contract import CommHook
from fdp.hooks._registry import HOOKS as GENERIC_HOOKS
from fdp.hooks._registry import resolve

HOOKS: dict[str, Callable[[], CommHook]] = {"shm_allreduce": cpu.shm_allreduce}
"""The backends' hooks by name (``comm_hook="shm_allreduce"``), beside ``fdp.hooks.HOOKS``."""

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def for_platform(platform: str) -> Backend:
    """The backend of devices of ``platform`` (``jax.Device.platform``).

    Args:
      platform: ``"cpu"``, ``"gpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``...

    Returns:
      :data:`fdp.backends.cpu.BACKEND` for ``"cpu"``, :data:`GENERIC` otherwise.
    """
    return cpu.BACKEND if platform == "cpu" else GENERIC


def gpu_host(environ: Mapping[str, str], dev: str = "/dev") -> bool:
    """Whether JAX will run on GPUs here, told without starting JAX (``fdp.init`` runs first).

    ``JAX_PLATFORMS`` decides when set; else ``CUDA_VISIBLE_DEVICES`` naming a
    device, or NVIDIA (``/dev/nvidiaN``) or AMD (``/dev/kfd``) device files.

    Example:
      >>> gpu_host({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0"})
      False
      >>> gpu_host({"CUDA_VISIBLE_DEVICES": "0,1"})
      True
    """
    platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return any(p.strip() in _GPU_PLATFORMS for p in platforms.split(","))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return any(d.strip() not in ("", "-1") for d in visible.split(","))
    try:
        names = os.listdir(dev)
    except OSError:
        return False
    return "kfd" in names or any(n.startswith("nvidia") and n[6:].isdigit() for n in names)


def prepare_host(tune_malloc: bool | None, environ: Mapping[str, str]) -> None:
    """``fdp.init``'s set-up of the host allocator, for the platform the host will run.

    glibc's malloc tuning (:mod:`fdp.backends.cpu`) is on where it was measured,
    hosts whose JAX runs on CPUs, and elsewhere only when asked
    (``tune_malloc=True`` or ``FDP_MALLOC_TUNING=1``).
    """
    platform = "gpu" if gpu_host(environ) else "cpu"
    cpu.prepare_malloc(tune_malloc, environ, measured=for_platform(platform).tune_malloc)


def remove_stale_files() -> list[str]:
    """Removes files that the backends' killed processes left (the shared-memory regions)."""
    return cpu.remove_stale()


def resolve_hook(hook: CommHook | str | None) -> CommHook:
    """A hook from a hook, a name of ``fdp.hooks.HOOKS`` or of :data:`HOOKS`, or None.

    Raises:
      ValueError: an unknown name (the message lists every known one).
      TypeError: neither a name nor a CommHook.

    Example:
      >>> resolve_hook("shm_allreduce").name, resolve_hook("bf16_compress").name
      ('shm_allreduce', 'bf16_compress')
    """
    if isinstance(hook, str) and hook in HOOKS:
        return HOOKS[hook]()
    if isinstance(hook, str) and hook not in GENERIC_HOOKS:
        raise ValueError(
            f"comm_hook={hook!r} is not a known hook; known names: "
            f"{', '.join([*GENERIC_HOOKS, *HOOKS])}. For settings (or post_local_sgd), pass a "
            "hook object, e.g. fdp.hooks.powersgd(matrix_approximation_rank=2)."
        )
    return resolve(hook)


# What users call; the rest (the CPU backend's pieces a setting may ask for on any
# platform, fdp.init's host set-up) is for fdp's own generic code.
__all__ = ["GENERIC", "HOOKS", "Backend", "for_platform", "gpu_host", "resolve_hook"]
