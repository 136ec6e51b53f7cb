"""Post-local SGD: global averaging first, then only within subgroups.

A periodic model averager averages parameters over the whole data axis.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from fdp._validate import check_int
from fdp.bucketing import BucketPlan
from fdp.collectives import axis_size, vary
from fdp.collectives._axis import AxisName
from fdp.hooks._contract import CommHook, GradBucket, HookState, mean_all_reduce


def subgroups(axis_name: AxisName, subgroup_size: int | None) -> list[list[int]]:
    """Consecutive ranks of the data axis in groups of ``subgroup_size``.

    ``None`` means the devices of one process (``jax.local_device_count()``),
    DDP's default of one subgroup per node.

    Raises:
      ValueError: the axis size is not a multiple of the subgroup size.
    """
    n = axis_size(axis_name)
    size = jax.local_device_count() if subgroup_size is None else subgroup_size
    if n % size:
        raise ValueError(f"subgroup_size={size} must divide the {n} devices of axis {axis_name!r}.")
    return [list(range(start, start + size)) for start in range(0, n, size)]


def post_local_sgd(
    start_local_sgd_iter: int,
    *,
    subgroup_size: int | None = None,
    post_local_gradient_allreduce: bool = True,
) -> CommHook:
    """DDP's ``post_localSGD_hook`` with ``PostLocalSGDState``.

    For the first ``start_local_sgd_iter`` iterations gradients are averaged
    over the whole data axis. After that they are averaged only within
    subgroups of ``subgroup_size`` consecutive devices (or not at all with
    ``post_local_gradient_allreduce=False``), so replicas in different
    subgroups drift apart until a :class:`PeriodicModelAverager` averages the
    parameters. The step therefore keeps one train state per device.

    Args:
      start_local_sgd_iter: iterations of global averaging first.
      subgroup_size: devices per subgroup; default: the devices of one process.
      post_local_gradient_allreduce: average within subgroups after the start.

    Returns:
      The hook.

    Raises:
      ValueError: a setting is out of range.
    """
    start = check_int(start_local_sgd_iter, "start_local_sgd_iter", low=0)
    if subgroup_size is not None:
        check_int(subgroup_size, "subgroup_size", low=1)

    def init(params: Any, plan: BucketPlan) -> HookState:
        del params, plan
        return {"iter": jnp.zeros((), jnp.int32)}

    def global_mean(bucket: GradBucket) -> list[jax.Array]:
        return mean_all_reduce(list(bucket.gradients), bucket.axis_name, divide_first=False)

    def local_mean(bucket: GradBucket) -> list[jax.Array]:
        if not post_local_gradient_allreduce:
            return list(bucket.gradients)
        groups = subgroups(bucket.axis_name, subgroup_size)
        return mean_all_reduce(
            list(bucket.gradients), bucket.axis_name, divide_first=False, groups=groups
        )

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        out = jax.lax.cond(
            state["iter"] < start, lambda: global_mean(bucket), lambda: local_mean(bucket)
        )
        if bucket.is_last:
            state = {"iter": state["iter"] + 1}
        return out, state

    name = f"post_local_sgd(start={start}, subgroup_size={subgroup_size})"
    # Grouped psum is outside shard_map's replication typing, and replicas diverge.
    return CommHook(name, init, reduce, replicated_output=False, vma_safe=False)


class ModelAverager:
    """What ``fdp.train_step(model_averager=...)`` accepts (torch's ``ModelAverager``).

    A model averager is called on every device after the optimizer update with
    the parameters and the step before the update, and returns the parameters,
    averaged over some replica group of the data axis or unchanged.
    """

    #: Whether the averager's collectives stay inside shard_map's replication
    #: typing (a grouped ``psum`` does not).
    vma_safe: bool = True

    def average(self, params: Any, step: jax.Array, axis_name: AxisName) -> Any:
        """``params`` averaged as due at ``step``, else unchanged."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PeriodicModelAverager(ModelAverager):
    """DDP's ``PeriodicModelAverager``: average parameters every ``period`` steps.

    At step ``t`` (counted from 0, the train state's step before the update),
    parameters are averaged over the whole data axis after the optimizer update
    when ``t >= warmup_steps`` and ``(t - warmup_steps) % period == 0``.
    Optimizer state is not averaged, as in torch.

    Attributes:
      period: steps between averagings (>= 1).
      warmup_steps: steps before the first averaging (usually the hook's
        ``start_local_sgd_iter``).
    """

    period: int
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        check_int(self.period, "period", low=1)
        check_int(self.warmup_steps, "warmup_steps", low=0)
        if self.period == 1:
            warnings.warn(
                "PeriodicModelAverager(period=1) all-reduces every parameter every step, "
                "no cheaper than averaging gradients; plain data parallelism is enough.",
                UserWarning,
                stacklevel=2,
            )

    def due(self, step: jax.Array) -> jax.Array:
        """Whether parameters are averaged after step ``step``."""
        after = step - self.warmup_steps
        return (step >= self.warmup_steps) & (after % self.period == 0)

    def average(self, params: Any, step: jax.Array, axis_name: AxisName) -> Any:
        """``params`` averaged over ``axis_name`` when :meth:`due`, else unchanged."""
        return jax.lax.cond(
            self.due(step),
            # The averaged copy is replicated; typed per-device like the other branch.
            lambda p: vary(jax.tree.map(lambda x: jax.lax.pmean(x, axis_name), p), axis_name),
            lambda p: p,
            params,
        )
