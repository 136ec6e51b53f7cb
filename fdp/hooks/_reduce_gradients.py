"""``fdp.reduce_gradients``: DDP's bucketed mean, for use in your own step."""

from __future__ import annotations

from typing import Any

from fdp.bucketing import BucketPlan, plan_for
from fdp.collectives._axis import AxisName
from fdp.hooks._basic import allreduce
from fdp.hooks._bucketed import reduce_with_hook
from fdp.hooks._contract import Layout


def reduce_gradients(
    grads: Any,
    *,
    axis_name: AxisName = "data",
    plan: BucketPlan | None = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    layout: Layout = "leaves",
) -> Any:
    """Averages per-device gradients over ``axis_name``, bucket by bucket.

    Call it inside your own ``jax.shard_map`` (or ``jax.pmap``) step on the
    gradients of your local batch; it is the one line that turns a per-device
    step into a DDP step. Buckets are launched in bucket-index order. For comm
    hooks, see :func:`fdp.hooks.reduce_with_hook`.

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

    Returns:
      The mean gradients, identical on every device. Leaves without gradient
      (integer, boolean) come back as ``float0`` zeros, as ``jax.grad`` gives them.

    Raises:
      ValueError: the gradients are already reduced over ``axis_name`` (the
        double-reduction trap), or ``grads`` does not match ``plan``.
      NameError: ``axis_name`` is not bound.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))
      >>> def step(w, x):
      ...     w = jax.lax.pcast(w, "data", to="varying")
      ...     g = jax.grad(lambda w: jnp.mean(w * x))(w)
      ...     return reduce_gradients(g, axis_name="data")
      >>> jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
      ...               out_specs=P())(jnp.ones(()), x).tolist()
      3.5
    """
    if plan is None:
        plan = plan_for(grads, bucket_cap_mb, first_bucket_cap_mb)
    reduced, _ = reduce_with_hook(
        allreduce(), (), grads, axis_name=axis_name, plan=plan, layout=layout
    )
    return reduced
