"""The bucketed gradient reduction: flatten into buckets, all-reduce each, unflatten."""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from fdp.bucketing import BucketPlan, check_tree, pack, plan_buckets, unpack
from fdp.collectives._axis import AxisName, axis_size, is_varying


@functools.lru_cache(maxsize=256)
def _cached_plan(
    treedef: Any,
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[Any, ...],
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
) -> BucketPlan:
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    return plan_buckets(
        jax.tree.unflatten(treedef, structs),
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
    )


def plan_for(
    tree: Any, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
) -> BucketPlan:
    """:func:`fdp.bucketing.plan_buckets`, memoised on the tree's structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(int(d) for d in jnp.shape(x)) for x in leaves)
    dtypes = tuple(jnp.result_type(x) for x in leaves)
    return _cached_plan(treedef, shapes, dtypes, bucket_cap_mb, first_bucket_cap_mb)


def check_not_reduced(grads: Any, plan: BucketPlan, axis_name: AxisName) -> None:
    """Raises if bucketed gradients are already reduced over ``axis_name``.

    Inside ``shard_map(check_vma=True)``, ``jax.grad`` with respect to
    replicated parameters sums the cotangents over the axis by itself; reducing
    again would scale the gradient by the axis size.
    """
    leaves = jax.tree.leaves(grads)
    for bucket in plan.buckets:
        for i, path in zip(bucket.leaf_indices, bucket.key_paths, strict=True):
            if is_varying(leaves[i], axis_name) is False:
                raise ValueError(
                    f"gradient {path or 'grads'} is already reduced over {axis_name!r}: it was "
                    "taken with respect to parameters replicated over that axis, so "
                    "jax.grad summed it across devices. Reducing it again would multiply "
                    "it by the axis size. Before jax.grad, make the parameters per-device "
                    f"with jax.lax.pcast(params, {axis_name!r}, to='varying') (what "
                    "fdp.train_step does), or run the shard_map with check_vma=False."
                )


Layout = Literal["leaves", "flat"]
LAYOUTS = ("leaves", "flat")


def check_layout(layout: str) -> None:
    """Raises ``ValueError`` unless ``layout`` is ``'leaves'`` or ``'flat'``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")


def mean_leaves(leaves: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """DDP's default hook on one bucket: divide by the world size, all-reduce (sum)."""
    n = axis_size(axis_name)
    return jax.lax.psum([g / n for g in leaves], axis_name)


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
    step into a DDP step. Buckets are launched in bucket-index order.

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
    axis_size(axis_name)
    check_layout(layout)
    if plan is None:
        plan = plan_for(grads, bucket_cap_mb, first_bucket_cap_mb)
    leaves = check_tree(plan, grads, "grads")
    check_not_reduced(grads, plan, axis_name)
    # Leaves in no bucket have no gradient: float0 constants, replicated by nature.
    out = [np.zeros(plan.leaf_shapes[i], jax.dtypes.float0) for i in range(len(leaves))]
    for bucket in plan.buckets:  # launched in bucket-index order, as DDP requires
        bucket_leaves = [leaves[i] for i in bucket.leaf_indices]
        with jax.named_scope(f"fdp_bucket_{bucket.index}"):
            if layout == "flat":
                reduced = unpack(bucket, mean_leaves([pack(bucket, bucket_leaves)], axis_name)[0])
            else:
                reduced = mean_leaves(bucket_leaves, axis_name)
        for i, leaf in zip(bucket.leaf_indices, reduced, strict=True):
            out[i] = leaf
    return jax.tree.unflatten(plan.treedef, out)
