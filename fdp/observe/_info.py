"""``fdp info``: what a bug report needs to know about this machine and process.

``python -m torch.utils.collect_env`` for fdp: versions, platform, devices,
the variables that steer JAX, fdp and launchers, and the collectives
implementation.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import re
import sys
from collections.abc import Mapping
from typing import Any

import jax

from fdp._compat import config_value
from fdp._version import __version__

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "chex",
    "orbax-checkpoint",
    "msgpack",
    "numpy",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "nvidia-nccl-cu12",
    "nvidia-nccl-cu13",
    "libtpu",
)
"""Distributions reported; the ones not installed are left out (fdp, jax and jaxlib never are)."""

_PREFIXES = ("FDP_", "JAX_", "XLA_", "TF_CPP_", "NCCL_", "SLURM_", "OMPI_", "PMI_", "TPU_")
_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "KUBERNETES_SERVICE_HOST",
)
# Values of variables whose names say they hold a secret are not printed.
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|_KEY$|APIKEY", re.I)
# Nor credentials inside other values: a URL's user:password@ (also without a
# scheme, as in FDP_COORDINATOR_ADDRESS=user:pw@host:port) and long tokens.
_USERINFO = re.compile(r"(?<![\w.-])([A-Za-z][\w+.-]*://)?[^\s/@:=,;]+:[^\s/@]*@")
_TOKEN = re.compile(r"[A-Za-z0-9_+-]{32,}")  # no '/', '=', '.': paths and flags split
HIDDEN = "<hidden>"
# What ``import jax`` itself sets when they are unset: a report lists them only when
# they differ, since these values say nothing about how the user ran the program.
SET_BY_JAX = {"TF_CPP_MIN_LOG_LEVEL": "1", "TPU_SKIP_MDS_QUERY": "1"}


def _long_token(match: re.Match[str]) -> str:
    text = match.group(0)
    # A token mixes letters and digits; a long flag or path word has no digits.
    mixed = re.search(r"[A-Za-z]", text) and re.search(r"[0-9]", text.lstrip("-"))
    return HIDDEN if mixed else text


def redact(value: str) -> str:
    """``value`` with the credentials it may carry replaced by ``<hidden>``.

    Example:
      >>> redact("user:pw@10.0.0.1:29500"), redact("https://bob:s3cret@hub.example/x")
      ('<hidden>@10.0.0.1:29500', 'https://<hidden>@hub.example/x')
      >>> redact("--xla_dump_to=/tmp/dump --xla_gpu_enable_latency_hiding_scheduler=true")
      '--xla_dump_to=/tmp/dump --xla_gpu_enable_latency_hiding_scheduler=true'
      >>> redact("hf_0123456789abcdefABCDEF0123456789xyz")
      '<hidden>'
    """
    value = _USERINFO.sub(lambda m: f"{m.group(1) or ''}{HIDDEN}@", value)
    return _TOKEN.sub(_long_token, value)


def environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that matter to a distributed JAX run, sorted by name.

    Values are redacted twice: a variable whose name says it holds a secret
    is hidden whole, and credentials inside any other value (a URL's
    ``user:password@``, a long token) are hidden where they stand. Variables
    that ``import jax`` sets, with the value it sets (:data:`SET_BY_JAX`), are
    left out.

    Example:
      >>> environment({"XLA_FLAGS": "--xla_dump_to=/tmp", "HOME": "/root",
      ...              "RANK": "0", "FDP_TOKEN": "abc", "TF_CPP_MIN_LOG_LEVEL": "1",
      ...              "FDP_COORDINATOR_ADDRESS": "user:pw@host:29500"})
      {'FDP_COORDINATOR_ADDRESS': '<hidden>@host:29500', 'FDP_TOKEN': '<hidden>',
       'RANK': '0', 'XLA_FLAGS': '--xla_dump_to=/tmp'}
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    return {
        name: HIDDEN if _SECRET.search(name) else redact(env[name])
        for name in sorted(env)
        if (name.startswith(_PREFIXES) or name in _NAMES) and env[name] != SET_BY_JAX.get(name)
    }


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "fdp": __version__}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            if name in ("jax", "jaxlib"):
                out[name] = "not installed"
    return out


def _nccl_version() -> str | None:
    """NCCL's version from the library a CUDA jaxlib loaded, if one is loaded."""
    try:
        lib = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD)  # only if already loaded
    except OSError:
        return None
    code = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    # NCCL encodes 2.9 and later as major*10000 + minor*100 + patch, before as *1000.
    major, rest = divmod(code.value, 10000 if code.value >= 10000 else 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def info() -> dict[str, Any]:
    """Versions, platform, devices, environment and collectives, as plain data.

    Listing devices starts JAX's backend (after ``fdp.init`` in a multi-process
    run, every process's devices are listed).

    Returns:
      A dict with ``versions``, ``system``, ``jax`` (backend, devices,
      processes, collectives) and ``environment``.

    Example:
      >>> import fdp
      >>> report = fdp.info()
      >>> report["versions"]["fdp"] == fdp.__version__
      True
      >>> report["jax"]["platform"], report["jax"]["device_count"]
      ('cpu', 8)
    """
    devices = jax.devices()
    kinds: dict[str, int] = {}
    for d in devices:
        kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
    backend: dict[str, Any] = {
        "platform": devices[0].platform,
        "platform_version": _platform_version(),
        "device_count": len(devices),
        "local_device_count": jax.local_device_count(),
        "device_kinds": kinds,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "distributed_initialized": jax.distributed.is_initialized(),
        "cpu_collectives": str(config_value("jax_cpu_collectives_implementation")),
    }
    if devices[0].platform == "gpu" or "cuda" in backend["platform_version"].lower():
        backend["nccl"] = _nccl_version() or "unknown (libnccl not loaded)"
    return {
        "versions": _versions(),
        "system": {
            "os": platform.platform(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "python_executable": sys.executable,
        },
        "jax": backend,
        "environment": environment(),
    }


def _platform_version() -> str:
    try:
        import jax.extend

        return str(jax.extend.backend.get_backend().platform_version)
    except Exception as e:  # a plugin may not say; the report must still print
        return f"unknown ({type(e).__name__})"


def format_info(report: dict[str, Any] | None = None) -> str:
    """The :func:`info` report as text to paste into a bug report.

    Args:
      report: an :func:`info` dict (default: a fresh one).

    Returns:
      One ``name: value`` line per item, in sections.
    """
    report = info() if report is None else report
    lines = []
    for section, items in report.items():
        lines.append(f"{section}:")
        if not items:
            lines.append("  (none set)")
        width = max((len(k) for k in items), default=0)
        lines.extend(f"  {k.ljust(width)}  {v}" for k, v in items.items())
    return "\n".join(lines)
