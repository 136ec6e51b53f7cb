"""Compile-only GPU meshes: XLA's own GPU compiler, run on a machine without a GPU.

The CUDA PJRT plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``, the same
version as jaxlib; ``fdp gpu-compiler --install`` puts them in a folder of their
own, :func:`compiler_dir`) compiles for a described GPU without one being
present: ``jax.experimental.topologies`` builds compile-only devices from a
target description (a ``GpuTargetConfigProto``: XLA keeps those of real
GPUs as data, fdp ships the ones it uses), and a step lowered on a mesh of them
compiles to XLA:GPU's real scheduled program: async collective start/done pairs
in schedule order, gemm fusions, and ``memory_analysis()``. Nothing can run on
those devices, so inputs are ``jax.ShapeDtypeStruct`` with shardings
(:func:`fdp.replicate` of an abstract state gives them).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh
from jaxlib import version as jaxlib_version

from fdp import _compat
from fdp.collectives._axis import AxisName
from fdp.data._placement import DATA_AXIS, axis_names_of


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU fdp can compile for without one, and the figures its estimates use.

    Attributes:
      name: the target's name (``"h100_sxm"``, ``"a100_sxm_80"``).
      description: the device as the CUDA driver names it.
      file: the ``GpuTargetConfigProto`` text file shipped in ``fdp/observe/gpu_targets/``.
      dense_flops: peak dense matrix FLOP/s per dtype of the products (HLO spelling;
        ``f32`` is TF32, which XLA:GPU uses for float32 products at default precision).
      link_bytes_per_s: one direction of one GPU's NVLink bandwidth (bytes/s).
      collective_latency_s: the fixed time of one collective on the link,
        whatever its size (NCCL's small-message latency inside one NVLink host).
    """

    name: str
    description: str
    file: str
    dense_flops: tuple[tuple[str, float], ...]
    link_bytes_per_s: float
    collective_latency_s: float = 10e-6

    def flops_per_s(self, dtype: str) -> float:
        """Peak dense FLOP/s of a product in ``dtype`` (f32 if unknown)."""
        table = dict(self.dense_flops)
        return table.get(dtype, table["f32"])

    def config_text(self) -> str:
        """The target description, as XLA's GPU compiler reads it."""
        return (
            importlib.resources.files("fdp.observe").joinpath("gpu_targets", self.file).read_text()
        )


# NVIDIA's data sheets: H100 SXM5 TF32 494.7, BF16/FP16 989.4 dense TFLOP/s, NVLink 4
# 900 GB/s (450 each way); A100 SXM4 TF32 156, BF16/FP16 312, NVLink 3 600 GB/s (300 each way).
# The 10 us per collective is an order of magnitude for NCCL's small all-reduces on one
# NVLink host (nccl-tests report roughly 10-20 us at 8 GPUs), so that more, smaller
# buckets are not free in the estimate.
GPU_TARGETS: dict[str, GpuTarget] = {
    t.name: t
    for t in (
        GpuTarget(
            "h100_sxm",
            "NVIDIA H100 80GB HBM3",
            "h100_sxm.txtpb",
            (("f32", 494.7e12), ("bf16", 989.4e12), ("f16", 989.4e12)),
            450e9,
        ),
        GpuTarget(
            "a100_sxm_80",
            "NVIDIA A100-SXM4-80GB",
            "a100_sxm_80.txtpb",
            (("f32", 156e12), ("bf16", 312e12), ("f16", 312e12)),
            300e9,
        ),
    )
}


def gpu_target(name: str | GpuTarget) -> GpuTarget:
    """The :class:`GpuTarget` named ``name`` (one of :data:`GPU_TARGETS`)."""
    if isinstance(name, GpuTarget):
        return name
    try:
        return GPU_TARGETS[name]
    except KeyError:
        raise ValueError(
            f"target must be one of {sorted(GPU_TARGETS)} (or a GpuTarget), got {name!r}."
        ) from None


