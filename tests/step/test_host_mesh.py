"""Host x device meshes: both axes as the data axis, and the hierarchical reduction.

8 simulated devices as 2 "hosts" x 4. The reference is one device on the whole batch
(plain optax), and the flat reduction over a 1-D mesh of the same devices.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, cross_entropy, make_data, make_state, reference_steps
from flax import nnx

import fdp
from fdp.observe._hlo import collective_stats
from fdp.step.options._config import StepConfig

AXES = fdp.HOST_AXES
STEPS = 3


def host_mesh():
    return fdp.data_mesh(axis_name=AXES, hosts=2)


def batches(num=STEPS, rows=32, seed=1):
    data = make_data(seed, rows * num)
    return [{k: v[i * rows : (i + 1) * rows] for k, v in data.items()} for i in range(num)]


def train(step, state, data, mesh):
    for batch in data:
        state, metrics = step(state, fdp.shard_batch(batch, mesh, axis_name=AXES))
    return state, metrics


def test_data_mesh_builds_hosts_of_consecutive_devices():
    mesh = host_mesh()
    assert dict(mesh.shape) == {"host": 2, "device": 4}
    ids = [[d.id for d in row] for row in mesh.devices]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # One process: by default one "host" of every device.
    assert dict(fdp.data_mesh(axis_name=AXES).shape) == {"host": 1, "device": 8}
    with pytest.raises(ValueError, match="hosts=3 must divide the 8 devices"):
        fdp.data_mesh(axis_name=AXES, hosts=3)
    with pytest.raises(ValueError, match="hosts=2 needs a host x device mesh"):
        fdp.data_mesh(hosts=2)
    with pytest.raises(TypeError, match="tuple of distinct names"):
        fdp.data_mesh(axis_name=("a", "a"))


def test_a_batch_is_split_over_both_axes_in_rank_order():
    mesh = host_mesh()
    x = fdp.shard_batch(np.arange(16, dtype=np.float32)[:, None], mesh, axis_name=AXES)
    by_device = {s.device.id: np.asarray(s.data)[:, 0].tolist() for s in x.addressable_shards}
    assert by_device == {i: [2.0 * i, 2.0 * i + 1] for i in range(8)}


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("layout", ["leaves", "flat"])
def test_both_axes_together_step_as_one_device_on_the_whole_batch(hierarchical, layout):
    data = batches()
    loss_fn = cross_entropy(MLP().apply)
    expected, losses = reference_steps(make_state("mlp", "sgd"), data, loss_fn)
    mesh = host_mesh()
    step = fdp.train_step(
        loss_fn, mesh=mesh, axis_name=AXES, hierarchical=hierarchical, layout=layout
    )
    state, metrics = train(step, fdp.replicate(make_state("mlp", "sgd"), mesh), data, mesh)
    chex.assert_trees_all_close(
        jax.device_get(state.params), jax.device_get(expected.params), atol=1e-6, rtol=1e-6
    )
    np.testing.assert_allclose(float(metrics["loss"]), losses[-1], rtol=1e-6)


def test_hierarchical_equals_the_flat_reduction_over_one_axis():
    data = batches()
    loss_fn = cross_entropy(MLP().apply)
    flat_mesh = fdp.data_mesh()
    flat = fdp.train_step(loss_fn, mesh=flat_mesh)
    flat_state = fdp.replicate(make_state("mlp", "adam"), flat_mesh)
    for batch in data:
        flat_state, _ = flat(flat_state, fdp.shard_batch(batch, flat_mesh))
    mesh = host_mesh()
    step = fdp.train_step(loss_fn, mesh=mesh, axis_name=AXES, hierarchical=True)
    state, _ = train(step, fdp.replicate(make_state("mlp", "adam"), mesh), data, mesh)
    chex.assert_trees_all_close(
        jax.device_get(state.params), jax.device_get(flat_state.params), atol=1e-6, rtol=1e-6
    )


def _groups(op):
    return [list(g) for g in op.groups]


@pytest.mark.parametrize("program", ["lowered", "compiled"])
def test_the_program_reduces_inside_hosts_then_a_quarter_across_them(program):
    mesh = host_mesh()
    state = fdp.replicate(make_state("mlp", "sgd"), mesh)
    batch = fdp.shard_batch(batches(1)[0], mesh, axis_name=AXES)
    step = fdp.train_step(
        cross_entropy(MLP().apply), mesh=mesh, axis_name=AXES, hierarchical=True, bucket_cap_mb=1e9
    )
    lowered = step.lower(state, batch)
    ops = collective_stats(lowered if program == "lowered" else lowered.compile()).ops
    (bucket,) = step.plan.buckets  # one bucket: every gradient
    share = -(-bucket.size // 4)
    scatter = [op for op in ops if op.kind == "reduce-scatter"]
    across = [op for op in ops if op.kind == "all-reduce" and op.shapes == ((share,),)]
    gather = [op for op in ops if op.kind == "all-gather"]
    assert len(scatter) == len(across) == len(gather) == 1
    assert len(ops) == 4  # and the loss's all-reduce
    assert _groups(scatter[0]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups(gather[0]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups(across[0]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # The hop between hosts carries 1/k of the bucket's bytes.
    assert across[0].nbytes == share * 4
    assert share * 4 <= bucket.nbytes / 4 + 4


def test_a_compression_hook_applies_to_the_hop_between_hosts_only():
    mesh = host_mesh()
    state = fdp.replicate(make_state("mlp", "sgd"), mesh)
    batch = fdp.shard_batch(batches(1)[0], mesh, axis_name=AXES)
    step = fdp.train_step(
        cross_entropy(MLP().apply),
        mesh=mesh,
        axis_name=AXES,
        hierarchical=True,
        comm_hook="bf16_compress",
        bucket_cap_mb=1e9,
    )
    ops = collective_stats(step.lower(state, batch)).ops
    across = [op for op in ops if op.kind == "all-reduce" and op.shapes != ((),)]
    inner = [op for op in ops if op.kind in ("reduce-scatter", "all-gather")]
    assert [op.dtypes for op in across] == [("bf16",)]
    assert all(op.dtypes == ("f32",) for op in inner)
    new, _ = step(state, batch)
    exact = fdp.train_step(cross_entropy(MLP().apply), mesh=mesh, axis_name=AXES)
    want, _ = exact(fdp.replicate(make_state("mlp", "sgd"), mesh), batch)
    chex.assert_trees_all_close(
        jax.device_get(new.params), jax.device_get(want.params), atol=2e-3, rtol=1e-2
    )


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x.reshape(x.shape[0], -1)))))


def _nnx_run(mesh, axis_name, data, **kwargs):
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = fdp.nnx_train_step(loss_fn, mesh=mesh, axis_name=axis_name, buffers="mean", **kwargs)
    for batch in data:
        step(model, optimizer, fdp.shard_batch(batch, mesh, axis_name=axis_name))
    return nnx.state(model)


def test_nnx_on_a_host_mesh_matches_the_flat_mesh():
    data = batches()
    flat = _nnx_run(fdp.data_mesh(), "data", data)
    for hierarchical in (False, True):
        got = _nnx_run(host_mesh(), AXES, data, hierarchical=hierarchical)
        chex.assert_trees_all_close(jax.device_get(got), jax.device_get(flat), atol=1e-6, rtol=1e-6)


def test_hierarchical_needs_two_axes_and_names_the_fix():
    with pytest.raises(ValueError, match=r"needs a host x device data axis.*HOST_AXES"):
        fdp.train_step(lambda p, b: 0.0, hierarchical=True)
    with pytest.raises(ValueError, match="lets replicas diverge"):
        fdp.train_step(lambda p, b: 0.0, axis_name=AXES, hierarchical=True, comm_hook="noop")
    with pytest.raises(ValueError, match="zero_stage=1 is not supported"):
        fdp.train_step(lambda p, b: 0.0, axis_name=AXES, hierarchical=True, zero_stage=1)


def test_describe_shows_the_data_axes():
    mesh = host_mesh()
    cfg = StepConfig(
        mesh=mesh, axis_name=list(AXES), reduction=fdp.Reduction(hierarchical=True)
    ).bind()
    assert cfg.axis_name == AXES
    assert cfg.describe()["axis_name"] == ["host", "device"]
    assert cfg.num_replicas == 8
    assert cfg.hook.name == "hierarchical"
    reduction = fdp.Reduction(reduce_dtype="float32")
    assert jnp.dtype(StepConfig(reduction=reduction).reduce_dtype) == jnp.float32
