"""``StepConfig``: a train step's settings, written once and checked when given."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fdp import _compat
from fdp.bucketing import cap_limits
from fdp.data._placement import DATA_AXIS, check_axis, data_mesh
from fdp.hooks import CommHook, PeriodicModelAverager, resolve
from fdp.hooks._contract import Layout

StepLayout = Literal["auto", "leaves", "flat"]
LAYOUTS = ("auto", "leaves", "flat")
BUFFER_MODES = ("broadcast", "mean", "local")
LossFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """The settings of a train step (:func:`fdp.train_step`'s keyword arguments).

    Every field is checked when the config is made, so a mistake surfaces where
    the step is built, not at its first call. Making a config does not start
    JAX's backend: a config without ``mesh`` (all devices) or with
    ``layout='auto'`` is resolved by :meth:`bind` at the step's first call.
    Being frozen and hashable, a config is a valid static argument of
    ``jax.jit`` and a memoisation key.

    Attributes:
      mesh: the device mesh; None for :func:`fdp.data_mesh` over all devices.
      axis_name: the data axis of ``mesh``.
      bucket_cap_mb: bucket cap in MiB (DDP's ``bucket_cap_mb``).
      first_bucket_cap_mb: first-bucket cap in MiB.
      has_aux: the loss function returns ``(loss, aux)``.
      donate: donate the state's buffers to the step.
      layout: ``'auto'``, ``'leaves'`` or ``'flat'`` (see :func:`fdp.reduce_gradients`).
      comm_hook: the comm hook, or its name, or None for the mean all-reduce.
      model_averager: averages parameters periodically (local SGD), or None.
      accumulate_steps: micro-batches per step (DDP's ``no_sync``).
      accum_dtype: gradient accumulation dtype (None: float32 for 16-bit params).
      per_example: the loss function returns one loss per example, which lets
        batches be padded and masked.
      find_unused_parameters: leave parameters that do not reach the loss (and
        their optimizer state) untouched.
      buffers: how model state changed by the forward pass (``batch_stats``) is
        kept in step: ``'broadcast'`` from device 0, ``'mean'`` over the data
        axis, or ``'local'`` (each device its own).

    Example:
      >>> cfg = StepConfig(bucket_cap_mb=5.0, comm_hook="bf16_compress")
      >>> cfg.comm_hook.name, cfg.layout
      ('bf16_compress', 'auto')
      >>> StepConfig(buffers="sync")
      Traceback (most recent call last):
      ...
      ValueError: buffers must be one of ('broadcast', 'mean', 'local'), got 'sync'.
    """

    mesh: Mesh | None = None
    axis_name: str = DATA_AXIS
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    has_aux: bool = False
    donate: bool = True
    layout: StepLayout = "auto"
    comm_hook: CommHook = None  # type: ignore[assignment]  # None or a name: resolved below
    model_averager: PeriodicModelAverager | None = None
    accumulate_steps: int = 1
    accum_dtype: Any = None
    per_example: bool = False
    find_unused_parameters: bool = False
    buffers: str = "broadcast"

    def __post_init__(self) -> None:
        if self.mesh is not None:
            check_axis(self.mesh, self.axis_name)
        elif not isinstance(self.axis_name, str):
            raise TypeError(f"axis_name must be a str, got {self.axis_name!r}.")
        cap_limits(self.bucket_cap_mb, self.first_bucket_cap_mb)
        # Plain floats from here on (np.float32(25) is accepted), for logs and the DETAIL check.
        object.__setattr__(self, "bucket_cap_mb", float(self.bucket_cap_mb))
        object.__setattr__(self, "first_bucket_cap_mb", float(self.first_bucket_cap_mb))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}.")
        object.__setattr__(self, "comm_hook", resolve(self.comm_hook))
        averager = self.model_averager
        if averager is not None and not isinstance(averager, PeriodicModelAverager):
            raise TypeError(
                "model_averager must be a fdp.hooks.PeriodicModelAverager, got "
                f"{type(averager).__name__}."
            )
        steps = self.accumulate_steps
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise TypeError(f"accumulate_steps must be an int >= 1, got {steps!r}.")
        if steps < 1:
            raise ValueError(f"accumulate_steps must be >= 1, got {steps}.")
        if self.accum_dtype is not None:
            if not jnp.issubdtype(jnp.dtype(self.accum_dtype), jnp.floating):
                raise ValueError(f"accum_dtype must be a floating dtype, got {self.accum_dtype!r}.")
            object.__setattr__(self, "accum_dtype", np.dtype(jnp.dtype(self.accum_dtype)))
        if self.buffers not in BUFFER_MODES:
            raise ValueError(f"buffers must be one of {BUFFER_MODES}, got {self.buffers!r}.")

    # -- resolving what depends on the devices (the first call) -------------------------

    def bind(self) -> StepConfig:
        """This config with its mesh and layout resolved (starts JAX's backend).

        ``layout='auto'`` becomes ``'flat'`` (DDP's packed buckets, kept apart by
        XLA:CPU) on CPU with several processes, else ``'leaves'``. Measured on 2
        processes x 1 CPU device (gloo, an 8.4M-parameter MLP): one combined
        all-reduce after the backward pass gave 683-718 examples/s; flat buckets
        kept apart, so each all-reduce can start while the backward pass goes on,
        725-798 (25 MiB buckets) and 983-1006 (2.5 MiB). In one process the
        buckets gain nothing and their packing costs a copy.
        """
        mesh = data_mesh(axis_name=self.axis_name) if self.mesh is None else self.mesh
        layout = self.layout
        if layout == "auto":
            cpu = mesh.devices.flat[0].platform == "cpu"
            layout = "flat" if cpu and jax.process_count() > 1 else "leaves"
        if mesh is self.mesh and layout == self.layout:
            return self
        return dataclasses.replace(self, mesh=mesh, layout=layout)

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` has nothing left to resolve."""
        return self.mesh is not None and self.layout != "auto"

    def _need_bound(self, what: str) -> Mesh:
        if self.mesh is None or self.layout == "auto":
            raise RuntimeError(f"StepConfig.{what} needs a bound config: call .bind() first.")
        return self.mesh

    @property
    def bound_mesh(self) -> Mesh:
        """The mesh of a bound config."""
        return self._need_bound("bound_mesh")

    @property
    def bound_layout(self) -> Layout:
        """The layout of a bound config: ``'leaves'`` or ``'flat'``."""
        self._need_bound("bound_layout")
        return "flat" if self.layout == "flat" else "leaves"

    @property
    def num_replicas(self) -> int:
        """Devices along the data axis (DDP's world size)."""
        return int(self._need_bound("num_replicas").shape[self.axis_name])

    @property
    def check_vma(self) -> bool:
        """Whether the step's shard_map tracks replication.

        Off for hooks whose collectives JAX cannot type, and on a 1-device axis,
        where fdp's reductions become identities.
        """
        return self.comm_hook.vma_safe and self.num_replicas > 1

    @property
    def compiler_options(self) -> dict[str, str] | None:
        """XLA options for the step: on CPU, the flat layout keeps DDP's buckets apart."""
        mesh = self._need_bound("compiler_options")
        if self.layout == "flat" and mesh.devices.flat[0].platform == "cpu":
            return _compat.keep_all_reduces_apart()
        return None

    @property
    def per_device_state(self) -> bool:
        """Whether replicas may diverge, so the state is kept once per device."""
        return not self.comm_hook.replicated_output

    def shard_map(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Any:
        """``jax.shard_map`` of ``fn``, manual over the data axis only.

        Other mesh axes stay under the compiler, so parameters may be sharded
        over them.
        """
        return jax.shard_map(
            fn,
            mesh=self._need_bound("shard_map"),
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names={self.axis_name},
            check_vma=self.check_vma,
        )

    # -- what logs and cross-process checks show ------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Every setting as a plain value (str, number, bool, None, list, dict).

        The INFO log and the DETAIL cross-process check are derived from it, so a
        setting added to the config shows up in both.
        """
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Mesh):
                out["mesh"] = dict(value.shape)
                out["mesh_device_ids"] = [int(d.id) for d in value.devices.flat]
            elif isinstance(value, CommHook):
                out["comm_hook"] = value.name
                out["comm_hook_flags"] = (
                    f"replicated_output={value.replicated_output}, vma_safe={value.vma_safe}"
                )
            elif isinstance(value, np.dtype):
                out[field.name] = str(value)
            elif value is None or isinstance(value, str | int | float | bool):
                out[field.name] = value
            else:
                out[field.name] = repr(value)
        return out
