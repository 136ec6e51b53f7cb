"""Hierarchical SGD: parameters averaged over groups of several sizes, each at its period.

torch's ``HierarchicalModelAverager``
(``torch.distributed.algorithms.model_averaging.hierarchical_model_averager``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp._validate import check_int
from fdp.collectives import axis_size, vary
from fdp.collectives._axis import AxisName
from fdp.hooks._local_sgd import ModelAverager


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | np.integer) and bool(value >= 1)


class HierarchicalModelAverager(ModelAverager):
    """DDP's ``HierarchicalModelAverager``: averaging periods per group size.

    ``period_group_size_dict`` maps each averaging period to a group size, in
    increasing order of period. The data axis is cut into groups of consecutive
    devices of that size (torch's ``dist.new_subgroups``); the last size must be
    the whole axis. At step ``t`` (counted from 0, the train state's step before
    the update), when ``t >= warmup_steps`` and some period divides ``t``, the
    parameters are averaged within the groups of the largest such period; else
    they are left alone. Unlike :class:`PeriodicModelAverager`, the periods count
    from step 0, not from ``warmup_steps`` (as in torch). Optimizer state is not
    averaged.

    Use it with a hook that keeps one train state per device, such as
    :func:`fdp.hooks.post_local_sgd`, whose ``start_local_sgd_iter`` should equal
    ``warmup_steps``.

    Args:
      period_group_size_dict: ``{period: group_size}``, periods increasing,
        for example ``{4: 4, 16: 8}`` on 8 devices: every 4 steps within halves,
        every 16 steps over all 8.
      warmup_steps: steps before the first averaging.

    Raises:
      ValueError: the dict is empty, a period or size is not a positive
        integer, or the periods do not increase. A last size other than the
        axis size, or a size that does not divide it, is a ``ValueError`` at
        the step's first call, when the axis size is known.

    Example:
      >>> avg = HierarchicalModelAverager({2: 2, 4: 8}, warmup_steps=1)
      >>> [avg.group_size_at(t) for t in range(9)]
      [None, None, 2, None, 8, None, 2, None, 8]
    """

    def __init__(self, period_group_size_dict: Mapping[int, int], warmup_steps: int = 0) -> None:
        if not isinstance(period_group_size_dict, Mapping) or not period_group_size_dict:
            raise ValueError(
                "period_group_size_dict must be a non-empty dict {period: group_size}, "
                f"got {period_group_size_dict!r}."
            )
        levels = []
        for period, size in period_group_size_dict.items():
            if not all(_positive_int(v) for v in (period, size)):
                raise ValueError(
                    "period_group_size_dict must map positive integer periods to positive "
                    f"integer group sizes, got {period!r}: {size!r}."
                )
            levels.append((int(period), int(size)))
        periods = [p for p, _ in levels]
        if periods != sorted(set(periods)):
            raise ValueError(
                "period_group_size_dict's periods must increase (the largest period that "
                f"divides the step wins), got {periods}."
            )
        if periods[-1] == 1:
            warnings.warn(
                "HierarchicalModelAverager with a largest period of 1 all-reduces every "
                "parameter every step, no cheaper than averaging gradients; plain data "
                "parallelism is enough.",
                UserWarning,
                stacklevel=2,
            )
        self.levels: tuple[tuple[int, int], ...] = tuple(levels)
        self.warmup_steps: int = check_int(warmup_steps, "warmup_steps", low=0)
        # Subgroups are averaged with a grouped psum, outside shard_map's typing.
        self.vma_safe = len(levels) == 1

    @property
    def period_group_size_dict(self) -> dict[int, int]:
        """``{period: group_size}`` as given."""
        return dict(self.levels)

    def __repr__(self) -> str:
        return (
            f"HierarchicalModelAverager({self.period_group_size_dict}, "
            f"warmup_steps={self.warmup_steps})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HierarchicalModelAverager):
            return NotImplemented
        return (self.levels, self.warmup_steps) == (other.levels, other.warmup_steps)

    def __hash__(self) -> int:
        return hash((HierarchicalModelAverager, self.levels, self.warmup_steps))

    def group_size_at(self, step: int) -> int | None:
        """The group size averaged after step ``step``, or None (torch's schedule)."""
        if step < self.warmup_steps:
            return None
        for period, size in reversed(self.levels):
            if step % period == 0:
                return size
        return None

    def _level(self, step: jax.Array) -> jax.Array:
        # 0: no averaging; k: the k-th level. Later (larger) periods override.
        level = jnp.zeros((), jnp.int32)
        for k, (period, _) in enumerate(self.levels, start=1):
            level = jnp.where(step % period == 0, k, level)
        return jnp.where(step >= self.warmup_steps, level, 0)

    def average(self, params: Any, step: jax.Array, axis_name: AxisName) -> Any:
        """``params`` averaged within the groups due at ``step``, else unchanged."""
        n = axis_size(axis_name)
        if self.levels[-1][1] != n:
            raise ValueError(
                f"The last group size in period_group_size_dict ({self.levels[-1][1]}) "
                f"must be the {n} devices of axis {axis_name!r}."
            )
        for _, size in self.levels:
            if n % size:
                raise ValueError(
                    f"Group size {size} in period_group_size_dict must divide the {n} "
                    f"devices of axis {axis_name!r}."
                )

        def mean_within(size: int) -> Any:
            def branch(p: Any) -> Any:
                if size == n:
                    out = jax.tree.map(lambda x: jax.lax.pmean(x, axis_name), p)
                else:
                    groups = [list(range(s, s + size)) for s in range(0, n, size)]
                    out = jax.tree.map(
                        lambda x: jax.lax.psum(x, axis_name, axis_index_groups=groups) / size, p
                    )
                # Typed per-device like the branch that leaves the parameters alone.
                return vary(out, axis_name)

            return branch

        branches = [lambda p: p] + [mean_within(size) for _, size in self.levels]
        return jax.lax.switch(self._level(step), branches, params)
