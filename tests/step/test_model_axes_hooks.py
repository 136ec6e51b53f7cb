"""Comm hooks on meshes with a model axis: every bucket reduced on each device's blocks.

The Megatron MLP of test_model_axes.py on 4 x 2 and 2 x 4 meshes. A stateless hook
(the casting and quantizing hooks) sees each device's blocks of a bucket, whole, as
DDP over a tensor-parallel model sees each rank's local shards; a stateful hook
(PowerSGD) keeps state shaped by whole buckets and reduces them where they lie.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_model_axes import (
    AUTO,
    Megatron,
    NNXMegatron,
    assert_split_over_model,
    batches,
    expected,
    mesh_of,
    mse,
    nnx_mse,
    params_of,
    placed,
    train,
)

import fdp
from fdp import hooks
from fdp.bucketing import plan_for
from fdp.hooks._bucketed import reduce_with_hook

LR = 1e-2  # test_model_axes.expected's Adam
SHAPES = {"4x2": (4, 2), "2x4": (2, 4)}


def trained(hook, shape, stage=0, mesh=None):
    """The state after 3 steps with ``hook``, and the parameters it started from.

    On ``mesh`` if given (its model axis of one device: the parameters placed with
    Megatron's split, which splits nothing), else on a data x model mesh of ``shape``.
    """
    params = params_of()
    mesh = mesh_of(shape) if mesh is None else mesh
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(LR))
    step = fdp.train_step(
        mse(Megatron().apply), mesh=mesh, comm_hook=hook, sharding=fdp.Sharding(zero_stage=stage)
    )
    return train(step, step.init(state), mesh), params


CASTS = [
    (name, shape, stage) for name in ["bf16_compress"] for shape in SHAPES for stage in range(4)
]
CASTS += [("fp16_compress", "4x2", 0), ("fp16_compress", "2x4", 2)]


@pytest.mark.parametrize("name, shape, stage", CASTS)
def test_casting_hooks_keep_the_split_and_end_within_their_rounding_of_one_device(
    name, shape, stage
):
    # Until their buckets ran on each device's blocks, XLA:CPU aborted the process while
    # compiling these steps: a low-precision all-reduce of a gradient left to its
    # partitioner on the model axis ("Invalid binary instruction opcode copy").
    state, params = trained(name, SHAPES[shape], stage)
    if stage < 3:
        assert_split_over_model(state.params, mesh_of(SHAPES[shape]))
    # Each gradient rounded to the hook's precision, divided by 4 or 2 and summed there:
    # a few units of its last place. Adam's step, m / sqrt(v), then moves by at most
    # 4 of them, and 3 steps of lr move each parameter at most 3 x lr x 4 x eps from
    # where one device takes it in float32.
    eps = float(jnp.finfo(jnp.bfloat16 if name == "bf16_compress" else jnp.float16).eps)
    chex.assert_trees_all_close(
        jax.device_get(state.params), expected(params), atol=3 * LR * 4 * eps, rtol=0
    )


def quantized_mean_of_blocks(grads, columns):
    """numpy: torch's per-tensor uint8 hook on each device's column block of a bucket.

    ``grads``: per data replica, the bucket's arrays (all split by columns over
    'model'), ``[replicas, ..., columns * width]``.
    """
    replicas = grads[0].shape[0]
    out = [np.zeros(g.shape[1:], np.float32) for g in grads]
    width = grads[0].shape[-1] // columns
    for m in range(columns):
        cols = slice(m * width, (m + 1) * width)
        total = None
        for r in range(replicas):  # rank order, as torch aggregates
            x = np.concatenate([g[r][..., cols].ravel() for g in grads]).astype(np.float32)
            lo, hi = min(x.min(), np.float32(0)), max(x.max(), np.float32(0))
            scale = np.maximum((hi - lo) / np.float32(255), np.finfo(np.float32).eps)
            zero = np.clip(-np.round(lo / scale), 0, 255).astype(np.float32)
            q = np.clip(np.round(x / scale) + zero, 0, 255).astype(np.uint8)
            value = (scale * (q.astype(np.float32) - zero)).astype(np.float32)
            total = value if total is None else total + value
        mean = total / np.float32(replicas)
        start = 0
        for o in out:
            block = o[..., cols]
            o[..., cols] = mean[start : start + block.size].reshape(block.shape)
            start += block.size
    return out


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_quantize_per_tensor_quantizes_each_devices_block_of_a_bucket(shape):
    # A bucket of two leaves split by columns over 'model': each device quantizes its own
    # blocks of both with one scale, as a DDP rank does its local shards.
    mesh, (replicas, columns) = mesh_of(shape), shape
    rng = np.random.default_rng(0)
    grads = {  # per data replica; the leaf sizes differ, so the blocks' ranges differ
        "b": rng.normal(size=(replicas, 4, 16)).astype(np.float32),
        "w": (3 * rng.normal(size=(replicas, 8, 16))).astype(np.float32),
    }
    split = P(None, "model")
    structs = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in grads.items()}
    plan = plan_for(structs, first_bucket_cap_mb=25.0, layouts=(split, split))
    assert [b.leaf_indices for b in plan.buckets] == [(1, 0)]  # ready order: w, then b

    def reduce(local):
        local = jax.tree.map(lambda x: x[0], local)
        hook = hooks.quantize_per_tensor()
        return reduce_with_hook(hook, (), local, plan=plan, model_axes=("model",))[0]

    per_device = jax.shard_map(
        reduce,
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        axis_names={"data"},
        check_vma=False,
    )
    placed_grads = {
        k: jax.device_put(v, NamedSharding(mesh, P("data", None, "model")))
        for k, v in grads.items()
    }
    got = jax.jit(per_device)(placed_grads)
    assert all(x.sharding.spec == split for x in got.values()), got
    want_w, want_b = quantized_mean_of_blocks([grads["w"], grads["b"]], columns)
    # Within float32 rounding; a scale from other blocks would be off by its steps of
    # (hi - lo) / 255, 1e-2 here.
    np.testing.assert_allclose(np.asarray(got["w"]), want_w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["b"]), want_b, rtol=1e-6, atol=1e-6)


def test_powersgd_on_a_model_split_mesh_is_what_it_is_on_the_data_axis_alone():
    # PowerSGD's state (error feedback, Q factors) has each bucket's whole shapes: its
    # buckets are reduced whole, where they lie, so 4 x 2 computes what 4 devices on a
    # data axis alone do. Before step.init planned the buckets by layout as the step
    # does, its state did not fit the step's buckets (a TypeError at the first call).
    def powersgd():  # compressing from the third step, every matrix
        return hooks.powersgd(start_powersgd_iter=2, min_compression_rate=0.1)

    state, _ = trained(powersgd(), (4, 2))
    assert_split_over_model(state.params, mesh_of((4, 2)))
    # The same 4 data replicas with a 'model' axis of one device: the same buckets (by
    # layout), so the same factors drawn for each; nothing split.
    line = jax.make_mesh((4, 1), ("data", "model"), devices=jax.devices()[:4], axis_types=AUTO)
    one_d, _ = trained(powersgd(), None, mesh=line)
    chex.assert_trees_all_close(
        jax.device_get(state.params), jax.device_get(one_d.params), rtol=1e-5, atol=1e-6
    )


def test_powersgd_state_fits_an_nnx_model_split_over_model():
    # NNX's step.init planned the hook state's buckets without the layouts too.
    mesh = mesh_of((4, 2))
    with jax.set_mesh(mesh):
        model = NNXMegatron(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    hook = hooks.powersgd(start_powersgd_iter=2, min_compression_rate=0.1)
    step = fdp.nnx_train_step(nnx_mse, mesh=mesh, comm_hook=hook)
    comm = step.init(model, optimizer)
    losses = [
        float(step(model, optimizer, fdp.shard_batch(b, mesh), comm_state=comm)["loss"])
        for b in batches()
    ]
    assert np.all(np.isfinite(losses)), losses
    assert model.l1.kernel[...].sharding.spec == P(None, "model")
