"""``fdp.NNXSyncBatchNorm`` and ``fdp.convert_sync_batchnorm``: torch's SyncBatchNorm for NNX."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fdp.collectives._axis import AxisName
from fdp.data._placement import DATA_AXIS
from fdp.nn._moments import (
    bound_axis,
    example_mask,
    feature_axes_of,
    moments,
    normalize,
    update_running,
)
from fdp.nn._sync_batchnorm import check_momentum


class NNXSyncBatchNorm(nnx.Module):
    """torch's ``SyncBatchNorm`` for Flax NNX (attributes named as ``nnx.BatchNorm``'s).

    The same statistics as :class:`fdp.SyncBatchNorm`: the global batch over
    ``axis_name`` (bound inside fdp's steps), the running variance moved towards
    the unbiased batch variance, ``momentum`` as torch means it, and the step's
    padding left out.

    Args:
      num_features: the size of the feature axis.
      use_running_average: normalise with the running statistics (evaluation).
      axis: the feature axis (channels-last: -1).
      momentum: torch's momentum (default 0.1), or None for a cumulative average.
      epsilon: added to the variance.
      dtype: the output dtype (default: the input's and parameters' promoted).
      param_dtype: the dtype of ``scale`` and ``bias``.
      use_bias: learn a bias.
      use_scale: learn a scale.
      axis_name: the data axis the statistics span (None: local).
      rngs: unused (the parameters start at ones and zeros); accepted like
        ``nnx.BatchNorm``'s.
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool = False,
        axis: int = -1,
        momentum: float | None = 0.1,
        epsilon: float = 1e-5,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        axis_name: AxisName | None = DATA_AXIS,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs
        check_momentum(momentum)
        shape = (num_features,)
        self.mean = nnx.BatchStat(jnp.zeros(shape, jnp.float32))
        self.var = nnx.BatchStat(jnp.ones(shape, jnp.float32))
        tracked = None if momentum is not None else nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.num_batches_tracked = nnx.data(tracked)
        self.scale = nnx.data(nnx.Param(jnp.ones(shape, param_dtype)) if use_scale else None)
        self.bias = nnx.data(nnx.Param(jnp.zeros(shape, param_dtype)) if use_bias else None)
        self.num_features = num_features
        self.use_running_average = use_running_average
        self.axis = axis
        self.momentum = momentum
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.axis_name = axis_name

    def __call__(
        self, x: jax.Array, use_running_average: bool | None = None, *, mask: Any = None
    ) -> jax.Array:
        """Normalises ``x`` (batch first); ``mask`` as :class:`fdp.SyncBatchNorm`'s."""
        use_running = (
            self.use_running_average if use_running_average is None else use_running_average
        )
        feature_axes = feature_axes_of(x.ndim, self.axis)
        if use_running:
            mean, var = self.mean[...], self.var[...]
        else:
            reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
            stats = moments(
                x,
                reduction_axes,
                axis_name=bound_axis(self.axis_name),
                mask=example_mask() if mask is None else mask,
            )
            mean, var = stats.mean, stats.var
            factor: Any = self.momentum
            if self.num_batches_tracked is not None:
                self.num_batches_tracked[...] = self.num_batches_tracked[...] + 1
                factor = 1.0 / self.num_batches_tracked[...].astype(jnp.float32)
            self.mean[...] = update_running(self.mean[...], stats.mean, factor)
            self.var[...] = update_running(self.var[...], stats.unbiased_var, factor)
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        out = self.dtype if self.dtype is not None else jnp.result_type(x.dtype, self.param_dtype)
        return normalize(
            x, mean, var, scale, bias, epsilon=self.epsilon, feature_axes=feature_axes, dtype=out
        )


def _from_batchnorm(bn: nnx.BatchNorm, axis_name: AxisName) -> NNXSyncBatchNorm:
    if not isinstance(bn.axis, int) or bn.axis_index_groups is not None:
        raise NotImplementedError(
            "fdp.convert_sync_batchnorm: an nnx.BatchNorm with several feature axes or "
            "axis_index_groups is not supported."
        )
    sync = NNXSyncBatchNorm(
        bn.num_features,
        use_running_average=bool(bn.use_running_average),
        axis=bn.axis,
        momentum=1.0 - bn.momentum,  # Flax's decay m is torch's momentum 1 - m
        epsilon=bn.epsilon,
        dtype=bn.dtype,
        param_dtype=bn.param_dtype,
        use_bias=bn.use_bias,
        use_scale=bn.use_scale,
        axis_name=axis_name,
    )
    sync.mean[...] = bn.mean[...]
    sync.var[...] = bn.var[...]
    if sync.scale is not None and bn.scale is not None:
        sync.scale[...] = bn.scale[...]
    if sync.bias is not None and bn.bias is not None:
        sync.bias[...] = bn.bias[...]
    return sync


def convert_sync_batchnorm(module: nnx.Module, *, axis_name: AxisName = DATA_AXIS) -> nnx.Module:
    """Replaces every ``nnx.BatchNorm`` in ``module`` by an :class:`NNXSyncBatchNorm`.

    torch's ``SyncBatchNorm.convert_sync_batchnorm``: the new layers keep the old
    ones' statistics, parameters and settings (a Flax ``momentum`` m becomes
    torch's ``1 - m``, the same decay) and compute torch's statistics over
    ``axis_name``. Layers held as attributes, or in lists, tuples and dicts of
    attributes, are found. For Linen models use :func:`fdp.sync_batchnorm`.

    Args:
      module: an NNX module (changed in place).
      axis_name: the data axis the statistics span.

    Returns:
      ``module`` (or a new layer if ``module`` is itself an ``nnx.BatchNorm``).
    """
    seen: set[int] = set()

    def convert(node: Any) -> Any:
        if isinstance(node, nnx.BatchNorm):
            return _from_batchnorm(node, axis_name)
        if id(node) in seen:
            return node
        seen.add(id(node))
        if isinstance(node, nnx.Module):
            for name, value in list(vars(node).items()):
                new = convert(value)
                if new is not value:
                    setattr(node, name, new)
        elif isinstance(node, list | dict):
            keys = range(len(node)) if isinstance(node, list) else list(node)
            for key in keys:
                new = convert(node[key])
                if new is not node[key]:
                    node[key] = new
        elif isinstance(node, tuple):
            items = [convert(v) for v in node]
            if any(a is not b for a, b in zip(items, node, strict=True)):
                return type(node)(items)
        return node

    return convert(module)
