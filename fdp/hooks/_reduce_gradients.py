"""``fdp.reduce_gradients``: the bucketed reduction for your own step, with a comm hook."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fdp.bucketing import BucketPlan, plan_for
from fdp.collectives._axis import AxisName
from fdp.hooks._basic import allreduce
from fdp.hooks._bucketed import REDUCTION_TRACE, reduce_with_hook
from fdp.hooks._contract import CommHook, Layout
from fdp.hooks._registry import resolve


def reduce_gradients(
    grads: Any,
    *,
    axis_name: AxisName = "data",
    plan: BucketPlan | None = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    layout: Layout = "leaves",
    comm_hook: CommHook | str | None = None,
    weight: Any = None,
) -> Any:
    """Averages per-device gradients over ``axis_name``, bucket by bucket.

    Call it inside your own ``jax.shard_map`` (or ``jax.pmap``) step on the
    gradients of your local batch, or inside a step decorated with
    :func:`fdp.ddp`; it is the one line that turns a per-device step into a
    DDP step. Buckets are launched in bucket-index order, each through
    ``comm_hook`` as :func:`fdp.train_step` runs it
    (``fdp.Reduction(comm_hook=...)``).

    Args:
      grads: per-device gradients (a pytree). Under ``shard_map`` with
        ``check_vma=True`` they must vary over ``axis_name``: take them with
        respect to ``jax.lax.pcast(params, axis_name, to='varying')``.
      axis_name: the data axis.
      plan: the bucket plan; built from ``grads`` (and memoised) when omitted.
      bucket_cap_mb: bucket cap in MiB when ``plan`` is omitted.
      first_bucket_cap_mb: first-bucket cap in MiB when ``plan`` is omitted.
      layout: ``'leaves'`` reduces each bucket's gradients in place with one
        ``psum`` call (no copies; XLA's all-reduce combiner makes the final
        grouping). ``'flat'`` packs each bucket into DDP's flat buffer and
        all-reduces that: one all-reduce per bucket in the emitted program,
        for one extra copy of the gradients.
      comm_hook: what each bucket goes through: a :class:`fdp.hooks.CommHook`
        or a hook's name (``"bf16_compress"``); default: the mean
        (:func:`fdp.hooks.allreduce`). A hook that keeps state between steps
        (PowerSGD's error feedback) needs that state carried:
        :func:`fdp.hooks.reduce_with_hook` takes and returns it.
      weight: this device's weight (a scalar, e.g. its real-token count):
        the devices' gradients are then averaged weighted by it,
        ``sum_i w_i g_i / sum_i w_i`` (one more all-reduce, of the scalar).
        With ``g_i`` the gradient of a device's per-token mean loss, that is
        the gradient of the per-token mean over the whole batch, as one
        device computes it (lm1b's, MaxText's and torchtitan's loss); the
        plain mean weighs a device's short sequences' tokens more.

    Returns:
      The reduced gradients, identical on every device (the mean with the
      default hook). Leaves without gradient (integer, boolean) come back as
      ``float0`` zeros, as ``jax.grad`` gives them.

    Raises:
      ValueError: the gradients are already reduced over ``axis_name`` (the
        double-reduction trap), ``grads`` does not match ``plan``, an unknown
        hook name, or a hook that keeps state.
      TypeError: ``comm_hook`` is neither a hook nor a name.
      NameError: ``axis_name`` is not bound.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import fdp
      >>> mesh = fdp.data_mesh()
      >>> x = fdp.shard_batch(jnp.arange(8.0), mesh)
      >>> def step(w, x):
      ...     w = jax.lax.pcast(w, "data", to="varying")
      ...     g = jax.grad(lambda w: jnp.mean(w * x))(w)
      ...     return fdp.reduce_gradients(g, axis_name="data", comm_hook="bf16_compress")
      >>> mapped = jax.shard_map(step, mesh=mesh, in_specs=(jax.P(), jax.P("data")),
      ...                        out_specs=jax.P())
      >>> mapped(jnp.ones(()), x).tolist()
      3.5
    """
    hook = allreduce() if comm_hook is None else resolve(comm_hook)
    if plan is None:
        plan = plan_for(grads, bucket_cap_mb, first_bucket_cap_mb)
    shapes = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, g.dtype), grads)
    if comm_hook is not None and jax.tree.leaves(
        jax.eval_shape(lambda g: hook.init(g, plan), shapes)
    ):
        raise ValueError(
            f"fdp.reduce_gradients: comm_hook {hook.name!r} keeps state between steps, which "
            "reduce_gradients has nowhere to keep. Carry it yourself with "
            "`grads, state = fdp.hooks.reduce_with_hook(hook, state, grads, plan=plan)` "
            "(state from hook.init(params, plan)), or use fdp.train_step, which keeps it."
        )
    trace = REDUCTION_TRACE.get()
    typing_only = trace is not None and trace.typing_only  # fdp.ddp's first, typing trace
    if weight is not None and not typing_only:  # each device's share: N * w_i / sum(w)
        w = jnp.asarray(weight, jnp.float32)
        scale = jax.lax.axis_size(axis_name) * w / jax.lax.psum(w, axis_name)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype) if _floating(g) else g, grads)
    reduced, _ = reduce_with_hook(hook, (), grads, axis_name=axis_name, plan=plan, layout=layout)
    return reduced


def _floating(g: Any) -> bool:
    """Whether ``g`` is a floating gradient (not a ``float0`` of an integer leaf)."""
    return g.dtype != jax.dtypes.float0 and jnp.issubdtype(g.dtype, jnp.inexact)
