"""A step's options, grouped: four small frozen policies, each checking its own fields.

:func:`fdp.train_step`, :func:`fdp.nnx_train_step` and :func:`fdp.grad_accumulator`
take these values instead of a flat list of keywords, as FSDP2's ``fully_shard``
takes a ``MixedPrecisionPolicy``: one value per question a user asks.

- :class:`Reduction`: how gradients travel (DDP's buckets, the comm hook, its dtype
  and levels, periodic parameter averaging);
- :class:`Accumulation`: micro-batches per step and how their gradients add up;
- :class:`Loss`: what ``loss_fn`` returns and how its examples are weighed;
- :class:`Sharding`: what is sharded over the data axis (ZeRO).

Being frozen and hashable, a policy is a valid static argument of ``jax.jit`` and
can be shared between steps. Rules between policies (``hierarchical`` and ZeRO,
``reduce_dtype`` and ZeRO) are checked by :class:`fdp.step.options._config.StepConfig`.

:func:`from_keywords` is the one bridge from the flat keywords of fdp 0.1 to these
values; the keyword names are the policies' field names (or a field's ``old``
metadata), so the list is written once.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from fdp.backends import resolve_hook
from fdp.bucketing import cap_limits
from fdp.hooks import CommHook, ModelAverager
from fdp.hooks._diloco import DiLoCo
from fdp.hooks._two_level import hierarchical as two_level
from fdp.step.layout._zero import check_stage

StepLayout = Literal["auto", "leaves", "flat"]
LAYOUTS = ("auto", "leaves", "flat")
ShardOver = Literal["all", "inner"]
SHARD_OVER = ("all", "inner")
ACCUMULATE_OPS = ("mean", "sum")
WEIGHTINGS = ("example", "device")
NORMALIZATIONS = ("mean", "tokens")
DEFAULT_CAP_MB = 25.0  # DDP's bucket_cap_mb


def _floating(value: Any, name: str) -> np.dtype | None:
    """``value`` as a numpy floating dtype (None stays None), or a clear error."""
    if value is None:
        return None
    try:
        dtype = np.dtype(jnp.dtype(value))
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (e.g. jnp.float32), got {value!r}.")
    return dtype


def _bool(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reduction:
    """How gradients are reduced over the data axis (DDP's buckets and comm hook).

    Attributes:
      bucket_cap_mb: DDP's ``bucket_cap_mb`` (MiB), or ``"auto"``: the step
        times a few caps and layouts at its first call (:func:`fdp.tune`) and
        runs the fastest.
      first_bucket_cap_mb: cap of the first bucket (MiB).
      layout: ``'auto'`` (``'flat'`` on GPUs and on CPU with several processes,
        else ``'leaves'``), ``'leaves'`` (no copies) or ``'flat'`` (DDP's packed
        bucket buffers); see :func:`fdp.reduce_gradients`.
      comm_hook: a :class:`fdp.hooks.CommHook`, a hook name, or None for the
        mean all-reduce. A name becomes its hook when the policy is made.
      hierarchical: with ``axis_name=(outer, inner)``, reduce each bucket in
        two levels (:func:`fdp.hooks.hierarchical`): reduce-scatter inside
        hosts, ``comm_hook`` across hosts on ``1/inner`` of the bytes,
        all-gather inside hosts. With ZeRO, only together with
        ``Sharding(shard_over="inner")``, which reduces so anyway.
      reduce_dtype: the dtype gradients are reduced in (FSDP2's
        ``MixedPrecisionPolicy.reduce_dtype``), None for their own. Wider than
        a gradient: cast up, reduced, cast back. Narrower: sent in it and
        summed in float32. Sets the default hook's dtype only.
      model_averager: averages parameters over the data axis (or groups of it)
        after the update (post-local SGD, :func:`fdp.hooks.diloco`), or None.
        DiLoCo brings its own comm hook.
      grad_norm: also return the reduced gradient's global L2 norm in
        ``metrics['grad_norm']`` (what ``optax.clip_by_global_norm`` sees;
        :mod:`fdp.step.grads._norm`). Off by default: at stage 0 it is one more read
        of the whole gradient, at stages 1-3 one all-reduce of a scalar.

    Example:
      >>> import fdp
      >>> r = fdp.Reduction(bucket_cap_mb=5, comm_hook="bf16_compress")
      >>> r.bucket_cap_mb, r.comm_hook.name, r.layout
      (5.0, 'bf16_compress', 'auto')
      >>> fdp.Reduction(layout="packed")
      Traceback (most recent call last):
      ...
      ValueError: layout must be one of ('auto', 'leaves', 'flat'), got 'packed'.
    """

    bucket_cap_mb: float | Literal["auto"] = DEFAULT_CAP_MB
    first_bucket_cap_mb: float = 1.0
    layout: StepLayout = "auto"
    comm_hook: CommHook | str | None = None  # a CommHook once made
    hierarchical: bool = False
    reduce_dtype: Any = None
    model_averager: ModelAverager | None = None
    # New in this policy: not a flat keyword of fdp 0.1, so the shim does not take it.
    grad_norm: bool = dataclasses.field(default=False, metadata={"new": True})

    def __post_init__(self) -> None:
        if not isinstance(self.grad_norm, bool):
            raise TypeError(f"grad_norm must be True or False, got {self.grad_norm!r}.")
        auto = self.bucket_cap_mb == "auto"
        # A number (checked by cap_limits), or "auto": checked at DDP's default.
        cap: Any = DEFAULT_CAP_MB if auto else self.bucket_cap_mb
        cap_limits(cap, self.first_bucket_cap_mb)
        # Plain floats from here on (np.float32(25) is accepted), for logs and the DETAIL check.
        if not auto:
            object.__setattr__(self, "bucket_cap_mb", float(self.bucket_cap_mb))
        object.__setattr__(self, "first_bucket_cap_mb", float(self.first_bucket_cap_mb))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}.")
        hook = resolve_hook(self.comm_hook)
        averager = self.model_averager
        if averager is not None and not isinstance(averager, ModelAverager):
            raise TypeError(
                "model_averager must be a fdp.hooks.PeriodicModelAverager, "
                "fdp.hooks.HierarchicalModelAverager or fdp.hooks.diloco(...), got "
                f"{type(averager).__name__}."
            )
        if isinstance(averager, DiLoCo) and hook != averager.hook:
            if hook.name != "allreduce":
                raise ValueError(
                    f"model_averager={averager.hook.name} brings its own comm hook (inner "
                    f"steps communicate nothing); got comm_hook={hook.name!r}. "
                    "Leave comm_hook unset."
                )
            hook = averager.hook
        object.__setattr__(self, "comm_hook", hook)
        _bool(self.hierarchical, "hierarchical")
        if self.hierarchical:
            two_level(hook)  # refuses hooks whose replicas diverge
        dtype = _floating(self.reduce_dtype, "reduce_dtype")
        object.__setattr__(self, "reduce_dtype", dtype)
        if dtype is not None and hook.name != "allreduce":
            raise ValueError(
                f"reduce_dtype={dtype.name!r} sets the dtype of the default mean all-reduce; "
                f"got comm_hook={hook.name!r}. With a hook, pick its dtype with the "
                "hook (bf16_compress_wrapper, compressed_allreduce)."
            )

    @property
    def auto(self) -> bool:
        """Whether the bucket cap is chosen by timing (``bucket_cap_mb="auto"``)."""
        return self.bucket_cap_mb == "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accumulation:
    """Gradient accumulation: micro-batches per step, reduced once (DDP's ``no_sync``).

    Attributes:
      steps: split each device's share of the batch into this many
        micro-batches, accumulate their gradients locally and reduce once.
      dtype: the accumulation dtype (None: float32 for 16-bit parameters).
      op: how the micro-batch gradients combine: ``'mean'`` (a step equals one
        step on the whole batch, as ``optax.MultiSteps``) or ``'sum'`` (torch's
        ``no_sync``, which adds into ``.grad``: K times the mean's gradient).

    Example:
      >>> import fdp
      >>> fdp.Accumulation(steps=4, dtype="bfloat16").dtype
      dtype(bfloat16)
      >>> fdp.Accumulation(steps=0)
      Traceback (most recent call last):
      ...
      ValueError: Accumulation.steps must be >= 1, got 0.
    """

    steps: int = dataclasses.field(default=1, metadata={"old": "accumulate_steps"})
    dtype: Any = dataclasses.field(default=None, metadata={"old": "accum_dtype"})
    op: str = dataclasses.field(default="mean", metadata={"old": "accumulate_op"})

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int):
            raise TypeError(f"Accumulation.steps must be an int >= 1, got {self.steps!r}.")
        if self.steps < 1:
            raise ValueError(f"Accumulation.steps must be >= 1, got {self.steps}.")
        object.__setattr__(self, "dtype", _floating(self.dtype, "Accumulation.dtype"))
        if self.op not in ACCUMULATE_OPS:
            raise ValueError(f"Accumulation.op must be one of {ACCUMULATE_OPS}, got {self.op!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loss:
    """The loss contract: what ``loss_fn`` returns, and how its examples are weighed.

    Attributes:
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux values are averaged
        over the data axis (integer and bool leaves summed) into
        ``metrics['aux']``.
      per_example: ``loss_fn`` returns one loss per example. Batches that do
        not split evenly are then padded and masked, and ``mask=`` weighs
        examples (0 for padding).
      weighting: with ``per_example``, ``'example'`` (every real example weighs
        the same: one device on the whole batch) or ``'device'`` (each
        device's mean over its real examples counts once: DDP with different
        local batch sizes).
      divide_by_initial_world_size: with ``per_example``, whether devices that
        hold rows of the batch but no real example (out of data under
        :func:`fdp.join`) still count in the divisor (torch's ``Join``).
      gather_aux: which ``aux`` leaves come back gathered along the batch (one
        row per example, in the batch's order) instead of averaged: ``True``,
        those whose leading size is the local micro-batch's (logits);
        ``False``, none; or a function ``fn(key_path) -> bool`` naming them
        (``jax.tree_util.keystr`` paths).
      find_unused_parameters: some parameters may not reach the loss: leave
        them (and their optimizer state) untouched in steps where no device
        used them (DDP's ``find_unused_parameters``).
      normalize: ``'mean'`` (the default): ``loss_fn`` returns its mean loss,
        and the step averages the devices' (DDP). ``'tokens'``: ``loss_fn``
        returns ``(loss_sum, weight)``, the sum of its per-token losses and
        how many tokens they are (any float weight: the padding-masked token
        count of a language model); the step divides the sum over every
        device and micro-batch by the step's global weight, as MaxText and
        torchtitan normalise, so the gradient is one device's on the whole
        batch whatever the padding, the devices and the accumulation.
        ``metrics['loss']`` is the per-token mean.

    Example:
      >>> import fdp
      >>> fdp.Loss(per_example=True, weighting="device").weighting
      'device'
      >>> fdp.Loss(weighting="device")
      Traceback (most recent call last):
      ...
      ValueError: weighting='device' weighs real examples per device and needs
      per_example=True (a loss_fn returning one loss per example).
    """

    has_aux: bool = False
    per_example: bool = False
    weighting: str = "example"
    divide_by_initial_world_size: bool = True
    gather_aux: bool | Callable[[str], bool] = True
    find_unused_parameters: bool = False
    normalize: str = "mean"

    def __post_init__(self) -> None:
        for name in ("has_aux", "per_example", "divide_by_initial_world_size"):
            _bool(getattr(self, name), name)
        _bool(self.find_unused_parameters, "find_unused_parameters")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}.")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {self.normalize!r}.")
        if self.normalize == "tokens" and self.per_example:
            raise ValueError(
                "normalize='tokens' (loss_fn returns (loss_sum, weight)) and per_example=True "
                "(one loss per example) are two contracts; pick one."
            )
        if self.weighting != "example" and not self.per_example:
            raise ValueError(
                f"weighting={self.weighting!r} weighs real examples per device and needs "
                "per_example=True (a loss_fn returning one loss per example)."
            )
        if not (isinstance(self.gather_aux, bool) or callable(self.gather_aux)):
            raise TypeError(
                "gather_aux must be True, False or a function fn(key_path) -> bool, "
                f"got {self.gather_aux!r}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sharding:
    """What is sharded over the data axis, and when.

    ZeRO's stage, at stage 3 when parameters are gathered, on a host x
    device data axis which of its axes the state is sharded over, and the
    dtype parameters are gathered and computed in.

    Attributes:
      zero_stage: ZeRO's stage (DeepSpeed's meaning): ``0`` DDP (everything
        whole on every device); ``1`` the optimizer state sharded; ``2`` also
        the reduced gradients (each bucket is reduce-scattered); ``3`` also the
        parameters, which stay sharded between steps. See docs/zero.md.
      reshard_after_forward: stage 3 only, FSDP2's setting of that name.
        ``True`` (default): each parameter is gathered where the forward pass
        uses it, freed after, and gathered again for the backward pass
        (:mod:`fdp.step.grads._per_use`; with the default mean hook, else as
        ``False``); on GPU with ``prefetch``, the forward pass's last gather
        group is kept for the backward pass, as FSDP2 keeps its root module. ``False``: every
        bucket is gathered at the start of the step and kept until the
        backward pass is done (one gather per bucket, stage 1's peak memory),
        for users who have the memory.
      shard_over: on a host x device data axis (``axis_name=fdp.HOST_AXES``),
        which devices share the sharded state. ``"all"`` (default): every
        device of the data axis holds ``1/N`` (``N`` = all devices; on a
        single data axis there is no other choice). ``"inner"``: hybrid
        sharding (HSDP, ZeRO++'s hpZ): each host's ``k`` devices hold ``1/k``
        and the hosts keep replicas of it; gradients are reduce-scattered
        inside each host and only the ``1/k`` shares cross hosts, all-reduced
        with the step's ``comm_hook`` (``"bf16_compress"``, an int8 hook), and
        stage 3 gathers parameters inside the host only. Needs
        ``zero_stage`` >= 1 and ``axis_name=(outer, inner)``. See
        docs/zero.md.
      param_dtype: FSDP2's ``MixedPrecisionPolicy.param_dtype``: the dtype the
        loss sees its floating parameters in, and at stage 3 the dtype of the
        parameters' all-gathers (``jnp.bfloat16``: half the bytes). The
        parameters and the optimizer state stay in their own dtype (float32
        master weights) and sharded as the stage says; the gradients flow back
        to them in that dtype and are reduced as the :class:`Reduction` says.
        None (default): the parameters' own dtype. Any stage; see docs/zero.md.
      prefetch: stage 3 gathered per use, on GPU (FSDP's forward and backward
        prefetch, DeepSpeed's prefetch bucket). ``True`` (default): consecutive
        uses are gathered in groups of about ``bucket_cap_mb`` of parameters
        (one all-gather and one reduce-scatter per group), each group one group
        ahead of its use in the forward and in the backward pass: fewer, larger
        collectives, started while the group before computes, for more memory
        (a group gathered ahead in each pass). ``False``: each use gathered on
        its own just before it, the most memory-frugal. On CPU, whose
        collectives block, a step always gathers as ``False`` does. See
        docs/zero.md, Prefetch.

    Example:
      >>> import fdp
      >>> fdp.Sharding(zero_stage=2).zero_stage
      2
      >>> fdp.Sharding(zero_stage=3, reshard_after_forward=False).reshard_after_forward
      False
      >>> fdp.Sharding(zero_stage=3, prefetch=False).prefetch
      False
      >>> fdp.Sharding(zero_stage=3, shard_over="inner").shard_over
      'inner'
      >>> fdp.Sharding(shard_over="inner")
      Traceback (most recent call last):
      ...
      ValueError: shard_over='inner' shards ZeRO's state over each host's devices; with
      zero_stage=0 nothing is sharded. Pass zero_stage=1, 2 or 3.
      >>> import jax.numpy as jnp
      >>> fdp.Sharding(zero_stage=3, param_dtype=jnp.bfloat16).param_dtype
      dtype(bfloat16)
    """

    zero_stage: int = 0
    # New in this policy: not a flat keyword of fdp 0.1, so the shim does not take it.
    reshard_after_forward: bool = dataclasses.field(default=True, metadata={"new": True})
    shard_over: ShardOver = dataclasses.field(default="all", metadata={"new": True})
    param_dtype: Any = dataclasses.field(default=None, metadata={"new": True})
    prefetch: bool = dataclasses.field(default=True, metadata={"new": True})

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero_stage", check_stage(self.zero_stage))
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}."
            )
        if not isinstance(self.prefetch, bool):
            raise TypeError(f"prefetch must be True or False, got {self.prefetch!r}.")
        if self.shard_over not in SHARD_OVER:
            raise ValueError(f"shard_over must be one of {SHARD_OVER}, got {self.shard_over!r}.")
        if self.shard_over == "inner" and self.zero_stage == 0:
            raise ValueError(
                "shard_over='inner' shards ZeRO's state over each host's devices; with "
                "zero_stage=0 nothing is sharded. Pass zero_stage=1, 2 or 3."
            )
        object.__setattr__(self, "param_dtype", _floating(self.param_dtype, "param_dtype"))


Policy = Reduction | Accumulation | Loss | Sharding
#: The policies a builder takes, by keyword.
POLICIES: dict[str, type[Policy]] = {
    "reduction": Reduction,
    "accumulation": Accumulation,
    "loss": Loss,
    "sharding": Sharding,
}


def _old_names(cls: type[Policy]) -> dict[str, str]:
    """``{flat keyword of fdp 0.1: field}`` for one policy."""
    return {
        f.metadata.get("old", f.name): f.name
        for f in dataclasses.fields(cls)
        if not f.metadata.get("new")
    }


def from_keywords(
    builder: str, settings: Mapping[str, Any], old: Mapping[str, Any]
) -> dict[str, Any]:
    """A builder's settings with every policy made: given, else from flat keywords.

    The one bridge from fdp 0.1's flat keywords (``bucket_cap_mb=5``) to the
    policies (``reduction=fdp.Reduction(bucket_cap_mb=5)``), kept for one
    release: each flat keyword sets its field and a ``DeprecationWarning``
    names the new spelling. A policy neither given nor set by a flat keyword
    is its default.

    Args:
      builder: the public name of the builder, for messages (``"fdp.train_step"``).
      settings: the builder's keyword arguments; those named in
        :data:`POLICIES` hold a policy or None.
      old: the flat keywords passed (the builder's ``**deprecated``).

    Returns:
      ``settings`` with a policy for every policy keyword.

    Raises:
      TypeError: a keyword that is no flat option of this builder's policies, a
        flat keyword together with the policy it belongs to, or a policy of
        the wrong type.

    Example:
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     out = from_keywords("fdp.train_step", {"reduction": None}, {"bucket_cap_mb": 5})
      >>> out["reduction"].bucket_cap_mb
      5.0
      >>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
      fdp.train_step: bucket_cap_mb= is deprecated; use
      reduction=fdp.Reduction(bucket_cap_mb=...). The flat keywords go in the next release.
    """
    slots = [keyword for keyword in settings if keyword in POLICIES]
    for keyword in slots:
        cls, policy = POLICIES[keyword], settings[keyword]
        if policy is not None and not isinstance(policy, cls):
            raise TypeError(
                f"{builder}: {keyword}= must be a fdp.{cls.__name__}, got "
                f"{type(policy).__name__} ({policy!r})."
            )
    fields: dict[str, dict[str, Any]] = {keyword: {} for keyword in slots}
    advice = []
    for name, value in old.items():
        keyword = next((k for k in slots if name in _old_names(POLICIES[k])), None)
        if keyword is None:
            raise TypeError(f"{builder}() got an unexpected keyword argument {name!r}.")
        cls, field = POLICIES[keyword], _old_names(POLICIES[keyword])[name]
        if settings[keyword] is not None:
            raise TypeError(
                f"{builder}: got both {keyword}= and {name}=, which is a field of it; "
                f"pass {keyword}=fdp.{cls.__name__}(..., {field}={value!r}) alone."
            )
        fields[keyword][field] = value
        advice.append(f"{name}= is deprecated; use {keyword}=fdp.{cls.__name__}({field}=...)")
    if advice:
        warnings.warn(
            f"{builder}: {'; '.join(advice)}. The flat keywords go in the next release.",
            DeprecationWarning,
            stacklevel=3,  # the caller of the builder
        )
    made = {k: settings[k] if settings[k] is not None else POLICIES[k](**fields[k]) for k in slots}
    return {**settings, **made}


def with_cap(base: Reduction | None, bucket_cap_mb: float, layout: str) -> Reduction:
    """``base`` (default: DDP's reduction) with this cap and layout: a tuner's candidate."""
    return dataclasses.replace(base or Reduction(), bucket_cap_mb=bucket_cap_mb, layout=layout)


def with_candidate(kwargs: Mapping[str, Any], bucket_cap_mb: float, layout: str) -> dict[str, Any]:
    """A builder's ``kwargs`` with this cap and layout (the tuner builds its steps so).

    Flat reduction keywords (fdp 0.1, deprecated) stay flat, so that the builder
    does not see them next to ``reduction=``.
    """
    if kwargs.get("reduction") is None and any(k in _old_names(Reduction) for k in kwargs):
        return {**kwargs, "bucket_cap_mb": bucket_cap_mb, "layout": layout}
    return {**kwargs, "reduction": with_cap(kwargs.get("reduction"), bucket_cap_mb, layout)}
