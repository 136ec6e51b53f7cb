"""Runs a comm hook on 8 devices over per-device gradients, and numpy helpers."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp
from fdp.hooks import reduce_with_hook

N = 8


def place(tree, mesh):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), tree)


def run_hook(hook, grads_per_step, plan, layout="leaves"):
    """Applies ``hook`` to each step's stacked gradients ``[N, ...]``.

    Returns the per-device outputs and hook states after each step (numpy, with a
    leading device axis).
    """
    mesh = fdp.data_mesh()
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), grads_per_step[0])
    state = jax.tree.map(
        lambda s: np.broadcast_to(np.asarray(s), (N, *np.shape(s))).copy(), hook.init(local, plan)
    )

    def body(grads, state):
        strip = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
        out, state = reduce_with_hook(hook, strip(state), strip(grads), plan=plan, layout=layout)
        return jax.tree.map(lambda x: x[None], (out, state))

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("data"), P("data")),
            out_specs=(P("data"), P("data")),
            check_vma=hook.vma_safe,
        )
    )
    outs, states = [], []
    for grads in grads_per_step:
        out, state = step(place(grads, mesh), place(state, mesh))
        outs.append(jax.tree.map(np.asarray, out))
        states.append(jax.tree.map(np.asarray, state))
        state = states[-1]
    return outs, states


def bucket_flat(grads, bucket):
    """numpy: each device's flat buffer of ``bucket`` from stacked gradient leaves."""
    leaves = jax.tree.leaves(grads)
    return np.concatenate(
        [np.asarray(leaves[i]).reshape(N, -1) for i in bucket.leaf_indices], axis=1
    )


def split_flat(flat, bucket):
    """numpy: a flat buffer ``[..., size]`` split into the bucket's leaves."""
    return [
        flat[..., off : off + size].reshape(*flat.shape[:-1], *shape)
        for off, size, shape in zip(bucket.offsets, bucket.sizes, bucket.shapes, strict=True)
    ]


def make_grads(seed, shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=(N, *shape)).astype(dtype) for name, shape in shapes.items()}
