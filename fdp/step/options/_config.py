"""``StepConfig``: a train step's settings, written once and checked when given."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from fdp import _compat, backends
from fdp.collectives._axis import AxisName
from fdp.data._placement import DATA_AXIS, axis_names_of, check_axis, default_mesh
from fdp.hooks import CommHook, ModelAverager
from fdp.hooks._basic import is_default, is_mean_all_reduce, is_mean_reduce_scatter
from fdp.hooks._contract import Layout, reduce_scatter_of
from fdp.hooks._reduce_dtype import reduce_in
from fdp.hooks._two_level import hierarchical, split_axis
from fdp.step.layout._hybrid import hybrid as hybrid_hook
from fdp.step.options._policies import (
    POLICIES,
    Accumulation,
    Loss,
    Reduction,
    Sharding,
    StepLayout,
)

BUFFER_MODES = ("broadcast", "mean", "local")
PER_USE_IN_FLIGHT = 4
"""Async collectives XLA:GPU may keep in flight at once when stage 3 gathers per use."""
PREFETCH_GROUPS = 1
"""How many gather groups ahead stage 3's gathers may start on GPU, in both passes.

A group is consecutive uses holding about ``bucket_cap_mb`` of parameters, gathered
as one collective (:class:`fdp.step.grads._per_use._Prefetch`; docs/zero.md, Prefetch).
"""
LossFn = Callable[..., Any]
# buffers=fn: fn(buffers, axis_name) -> buffers, DDP's buffer comm hook.
BufferHook = Callable[[Any, str], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """A train step's settings: where it runs, its policies, and the rules between them.

    Each policy (:class:`fdp.Reduction`, :class:`fdp.Accumulation`,
    :class:`fdp.Loss`, :class:`fdp.Sharding`) checks its own fields; the config
    checks what one policy cannot see alone (ZeRO against the comm hook,
    ``hierarchical`` against the axis), so a mistake surfaces where the step is
    built, not at its first call. Making a config does not start JAX's backend:
    a config without ``mesh`` (all devices) or with ``layout='auto'`` is
    resolved by :meth:`bind` at the step's first call. Being frozen and
    hashable, a config is a valid static argument of ``jax.jit`` and a
    memoisation key.

    The policies' fields read through flat, read-only properties
    (``config.bucket_cap_mb`` is ``config.reduction.bucket_cap_mb``): the step
    core reads them so, and ``step.config.bucket_cap_mb`` is documented.

    Attributes:
      mesh: the device mesh; None for :func:`fdp.data_mesh` over all devices.
      axis_name: the data axis of ``mesh``, or a tuple of its axes (outer
        first, e.g. ``("host", "device")``) that together form the data axis.
      reduction: how gradients are reduced (:class:`fdp.Reduction`).
      accumulation: micro-batches per step (:class:`fdp.Accumulation`).
      loss: what the loss returns and how examples weigh (:class:`fdp.Loss`).
      sharding: what is sharded over the data axis (:class:`fdp.Sharding`).
      buffers: how model state changed by the forward pass (``batch_stats``) is
        kept in step: ``'broadcast'`` from device 0, ``'mean'`` over the data
        axis, ``'local'`` (each device its own), or a function
        ``fn(buffers, axis_name) -> buffers`` run on every device (DDP's buffer
        comm hook).
      donate: donate the state's buffers to the step.
      fold_dots: compute each dense product of an n-D activation (``x @ w``,
        ``nn.Dense`` on ``[batch, seq, features]``) on the activation folded to
        2-D, as ``torch.nn.Linear`` does (the CPU backend's
        :mod:`fdp.backends.cpu._fold`; XLA:CPU transposes the gradient in memory
        otherwise). ``None`` (default): the platform's backend decides at
        :meth:`bind` (on for CPUs). The values are the same products; the
        weight gradients' summation order may differ (float rounding).

    Example:
      >>> from fdp import Reduction
      >>> cfg = StepConfig(reduction=Reduction(bucket_cap_mb=5.0, comm_hook="bf16_compress"))
      >>> cfg.comm_hook.name, cfg.layout
      ('bf16_compress', 'auto')
      >>> StepConfig(buffers="sync")
      Traceback (most recent call last):
      ...
      ValueError: buffers must be one of ('broadcast', 'mean', 'local') or a function
      fn(buffers, axis_name) -> buffers, got 'sync'.
    """

    mesh: Mesh | None = None
    axis_name: AxisName = DATA_AXIS
    reduction: Reduction = dataclasses.field(default_factory=Reduction)
    accumulation: Accumulation = dataclasses.field(default_factory=Accumulation)
    loss: Loss = dataclasses.field(default_factory=Loss)
    sharding: Sharding = dataclasses.field(default_factory=Sharding)
    buffers: str | BufferHook = "broadcast"
    donate: bool = True
    fold_dots: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.axis_name, list):  # a list reads as the tuple it means
            object.__setattr__(self, "axis_name", tuple(self.axis_name))
        if self.mesh is not None:
            check_axis(self.mesh, self.axis_name)
        else:
            axis_names_of(self.axis_name)
        for name, cls in POLICIES.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise TypeError(f"{name} must be a fdp.{cls.__name__}, got {type(value).__name__}.")
        if self.reduction.auto:
            raise ValueError(
                "StepConfig needs a bucket cap in MiB; bucket_cap_mb='auto' is resolved by "
                "fdp.train_step / fdp.nnx_train_step, which time candidate caps."
            )
        if self.fold_dots is not None and not isinstance(self.fold_dots, bool):
            raise TypeError(f"fold_dots must be True, False or None, got {self.fold_dots!r}.")
        if not callable(self.buffers) and self.buffers not in BUFFER_MODES:
            raise ValueError(
                f"buffers must be one of {BUFFER_MODES} or a function "
                f"fn(buffers, axis_name) -> buffers, got {self.buffers!r}."
            )
        if self.loss.normalize == "tokens" and self.accumulation.op == "sum":
            raise ValueError(
                "loss=fdp.Loss(normalize='tokens') divides by the step's global token count; "
                "accumulation=fdp.Accumulation(op='sum') adds micro-batch means instead. Use "
                "op='mean' (the default) with it."
            )
        self._check_zero()
        self._check_reduction()

    def _check_reduction(self) -> None:
        """Checks ``hierarchical`` and ``reduce_dtype`` against the axis and ZeRO."""
        if self.hybrid and self.reduce_dtype is not None:
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype.name!r} sets the dtype of the default mean "
                "all-reduce; with shard_over='inner' the comm hook runs between hosts only. "
                "Pick that hop's dtype with comm_hook='bf16_compress' (or another hook) and "
                "leave reduce_dtype unset."
            )
        if self.hierarchical:
            split_axis(self.axis_name, "hierarchical=True")
            if self.zero_stage and not self.hybrid:
                raise ValueError(
                    f"hierarchical=True with zero_stage={self.zero_stage} is not supported "
                    "over the whole data axis: ZeRO reduce-scatters over every device. To "
                    "reduce inside hosts first, shard inside them: "
                    f"sharding=fdp.Sharding(zero_stage={self.zero_stage}, shard_over='inner')."
                )
        if self.reduce_dtype is not None and self.zero_stage >= 2:
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype.name!r} sets the dtype of the default mean "
                f"all-reduce; got zero_stage={self.zero_stage}, which reduce-scatters. With "
                "zero_stage >= 2 leave reduce_dtype unset."
            )

    # -- the policies' fields, read flat (the core reads these) ---------------------------

    @property
    def bucket_cap_mb(self) -> float:
        """``reduction.bucket_cap_mb``: DDP's bucket cap in MiB."""
        return float(self.reduction.bucket_cap_mb)

    @property
    def first_bucket_cap_mb(self) -> float:
        """``reduction.first_bucket_cap_mb``."""
        return self.reduction.first_bucket_cap_mb

    @property
    def layout(self) -> StepLayout:
        """``reduction.layout``."""
        return self.reduction.layout

    @property
    def comm_hook(self) -> CommHook:
        """``reduction.comm_hook`` (the hook as given; :attr:`hook` is the one run)."""
        hook = self.reduction.comm_hook
        assert isinstance(hook, CommHook)  # Reduction resolves names and None
        return hook

    @property
    def hierarchical(self) -> bool:
        """``reduction.hierarchical``."""
        return self.reduction.hierarchical

    @property
    def reduce_dtype(self) -> np.dtype | None:
        """``reduction.reduce_dtype``."""
        return self.reduction.reduce_dtype

    @property
    def model_averager(self) -> ModelAverager | None:
        """``reduction.model_averager``."""
        return self.reduction.model_averager

    @property
    def accumulate_steps(self) -> int:
        """``accumulation.steps``."""
        return self.accumulation.steps

    @property
    def accum_dtype(self) -> np.dtype | None:
        """``accumulation.dtype``."""
        return self.accumulation.dtype

    @property
    def accumulate_op(self) -> str:
        """``accumulation.op``."""
        return self.accumulation.op

    @property
    def has_aux(self) -> bool:
        """``loss.has_aux``."""
        return self.loss.has_aux

    @property
    def per_example(self) -> bool:
        """``loss.per_example``."""
        return self.loss.per_example

    @property
    def weighting(self) -> str:
        """``loss.weighting``."""
        return self.loss.weighting

    @property
    def divide_by_initial_world_size(self) -> bool:
        """``loss.divide_by_initial_world_size``."""
        return self.loss.divide_by_initial_world_size

    @property
    def gather_aux(self) -> bool | Callable[[str], bool]:
        """``loss.gather_aux``."""
        return self.loss.gather_aux

    @property
    def find_unused_parameters(self) -> bool:
        """``loss.find_unused_parameters``."""
        return self.loss.find_unused_parameters

    @property
    def zero_stage(self) -> int:
        """``sharding.zero_stage``."""
        return self.sharding.zero_stage

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO shards inside each host and replicates across hosts (HSDP)."""
        return self.zero_stage >= 1 and self.sharding.shard_over == "inner"

    @property
    def shard_axis(self) -> AxisName:
        """The axis ZeRO's state is sharded over: the inner axis with HSDP, else the data axis."""
        return self.axis_names[1] if self.hybrid else self.axis_name

    @property
    def num_shards(self) -> int:
        """Devices along :attr:`shard_axis`: what one sharded leaf is split into."""
        return check_axis(self._need_bound("num_shards"), self.shard_axis)

    @property
    def hook(self) -> CommHook:
        """The hook the step runs: ``comm_hook`` as ``hierarchical``/``reduce_dtype`` make it.

        Needs a bound config when ``hierarchical`` or hybrid (the hook is sized
        to the devices per host). With hybrid sharding the step's ``comm_hook``
        runs on the hop between hosts (:func:`fdp.step.layout._hybrid.hybrid`).
        """
        hook = self.comm_hook
        if self.hybrid:
            return hybrid_hook(hook, inner_size=self.num_shards)
        if self.hierarchical:
            inner = self.axis_names[1]
            hook = hierarchical(hook, inner_size=int(self._need_bound("hook").shape[inner]))
        if self.reduce_dtype is not None:
            hook = reduce_in(hook, self.reduce_dtype)
        return hook

    def _check_zero(self) -> None:
        """Refuses what cannot work with a sharded step, saying why."""
        stage, hook = self.zero_stage, self.comm_hook
        if stage == 0:
            return
        if self.sharding.shard_over == "inner":
            split_axis(self.axis_name, "sharding=fdp.Sharding(shard_over='inner')")
        if not hook.replicated_output:
            raise ValueError(
                f"comm hook {hook.name!r} lets replicas diverge (one state per device), "
                f"which zero_stage={stage} cannot shard: every device must apply the same "
                "reduced gradient to its share. Use zero_stage=0 with this hook."
            )
        if self.model_averager is not None:
            raise ValueError(
                f"model_averager (post-local SGD) averages whole per-device parameters, "
                f"which zero_stage={stage} does not keep. Use zero_stage=0 with it."
            )
        if self.mesh is not None:
            check_zero_axes(self.mesh, self.axis_name, stage)
        # Under HSDP the hook all-reduces shares between hosts: any hook will do.
        if stage >= 2 and reduce_scatter_of(hook) is None and not self.hybrid:
            raise ValueError(
                f"comm hook {hook.name!r} has no reduce-scatter form, which "
                f"zero_stage={stage} needs (each device keeps only its share of every "
                "reduced gradient). Hooks with one: allreduce (the default), "
                "bf16_compress, fp16_compress, the compress wrappers of those, and hooks "
                "given one with fdp.hooks.with_reduce_scatter. PowerSGD and the "
                "quantization hooks rebuild whole gradients on every device: use them "
                "with zero_stage=0 or 1."
            )

    # -- resolving what depends on the devices (the first call) -------------------------

    def bind(self) -> StepConfig:
        """This config with its mesh and layout resolved (starts JAX's backend).

        ``layout='auto'`` becomes ``'flat'`` (DDP's packed buckets, kept apart by
        the compiler options of :attr:`compiler_options`) on GPUs and on CPU with
        several processes, else ``'leaves'``. On GPUs (compiled for 8 x H100,
        deviceless, docs/gpu.md) XLA splits a bucket of leaves into one
        all-reduce per leaf once its combiner is off, and its combiner regroups
        them by size otherwise; a flat bucket stays one collective. Measured on 2
        processes x 1 CPU device (gloo, an 8.4M-parameter MLP): one combined
        all-reduce after the backward pass gave 683-718 examples/s; flat buckets
        kept apart, so each all-reduce can start while the backward pass goes on,
        725-798 (25 MiB buckets) and 983-1006 (2.5 MiB). In one process the
        buckets gain nothing and their packing costs a copy.
        """
        mesh = default_mesh(self.axis_name) if self.mesh is None else self.mesh
        if self.zero_stage:
            check_zero_axes(mesh, self.axis_name, self.zero_stage)
        layout = self.layout
        platform = mesh.devices.flat[0].platform
        if layout == "auto":
            cpus = platform == "cpu" and jax.process_count() > 1
            layout = "flat" if _on_gpu(mesh) or cpus else "leaves"
        # The accelerations of the platform's backend (fdp.backends), chosen here.
        backend = backends.for_platform(platform)
        fold = backend.fold_dots if self.fold_dots is None else self.fold_dots
        hook = self._backend_hook(mesh) or self.comm_hook
        if (
            mesh is self.mesh
            and layout == self.layout
            and fold is self.fold_dots
            and hook is self.comm_hook
        ):
            return self
        reduction = dataclasses.replace(self.reduction, layout=layout, comm_hook=hook)
        return dataclasses.replace(self, mesh=mesh, fold_dots=fold, reduction=reduction)

    def _backend_hook(self, mesh: Mesh) -> CommHook | None:
        """The hook the platform's backend binds the default mean to here, or None.

        Only the default hook (``comm_hook=None``), with no ZeRO, hierarchy,
        reduce dtype or model averager to keep XLA's collectives for. On CPU
        processes with one device each and the data axis over all of them, the
        CPU backend's ``shm_where_possible`` (docs/performance.md).
        """
        if not (
            is_default(self.comm_hook)
            and self.zero_stage == 0
            and not self.hierarchical
            and self.reduce_dtype is None
            and self.model_averager is None
        ):
            return None
        data = math.prod(mesh.shape[a] for a in axis_names_of(self.axis_name))
        backend = backends.for_platform(mesh.devices.flat[0].platform)
        return backend.default_mean_hook(mesh, data)

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` has nothing left to resolve."""
        return (
            self.mesh is not None
            and self.layout != "auto"
            and self.fold_dots is not None
            and not self._swap_pending
        )

    @functools.cached_property
    def _swap_pending(self) -> bool:
        # Read on every call of a step (through ``bound``): decided once per config.
        assert self.mesh is not None
        return self._backend_hook(self.mesh) is not None

    def _need_bound(self, what: str) -> Mesh:
        if self.mesh is None or not self.bound:
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
    def axis_names(self) -> tuple[str, ...]:
        """The mesh axes that form the data axis, outer first."""
        return axis_names_of(self.axis_name)

    @property
    def num_replicas(self) -> int:
        """Devices along the data axis (DDP's world size)."""
        return check_axis(self._need_bound("num_replicas"), self.axis_name)

    @property
    def check_vma(self) -> bool:
        """Whether the step's shard_map tracks replication.

        Off for hooks whose collectives JAX cannot type, and on a 1-device axis,
        where fdp's reductions become identities. A step whose last micro-batch
        and reductions share a loop of one trip turns it off too
        (``StepPlan.last_in_loop``).
        """
        averager_safe = self.model_averager is None or self.model_averager.vma_safe
        return self.hook.vma_safe and averager_safe and self.num_replicas > 1

    @property
    def reduces_with_last_micro_batch(self) -> bool:
        """Whether the last micro-batch and the bucket reductions may share a one-trip loop (GPU).

        With the last micro-batch held (:attr:`holds_last_micro_batch`: accumulation
        on GPUs, more than one data device), grouped buckets (:attr:`groups_buckets`: the
        mean all-reduce hook, which keeps no state) and stage 0: inside that loop
        the accumulator is the loop's parameter, so XLA:GPU adds each
        weight-gradient product of the last micro-batch into it in place and
        all-reduces it there (after the loop it would give each product and each
        sum a buffer of its own). Mixed precision is left out: its gradients are
        cast back to the master dtypes after the reduction, and so are meshes
        with model axes (the loop is not tried on model-split carries). The
        step's plan decides the rest (``StepPlan.last_in_loop``): the loop's carry
        goes from per-device to replicated, so that step runs without
        replication typing.
        """
        return (
            self.holds_last_micro_batch
            and self.zero_stage == 0
            and self.sharding.param_dtype is None
            and self.groups_buckets
            and self._data_axes_alone
        )

    @property
    def _data_axes_alone(self) -> bool:
        """Whether every mesh axis but the data axes has size 1 (no model split)."""
        return not self.model_axes

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The mesh axes of more than one device besides the data axes (tensor parallelism)."""
        mesh, data = self._need_bound("model_axes"), set(self.axis_names)
        return tuple(a for a, size in mesh.shape.items() if a not in data and size > 1)

    @property
    def scatters_gradients(self) -> bool:
        """Whether each device gets only its share of the reduced gradients (ZeRO).

        Stages 2 and 3 always; stage 1 too when the hook has a reduce-scatter form
        (the default has), since the update reads only the device's share anyway:
        a reduce-scatter moves half the bytes of the all-reduce it replaces, so
        stage 1 sends what DDP sends. Hooks without one (PowerSGD, quantization)
        all-reduce at stage 1, and each device keeps its slice.
        """
        if self.zero_stage >= 2 or self.hybrid:  # HSDP: the hook all-reduces shares
            return True
        return self.zero_stage == 1 and reduce_scatter_of(self.comm_hook) is not None

    @property
    def gathers_per_use(self) -> bool:
        """Whether stage 3 gathers each bucket where it is used (:mod:`fdp.step.grads._per_use`).

        Needs the default mean reduce-scatter (the plain or default all-reduce
        hook): the gradient leaves the backward pass as the all-gather's
        transpose, a plain sum, with no hook to run. Other hooks gather every
        bucket at the start of the step, as ``reshard_after_forward=False`` does.
        With HSDP any hook will do: inside a host the sum is plain, and the hook
        runs on the shares' hop between hosts after the backward pass.
        """
        return (
            self.zero_stage >= 3
            and self.sharding.reshard_after_forward
            and (self.hybrid or is_mean_reduce_scatter(reduce_scatter_of(self.hook)))
        )

    @property
    def reduces_scanned_in_loop(self) -> bool:
        """Whether a scanned layer stack's gradient is reduced inside the backward loop.

        :mod:`fdp.step.grads._scanned`: all-reduced at stage 0, reduce-scattered at
        stages 1-2 (not with HSDP, whose hook runs between hosts after the
        backward pass); with the plain mean all-reduce (no hook to run), one
        micro-batch (more would reduce in each), replication tracking (the
        reduction is the transpose of a typed cast) and the parameters' own
        dtype (a ``param_dtype`` cast of the stack before its scan leaves no
        per-layer form: the scan would run whole in a remat, its forward pass
        twice).
        """
        stage = self.zero_stage == 0 or (
            self.zero_stage in (1, 2) and self.scatters_gradients and not self.hybrid
        )
        return (
            stage
            and self.sharding.param_dtype is None
            and self.accumulate_steps == 1
            and self.check_vma
            and is_mean_reduce_scatter(reduce_scatter_of(self.hook))
        )

    @property
    def prefetch_groups(self) -> int:
        """How many gather groups ahead stage 3's gathers may start (0: at their own use).

        With ``Sharding(prefetch=True)`` (the default), and only on GPU, where
        collectives are asynchronous and the scheduler keeps at most
        :data:`PER_USE_IN_FLIGHT` in flight: XLA:CPU's collectives block, so an
        early gather hides nothing there and its scheduler would hold the
        gathered parameters from the earliest point allowed (measured with
        gathers tied 16 uses ahead: every layer of an 8-layer MLP at once).
        """
        on_gpu = _on_gpu(self._need_bound("prefetch_groups"))
        return PREFETCH_GROUPS if on_gpu and self.sharding.prefetch else 0

    @property
    def gather_group_bytes(self) -> int:
        """Bytes per stage-3 gather group: ``bucket_cap_mb`` (GPU), 0 (CPU).

        Consecutive uses are gathered as one collective until their parameters
        (whole, in their own dtype: with ``param_dtype`` the gathers move fewer
        bytes) reach this size, in the forward pass and again in the backward
        pass, where the group's gradients leave as one reduce-scatter: FSDP2's
        one all-gather per wrapped module. 0 where :attr:`prefetch_groups` is 0:
        each use on its own.
        """
        return int(self.bucket_cap_mb * 2**20) if self.prefetch_groups else 0

    @property
    def compiler_options(self) -> dict[str, Any] | None:
        """XLA options for the step: DDP's buckets kept apart where XLA would merge them.

        On CPU, the flat layout turns off the all-reduce combiner (which merges
        every all-reduce into one). On GPU, every bucket's collective stays its
        own: XLA:GPU's combiners would otherwise regroup the buckets up to
        their thresholds (30 MiB by default), ignoring the plan. The gradients'
        all-reduces and reduce-scatters are kept apart always; all-gathers at
        stage 3, where fdp gathers the parameters bucket by bucket (at stages
        1-2 they are XLA's own, one per leaf, and left to its combiner).
        XLA's limit of one collective in flight at a time is kept: raising it to 4
        hid more of a 6-layer GPT's communication (0.35 to 0.66) and less of a
        12-layer one's (0.45 to 0.25), compiled for 8 x H100 (docs/gpu.md).
        Except where stage 3 gathers per use: a leaf's gather is one of many small
        ones, and with one in flight a gather issued ahead of its use
        (:attr:`prefetch_groups`) waits for every one before it;
        ``PER_USE_IN_FLIGHT`` of them may fly at once (docs/zero.md, Prefetch);
        the all-gathers of a gather group, and its reduce-scatters, tagged with
        the group's key, merge into one each (:attr:`gather_group_bytes`);
        and a scanned stack's per-layer reduce-scatters stay in their loop trip:
        XLA's pipeliner would move each into the next trip and keep the layer's
        whole gradient (and a copy) alive across it, 11% of the peak of issue
        31's scanned GPT compiled for 8 x H100 (docs/zero.md, Scanned models).
        """
        mesh = self._need_bound("compiler_options")
        if mesh.devices.flat[0].platform == "cpu":
            return _compat.keep_all_reduces_apart() if self.layout == "flat" else None
        if _on_gpu(mesh):
            kinds = ("all-reduce", "reduce-scatter")
            kinds = (*kinds, "all-gather") if self.zero_stage >= 3 else kinds
            options: dict[str, Any] = (
                _compat.group_gpu_all_reduces_by_key(kinds)
                if self.groups_buckets
                else _compat.keep_gpu_collectives_apart(kinds)
            )
            if self.gathers_per_use:  # the next uses' gathers fly beside this one's
                options.update(_compat.gpu_collectives_in_flight(PER_USE_IN_FLIGHT))
                options.update(_compat.gpu_reduce_scatters_in_their_trip())
                if self.prefetch_groups:  # a gather group's collectives merge into one
                    grouped = ("all-gather", "reduce-scatter")
                    options.update(_compat.group_gpu_collectives_by_key(grouped))
            return _compat.known_compile_options(_own_device(mesh), options)
        return None

    @property
    def on_gpu(self) -> bool:
        """Whether the bound mesh's devices are GPUs (compile-only ones included)."""
        return _on_gpu(self._need_bound("on_gpu"))

    @property
    def holds_last_micro_batch(self) -> bool:
        """Whether the last micro-batch runs after the loop over the others (accumulation).

        The reductions that follow then depend on its backward pass alone and
        may overlap it: on an accelerator (XLA:CPU overlaps no collective) and
        with more than one device on the data axis (on one, fdp reduces
        nothing). Elsewhere every micro-batch runs in the one loop, as plain
        jit's scan does: holding the last one back would copy the first K-1 and
        compile the loop's body twice, for nothing to overlap.
        """
        mesh = self._need_bound("holds_last_micro_batch")
        on_cpu = mesh.devices.flat[0].platform == "cpu"
        return self.accumulate_steps > 1 and not on_cpu and self.num_replicas > 1

    @property
    def groups_buckets(self) -> bool:
        """Whether each bucket is one all-reduce of its gradients where they lie (GPU).

        On GPUs, with the flat layout and the mean all-reduce hook (no ZeRO
        scatter, no model averager), each gradient's all-reduce is tagged with
        its bucket's key and XLA:GPU's combiner merges a bucket's into one
        all-reduce of several operands
        (:func:`fdp._compat.group_gpu_all_reduces_by_key`). Packing a flat
        buffer instead copies each gradient once more: compiled for 8 x H100,
        an MLP whose buckets join a 64 MiB kernel to a bias needed 1.10x plain
        jit's temp memory packed, 0.98x grouped (docs/gpu.md). A bucket split
        over model axes is all-reduced on each device's block
        (:func:`fdp.collectives._blocks.on_blocks`): left to XLA's partitioner,
        its leaves' all-reduces came out one per leaf, untagged (34 over
        'data' for the 13 buckets of the tensor-parallel GPT in
        docs/benchmarks.md). Other hooks pack, with every collective kept apart.
        """
        mesh = self._need_bound("groups_buckets")
        return (
            _on_gpu(mesh)
            and self.layout == "flat"
            and not self.scatters_gradients
            and self.model_averager is None
            and is_mean_all_reduce(self.hook)
        )

    @property
    def per_device_state(self) -> bool:
        """Whether replicas may diverge, so the state is kept once per device."""
        return not self.comm_hook.replicated_output

    def shard_map(
        self, fn: Callable[..., Any], in_specs: Any, out_specs: Any, *, check_vma: bool = True
    ) -> Any:
        """``jax.shard_map`` of ``fn``, manual over the data axis only.

        Other mesh axes stay under the compiler, so parameters may be sharded
        over them. Replication is tracked where :attr:`check_vma` allows and
        ``check_vma`` is not False.
        """
        return jax.shard_map(
            fn,
            mesh=self._need_bound("shard_map"),
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(self.axis_names),
            check_vma=self.check_vma and check_vma,
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
            if field.name in POLICIES:  # flat, under fdp 0.1's names: logs read the same
                for inner in dataclasses.fields(value):
                    name = inner.metadata.get("old", inner.name)
                    _describe_into(out, name, getattr(value, inner.name))
            else:
                _describe_into(out, field.name, value)
        return out


def _describe_into(out: dict[str, Any], name: str, value: Any) -> None:
    """``out[name]``: ``value`` as plain data (a mesh and a hook as two entries each)."""
    if isinstance(value, Mesh):
        out["mesh"] = dict(value.shape)
        out["mesh_device_ids"] = [int(d.id) for d in value.devices.flat]
    elif isinstance(value, CommHook):
        out["comm_hook"] = value.name
        out["comm_hook_flags"] = (
            f"replicated_output={value.replicated_output}, vma_safe={value.vma_safe}"
        )
    elif isinstance(value, np.dtype):
        out[name] = str(value)
    elif callable(value):  # a buffer hook: its name, the same on every process
        out[name] = getattr(value, "__qualname__", type(value).__name__)
    elif isinstance(value, tuple):  # a host x device axis_name
        out[name] = list(value)
    elif value is None or isinstance(value, str | int | float | bool):
        out[name] = value
    else:
        out[name] = repr(value)


def check_zero_axes(mesh: Mesh, axis_name: AxisName, stage: int) -> None:
    """Refuses ZeRO where a model axis of ``mesh`` is ``Explicit``, naming the fix.

    Inside the step a value split over an Explicit axis carries that split in
    its type, and JAX (0.10 to 0.12) cannot reduce-scatter or flatten such a
    value over the data axis (``psum_scatter``'s type rule fails on it). On
    ``Auto`` model axes ZeRO composes with the model split; stage 0 works on both.
    """
    data = set(axis_names_of(axis_name))
    explicit = [
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if name not in data and mesh.shape[name] > 1 and kind == AxisType.Explicit
    ]
    if explicit:
        raise ValueError(
            f"zero_stage={stage} on a mesh whose model axes {explicit} are Explicit: "
            "inside the step JAX cannot reduce-scatter a value whose type splits it over "
            "an Explicit axis. Make those axes Auto (jax.make_mesh(..., axis_types=("
            "AxisType.Auto, ...))) for ZeRO with tensor parallelism, or use zero_stage=0, "
            "which works on Explicit axes too."
        )


def _own_device(mesh: Mesh) -> Any:
    """A device of ``mesh`` this process can compile for (one of its own where it has one)."""
    mine = jax.process_index()
    return next((d for d in mesh.devices.flat if d.process_index == mine), mesh.devices.flat[0])


def _on_gpu(mesh: Mesh) -> bool:
    """Whether ``mesh``'s devices are GPUs (CUDA or ROCm), compile-only ones included."""
    return mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")


def config_of(settings: dict[str, Any]) -> StepConfig:
    """The :class:`StepConfig` of a builder's settings, checked now.

    With ``bucket_cap_mb="auto"`` every other setting is checked at DDP's
    default cap; the tuner builds the steps it times from ``settings``.
    """
    reduction = settings["reduction"]
    if reduction.auto:
        settings = {**settings, "reduction": dataclasses.replace(reduction, bucket_cap_mb=25.0)}
    return StepConfig(**settings)