def compiler_dir() -> Path:
    """Where fdp keeps XLA's GPU compiler: ``$FDP_GPU_COMPILER_DIR``, else a user cache.

    The default holds jaxlib's version, since the plugin must match it:
    ``~/.cache/fdp/gpu-compiler/jaxlib-0.10.2``.
    """
    configured = os.environ.get("FDP_GPU_COMPILER_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache) / "fdp" / "gpu-compiler" / f"jaxlib-{jaxlib_version.__version__}"


def compiler_packages() -> tuple[str, str]:
    """The two packages that hold XLA's GPU compiler, pinned to jaxlib's version."""
    version = jaxlib_version.__version__
    return (f"jax-cuda12-plugin=={version}", f"jax-cuda12-pjrt=={version}")


def install_compiler(target: Path | None = None) -> Path:
    """Installs XLA's GPU compiler into ``target`` (default :func:`compiler_dir`).

    The packages go into a folder of their own, not site-packages: installed
    there, the CUDA plugin makes every JAX process of a machine without CUDA
    print a plugin error. fdp loads it from the folder when a GPU mesh is
    asked for. About 480 MB; needs the package index.

    Raises:
      RuntimeError: pip failed (its output is in the message).
    """
    target = compiler_dir() if target is None else Path(target)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade"]
    cmd += ["--target", str(target), *compiler_packages()]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"installing {' and '.join(compiler_packages())} into {target} failed "
            f"(pip exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return target


def gpu_compiler_status() -> str | None:
    """None when XLA's GPU compiler can be loaded here, else the reason it cannot.

    Example:
      >>> status = gpu_compiler_status()
      >>> status is None or status.startswith("XLA's GPU compiler")
      True
    """
    try:
        _compiles(GPU_TARGETS["h100_sxm"])
    except Exception as e:  # the plugin is missing, another version, or refuses to load
        return f"XLA's GPU compiler cannot be loaded here: {e}"
    return None


@functools.lru_cache(maxsize=4)
def _compiles(target: GpuTarget) -> bool:
    """Compiles a small product for ``target``: the plugin loads, and its tools run.

    XLA:GPU turns its kernels into machine code with CUDA's ``ptxas`` where it
    finds one; a machine that lacks what the compiler needs fails here, not in
    the first step compiled.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(_topology(target, 1).devices), ("d",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    jax.jit(lambda a: jnp.tanh(a @ a)).lower(x).compile()
    return True


def _load_from(folder: Path) -> None:
    """Makes the plugin in ``folder`` importable and registers it with JAX."""
    if not (folder / "jax_plugins" / "xla_cuda12").is_dir():
        raise RuntimeError(
            f"it is not installed in {folder} (fdp gpu-compiler --install puts it there; "
            "FDP_GPU_COMPILER_DIR chooses another folder)"
        )
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # the plugin imports its own modules later, from here
    # Without CUDA's libraries the plugin refuses to register unless told that only its
    # compiler is wanted; nothing runs on the devices it describes. Only while it
    # registers: child processes of this one must not inherit it.
    skip, before = (
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK",
        os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"),
    )
    os.environ[skip] = "1"
    try:
        _compat.register_cuda_plugin()
    finally:
        if before is None:
            del os.environ[skip]
        else:
            os.environ[skip] = before


@functools.lru_cache(maxsize=16)
def _topology(target: GpuTarget, devices: int) -> Any:
    from jax.experimental import topologies

    def describe() -> Any:
        return topologies.get_topology_desc(
            "", "cuda", target_config=target.config_text(), topology=f"1x1x{devices}"
        )

    try:
        return describe()  # a CUDA jaxlib (a GPU machine), or a plugin loaded before
    except NotImplementedError:
        pass  # no CUDA plugin registered in this process: load fdp's copy
    try:
        _load_from(compiler_dir())
        return describe()
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {e}") from e


def gpu_mesh(
    target: str | GpuTarget = "h100_sxm",
    devices: int = 8,
    *,
    axis_name: AxisName = DATA_AXIS,
    shape: tuple[int, ...] | None = None,
) -> Mesh:
    """A mesh of compile-only GPU devices, to compile fdp's step for a GPU here.

    Args:
      target: the GPU (:data:`GPU_TARGETS`: ``"h100_sxm"``, ``"a100_sxm_80"``).
      devices: how many GPUs (one host).
      axis_name: the mesh's axis, or axes (outer first) with ``shape``.
      shape: the mesh's shape for several axes (its product is ``devices``).

    Returns:
      A ``jax.sharding.Mesh`` (axis type ``Auto``) whose devices compile for
      ``target`` and run nothing.

    Raises:
      RuntimeError: XLA's GPU compiler cannot be loaded (the message says why;
        ``fdp gpu-compiler --install`` installs it).
      ValueError: an unknown target, or a shape that does not hold ``devices``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = gpu_mesh("h100_sxm", 8)                     # doctest: +SKIP
      >>> x = jax.ShapeDtypeStruct((64,), jnp.float32,
      ...                          sharding=NamedSharding(mesh, P("data")))  # doctest: +SKIP
      >>> jax.jit(jnp.sum).lower(x).compile().as_text()      # doctest: +SKIP
    """
    spec = gpu_target(target)
    names = axis_names_of(axis_name)
    shape = (devices,) if shape is None else tuple(shape)
    if len(shape) != len(names) or int(np.prod(shape)) != devices:
        raise ValueError(
            f"shape must have one size per axis of {names} and hold devices={devices}, "
            f"got shape={shape}."
        )
    try:
        topology = _topology(spec, devices)
    except RuntimeError as e:
        raise RuntimeError(
            f"XLA's GPU compiler cannot be loaded here: {e}. It is the CUDA plugin of "
            f"jaxlib's version ({', '.join(compiler_packages())}); `fdp gpu-compiler "
            "--install` installs it where fdp looks."
        ) from e
    grid = np.array(topology.devices).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
