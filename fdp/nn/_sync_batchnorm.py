"""``fdp.SyncBatchNorm`` (Linen) and ``fdp.sync_batchnorm``: torch's SyncBatchNorm statistics.

Flax's ``nn.BatchNorm(axis_name='data')`` computes the batch statistics over every
device, as torch's ``SyncBatchNorm`` does, but moves its running variance towards the
*biased* batch variance; torch moves it towards the unbiased one (after one step from
``var = 1`` with a global batch of 16 the two differ by the factor 15/16, and
evaluation outputs by ~1e-2). :class:`SyncBatchNorm` follows torch: unbiased running
variance over the global batch, ``momentum`` as torch means it, and the rows the
step pads (per-example masks, :func:`fdp.join`) left out of the statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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

Initializer = Any


def check_momentum(momentum: float | None) -> None:
    """Torch's momentum is None (a cumulative average) or a factor in [0, 1]."""
    if momentum is not None and not 0.0 <= momentum <= 1.0:
        raise ValueError(
            f"momentum is torch's: the weight of the new batch in [0, 1] (or None for a "
            f"cumulative average), got momentum={momentum!r}. Flax's momentum m is "
            "torch's 1 - m."
        )


def torch_batch_norm(
    module: nn.Module,
    x: jax.Array,
    *,
    use_running_average: bool,
    axis: int | Sequence[int],
    momentum: float | None,
    epsilon: float,
    axis_name: AxisName | None,
    mask: jax.Array | None,
    dtype: Any,
    param_dtype: Any,
    use_bias: bool,
    use_scale: bool,
    bias_init: Initializer,
    scale_init: Initializer,
) -> jax.Array:
    """Torch's (Sync)BatchNorm forward pass inside a Linen ``module``'s compact method.

    The module's variables are Flax's names: params ``scale`` and ``bias``,
    ``batch_stats`` ``mean`` and ``var`` (plus ``num_batches_tracked`` when
    ``momentum`` is None, for torch's cumulative average).
    """
    feature_axes = feature_axes_of(x.ndim, axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    feature_shape = tuple(x.shape[a] for a in feature_axes)
    running_mean = module.variable("batch_stats", "mean", jnp.zeros, feature_shape, jnp.float32)
    running_var = module.variable("batch_stats", "var", jnp.ones, feature_shape, jnp.float32)
    tracked = None
    if momentum is None:
        tracked = module.variable("batch_stats", "num_batches_tracked", jnp.zeros, (), jnp.int32)

    if use_running_average:
        mean, var = running_mean.value, running_var.value
    else:
        initializing = module.is_initializing()
        stats = moments(
            x,
            reduction_axes,
            axis_name=None if initializing else bound_axis(axis_name),
            mask=example_mask() if mask is None else mask,
        )
        mean, var = stats.mean, stats.var
        if not initializing:
            factor: Any = momentum
            if tracked is not None:
                tracked.value = tracked.value + 1
                factor = 1.0 / tracked.value.astype(jnp.float32)
            running_mean.value = update_running(running_mean.value, stats.mean, factor)
            running_var.value = update_running(running_var.value, stats.unbiased_var, factor)

    scale = module.param("scale", scale_init, feature_shape, param_dtype) if use_scale else None
    bias = module.param("bias", bias_init, feature_shape, param_dtype) if use_bias else None
    out = dtype if dtype is not None else jnp.result_type(x.dtype, param_dtype)
    return normalize(
        x, mean, var, scale, bias, epsilon=epsilon, feature_axes=feature_axes, dtype=out
    )


class SyncBatchNorm(nn.Module):
    """torch's ``SyncBatchNorm`` as a Linen module (variables named as ``nn.BatchNorm``'s).

    In training (``use_running_average=False``) the batch is normalised with the
    mean and biased variance of the *global* batch (every device of
    ``axis_name``, which fdp's steps bind), and the running statistics move as
    torch's do: ``running = (1 - momentum) * running + momentum * batch``, the
    running variance towards the *unbiased* batch variance. Rows with zero weight
    (the padding of ``per_example=True`` steps and of :func:`fdp.join`) are left
    out: inside an fdp step the layer reads the micro-batch's mask itself
    (``mask=`` overrides it). Outside a ``shard_map`` binding ``axis_name`` (at
    ``init``, in single-device evaluation) the statistics are local.

    Attributes:
      use_running_average: normalise with the running statistics (evaluation).
      axis: the feature axis or axes (Flax's channels-last: -1).
      momentum: torch's: the weight of the new batch (default 0.1), or None for
        a cumulative average (torch's ``momentum=None``).
      epsilon: added to the variance (torch's ``eps``).
      dtype: the output dtype (default: the input's and parameters' promoted).
      param_dtype: the dtype of ``scale`` and ``bias``.
      use_bias: learn a bias (torch's ``affine``).
      use_scale: learn a scale (torch's ``affine``).
      bias_init: initialiser of the bias.
      scale_init: initialiser of the scale.
      axis_name: the data axis the statistics span (None: local, torch's
        ``BatchNorm``).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
      >>> bn = SyncBatchNorm(use_running_average=False)
      >>> v = bn.init(jax.random.key(0), x)
      >>> _, u = bn.apply(v, x, mutable=["batch_stats"])
      >>> want = 0.9 + 0.1 * x.var(0, ddof=1)  # torch: the unbiased variance
      >>> bool(np.allclose(u["batch_stats"]["var"], want, rtol=1e-6))
      True
    """

    use_running_average: bool | None = None
    axis: int | Sequence[int] = -1
    momentum: float | None = 0.1
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Initializer = nn.initializers.zeros
    scale_init: Initializer = nn.initializers.ones
    axis_name: AxisName | None = DATA_AXIS

    @nn.compact
    def __call__(
        self, x: jax.Array, use_running_average: bool | None = None, *, mask: Any = None
    ) -> jax.Array:
        """Normalises ``x``.

        Args:
          x: the input, batch first.
          use_running_average: overrides the attribute of the same name.
          mask: ``[batch]`` weights of the examples (0 leaves one out of the
            statistics); default: the fdp step's mask, or every row.

        Returns:
          The normalised ``x``.
        """
        check_momentum(self.momentum)
        return torch_batch_norm(
            self,
            x,
            use_running_average=bool(
                nn.merge_param("use_running_average", self.use_running_average, use_running_average)
            ),
            axis=self.axis,
            momentum=self.momentum,
            epsilon=self.epsilon,
            axis_name=self.axis_name,
            mask=mask,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            use_bias=self.use_bias,
            use_scale=self.use_scale,
            bias_init=self.bias_init,
            scale_init=self.scale_init,
        )


@contextlib.contextmanager
def sync_batchnorm(axis_name: AxisName = DATA_AXIS) -> Iterator[None]:
    """Runs every Flax Linen ``nn.BatchNorm`` called in the block with torch's statistics.

    torch's ``SyncBatchNorm.convert_sync_batchnorm`` for an existing Linen model:
    each ``nn.BatchNorm`` keeps its variables and its settings (its ``momentum``
    keeps Flax's meaning: torch's momentum is ``1 - momentum``), and computes as
    :class:`SyncBatchNorm`: statistics over ``axis_name`` (whatever the layer's
    own ``axis_name``), the unbiased running variance, padded rows left out::

        def loss_fn(params, batch, batch_stats):
            with fdp.sync_batchnorm():
                logits, updates = model.apply(
                    {"params": params, "batch_stats": batch_stats}, batch["x"],
                    mutable=["batch_stats"])
            ...

    Args:
      axis_name: the data axis the statistics span.

    Raises:
      NotImplementedError: a layer is called with Flax's element-wise ``mask=``
        or ``axis_index_groups`` (pass per-example weights through the step).
    """

    def interceptor(next_fun: Any, args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        if not isinstance(module, nn.BatchNorm) or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if kwargs.get("mask") is not None or module.axis_index_groups is not None:
            raise NotImplementedError(
                "fdp.sync_batchnorm: nn.BatchNorm's element-wise mask= and "
                "axis_index_groups are not supported; per-example weights come from the "
                "fdp step (per_example=True, mask=)."
            )
        x, *rest = args
        call_flag = rest[0] if rest else kwargs.get("use_running_average")
        use_running = nn.merge_param("use_running_average", module.use_running_average, call_flag)
        return torch_batch_norm(
            module,
            x,
            use_running_average=bool(use_running),
            axis=module.axis,
            momentum=1.0 - module.momentum,
            epsilon=module.epsilon,
            axis_name=axis_name,
            mask=None,
            dtype=module.dtype,
            param_dtype=module.param_dtype,
            use_bias=module.use_bias,
            use_scale=module.use_scale,
            bias_init=module.bias_init,
            scale_init=module.scale_init,
        )

    with nn.intercept_methods(interceptor):
        yield
