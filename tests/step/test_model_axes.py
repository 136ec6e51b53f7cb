"""Data parallelism over 'data', tensor parallelism over 'model': the user's layout is kept.

A Megatron-style MLP (first kernel split by columns over 'model', second by rows) on
4 x 2 and 2 x 4 meshes of the 8 simulated devices: fdp's step keeps every leaf's split
over 'model' (parameters and optimizer state), whether the user placed it so or
declared it through Flax's partitioning metadata, and ends where one device on the
full batch does (plain optax, ``reference_steps``).
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import reference_steps
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fdp
from fdp.collectives._blocks import on_blocks
from fdp.step.options._config import StepConfig

STEPS, ROWS = 3, 32
TOL = {"rtol": 1e-5, "atol": 1e-6}
SPECS = {
    "Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
    "Dense_1": {"kernel": P("model"), "bias": P()},
}
RULES = (("batch", None), ("embed", None), ("mlp", "model"), ("out", None))


AUTO = (AxisType.Auto,) * 2


def mesh_of(shape):
    return jax.make_mesh(shape, ("data", "model"), axis_types=AUTO)


class Megatron(nn.Module):
    constrain: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        if self.constrain:  # as tensor-parallel models pin their activations
            h = jax.lax.with_sharding_constraint(h, P(None, "model"))
        return nn.Dense(4)(h)


class LogicalMegatron(nn.Module):
    """The same model, its layout declared the way Flax's examples declare theirs."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers
        dense = nn.Dense(
            16,
            kernel_init=nn.with_logical_partitioning(init.lecun_normal(), ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(init.zeros_init(), ("mlp",)),
        )
        h = nn.with_logical_constraint(nn.relu(dense(x)), ("batch", "mlp"))
        out = nn.Dense(
            4,
            kernel_init=nn.with_logical_partitioning(init.lecun_normal(), ("mlp", "out")),
            bias_init=nn.with_logical_partitioning(init.zeros_init(), ("out",)),
        )
        return out(h)


def batches():
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(ROWS, 8)).astype(np.float32),
            "y": rng.normal(size=(ROWS, 4)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def mse(apply_fn):
    def loss_fn(params, batch):
        return jnp.mean((apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return loss_fn


def params_of(model=None):
    model = Megatron() if model is None else model
    return model.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]


def placed(tree, mesh, specs=SPECS):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def expected(params, model=None):
    model = Megatron() if model is None else model
    state = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    return reference_steps(state, batches(), mse(model.apply))[0].params


def leaf_values(tree):
    return jax.device_get(jax.tree.leaves(tree))


def assert_split_over_model(tree, mesh, specs=SPECS):
    """Each leaf laid out as ``specs`` says: 1/model of a split leaf on every device."""
    model = mesh.shape["model"]
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs), strict=True):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), spec
        held = leaf.addressable_shards[0].data.size
        assert held == (leaf.size // model if len(spec) else leaf.size), (spec, held)


def train(step, state, mesh):
    for batch in batches():
        state, _ = step(state, fdp.shard_batch(batch, mesh))
    return state


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)], ids=["4x2", "2x4"])
@pytest.mark.parametrize("layout", ["leaves", "flat"])
def test_linen_keeps_the_model_split_and_ends_where_one_device_does(shape, layout):
    mesh, params = mesh_of(shape), params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(mse(Megatron().apply), mesh=mesh, reduction=fdp.Reduction(layout=layout))
    state = step.init(state)
    assert_split_over_model(state.params, mesh)
    state = train(step, state, mesh)
    assert_split_over_model(state.params, mesh)
    assert_split_over_model(state.opt_state[0].mu, mesh)
    assert_split_over_model(state.opt_state[0].nu, mesh)
    chex.assert_trees_all_close(jax.device_get(state.params), expected(params), **TOL)


@pytest.mark.parametrize("steps", [1, 2], ids=["whole", "accumulated"])
@pytest.mark.parametrize("shape", [(4, 2), (2, 4)], ids=["4x2", "2x4"])
def test_grouped_buckets_reduce_model_split_blocks_and_end_where_one_device_does(
    shape, steps, monkeypatch
):
    # On GPU each bucket's gradients are all-reduced where they lie, tagged with the
    # bucket's key (XLA merges them into one), a model-split bucket on each device's
    # block. Forced here on CPU, where the tags change nothing but the path is the same.
    from fdp.hooks import _bucketed

    monkeypatch.setattr(StepConfig, "groups_buckets", property(lambda self: True))
    blocks = []  # the layouts the default hook reduced on their blocks
    monkeypatch.setattr(
        _bucketed,
        "on_blocks",
        lambda fn, layout, axes: blocks.append((layout, axes)) or on_blocks(fn, layout, axes),
    )
    mesh, params = mesh_of(shape), params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(
        mse(Megatron().apply),
        mesh=mesh,
        reduction=fdp.Reduction(layout="flat"),
        accumulation=fdp.Accumulation(steps=steps),
    )
    state = train(step, step.init(state), mesh)
    assert set(blocks) == {
        (P(None, "model"), ("model",)),
        (P("model"), ("model",)),
        (P(), ("model",)),
    }, blocks
    assert_split_over_model(state.params, mesh)
    chex.assert_trees_all_close(jax.device_get(state.params), expected(params), **TOL)


def test_accumulation_keeps_the_split_and_ends_where_one_device_does():
    mesh, params = mesh_of((4, 2)), params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(mse(Megatron().apply), mesh=mesh, accumulation=fdp.Accumulation(steps=4))
    state = train(step, step.init(state), mesh)
    assert_split_over_model(state.params, mesh)
    chex.assert_trees_all_close(jax.device_get(state.params), expected(params), **TOL)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_split_survives_a_checkpoint_and_restores_onto_a_1d_mesh_and_back(tmp_path, stage):
    mesh, params = mesh_of((4, 2)), params_of()
    line = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    zero = fdp.Sharding(zero_stage=stage)
    step = fdp.train_step(mse(Megatron().apply), mesh=mesh, sharding=zero)
    state = train(step, step.init(state), mesh)
    ckpt = fdp.CheckpointManager(tmp_path / "2d", async_save=False)
    ckpt.save(STEPS, state)
    # Onto a 1-D mesh (DDP alone): the template says where each leaf goes.
    fresh = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    flat_step = fdp.train_step(mse(Megatron().apply), mesh=line, sharding=zero)
    flat = ckpt.restore(flat_step.init(fresh)).state
    assert all(x.sharding.mesh == line for x in jax.tree.leaves(flat.params))
    chex.assert_trees_all_equal(leaf_values(flat), leaf_values(state))
    # And back: a template with the model split gets it again, bit for bit.
    ckpt = fdp.CheckpointManager(tmp_path / "1d", async_save=False)
    ckpt.save(STEPS, flat)
    template = step.init(
        fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    )
    back = ckpt.restore(template).state
    if stage == 0:
        assert_split_over_model(back.params, mesh)
        assert_split_over_model(back.opt_state[0].nu, mesh)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want)
    chex.assert_trees_all_equal(leaf_values(back), leaf_values(state))


def test_buckets_never_mix_layouts_and_the_plan_says_each_ones():
    mesh = mesh_of((4, 2))
    state = fdp.TrainState.create(
        apply_fn=None, params=placed(params_of(), mesh), tx=optax.sgd(0.1)
    )
    # One cap large enough for every leaf: only the layouts keep them apart.
    step = fdp.train_step(
        mse(Megatron().apply),
        mesh=mesh,
        reduction=fdp.Reduction(bucket_cap_mb=100, layout="flat"),
    )
    train(step, step.init(state), mesh)
    assert step.plan is not None
    layouts = {b.layout: b.key_paths for b in step.plan.buckets}
    assert len(step.plan.buckets) == len(layouts) == 3, step.plan.buckets
    assert layouts[P()] == ("['Dense_1']['bias']",)
    assert layouts[P("model")] == ("['Dense_1']['kernel']", "['Dense_0']['bias']")
    assert layouts[P(None, "model")] == ("['Dense_0']['kernel']",)
    table = fdp.describe(step)
    assert "layout" in table and "P(None, 'model')" in table, table


def test_a_constraint_on_the_model_axis_in_the_loss_works_as_written():
    mesh, params = mesh_of((4, 2)), params_of()
    model = Megatron(constrain=True)
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(mse(model.apply), mesh=mesh)
    one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1], axis_types=AUTO)
    with jax.set_mesh(one):  # the bare spec's mesh for plain jit; fdp's step needs none
        want = expected(params, model)
    state = train(step, step.init(state), mesh)
    assert_split_over_model(state.params, mesh)
    chex.assert_trees_all_close(jax.device_get(state.params), want, **TOL)


def test_flax_logical_partitioning_is_read_from_the_boxes():
    mesh, model = mesh_of((4, 2)), LogicalMegatron()
    with nn.logical_axis_rules(RULES):
        boxed = model.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
        # Unplaced: the arrays sit on one device; the boxes say where they go.
        state = fdp.TrainState.create(apply_fn=None, params=boxed, tx=optax.adam(1e-2))
        step = fdp.train_step(mse(model.apply), mesh=mesh)
        state = step.init(state)
        assert_split_over_model(nn.unbox(state.params), mesh)
        state = train(step, state, mesh)
        assert_split_over_model(nn.unbox(state.params), mesh)
        assert_split_over_model(nn.unbox(state.opt_state[0].mu), mesh)
        want = expected(nn.unbox(boxed), model)
    chex.assert_trees_all_close(jax.device_get(nn.unbox(state.params)), want, **TOL)


def test_a_declared_axis_the_mesh_lacks_is_named():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with nn.logical_axis_rules(RULES):
        boxed = LogicalMegatron().init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
    state = fdp.TrainState.create(apply_fn=None, params=boxed, tx=optax.sgd(0.1))
    step = fdp.train_step(mse(LogicalMegatron().apply), mesh=mesh)
    with (
        nn.logical_axis_rules(RULES),
        pytest.raises(ValueError, match=r"\['Dense_0'\]\['bias'\].*names \['model'\]"),
    ):
        step.init(state)


class NNXMegatron(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers
        self.l1 = nnx.Linear(
            8,
            16,
            kernel_init=nnx.with_partitioning(init.lecun_normal(), (None, "model")),
            bias_init=nnx.with_partitioning(init.zeros_init(), ("model",)),
            rngs=rngs,
        )
        self.l2 = nnx.Linear(
            16,
            4,
            kernel_init=nnx.with_partitioning(init.lecun_normal(), ("model", None)),
            rngs=rngs,
        )

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def param_values(model):
    return jax.device_get(jax.tree.leaves(nnx.state(model, nnx.Param)))


def nnx_mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


NNX_CASES = {
    "4x2": ((4, 2), True, 0),
    "2x4": ((2, 4), True, 0),
    "lazy": ((4, 2), False, 0),
    "4x2-stage3": ((4, 2), True, 3),
    "2x4-lazy-stage1": ((2, 4), False, 1),
}


@pytest.mark.parametrize("shape, eager, stage", NNX_CASES.values(), ids=NNX_CASES.keys())
def test_nnx_keeps_the_declared_split_and_ends_where_one_device_does(shape, eager, stage):
    mesh = mesh_of(shape)
    # Eager: Flax places each variable as declared, on the context mesh. Lazy: the
    # arrays sit on one device, and fdp reads the declared sharding from the metadata.
    created = jax.set_mesh(mesh) if eager else nnx.use_eager_sharding(False)
    with created:
        model = NNXMegatron(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with nnx.use_eager_sharding(False), jax.default_device(jax.devices()[0]):
        reference = NNXMegatron(nnx.Rngs(0))
        ref_opt = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)
    chex.assert_trees_all_equal(param_values(model), param_values(reference))
    step = fdp.nnx_train_step(nnx_mse, mesh=mesh, sharding=fdp.Sharding(zero_stage=stage))
    step.init(model, optimizer)
    for batch in batches():
        step(model, optimizer, fdp.shard_batch(batch, mesh))
    kernels = (model.l1.kernel, model.l1.bias, model.l2.kernel, model.l2.bias)
    want = (P(None, "model"), P("model"), P("model"), P())
    if stage < 3:
        assert_split_over_model([k[...] for k in kernels], mesh, list(want))
    else:  # the kernels split over 'data' too, on the dimension the model axis leaves
        assert model.l1.kernel[...].sharding.spec == P("data", "model")
        assert model.l2.kernel[...].sharding.spec[:2] == ("model", "data")
    if stage:
        mu = optimizer.opt_state[0].mu
        assert mu["l1"]["kernel"][...].sharding.spec == P("data", "model")

    @nnx.jit
    def ref_step(model, optimizer, batch):
        grads = nnx.grad(nnx_mse)(model, batch)
        optimizer.update(model, grads)

    for batch in batches():
        ref_step(reference, ref_opt, batch)
    chex.assert_trees_all_close(param_values(model), param_values(reference), **TOL)


def zero_held(leaf, spec, mesh, stage_split):
    """Elements one device holds of ``leaf``: 1/model where ``spec`` splits it, and 1/data
    more where ZeRO splits it too (a dimension the model axis leaves and 'data' divides)."""
    model, data = mesh.shape["model"], mesh.shape["data"]
    held = leaf.size // model if len(spec) else leaf.size
    return held // data if stage_split else held


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("shape", [(4, 2), (2, 4)], ids=["4x2", "2x4"])
def test_zero_splits_over_data_on_top_of_the_model_split(shape, stage):
    mesh, params = mesh_of(shape), params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(mse(Megatron().apply), mesh=mesh, sharding=fdp.Sharding(zero_stage=stage))
    state = train(step, step.init(state), mesh)
    kernels = [("Dense_0", "kernel", 0), ("Dense_1", "kernel", 1)]  # ZeRO's dimension
    trees = [state.opt_state[0].mu, state.opt_state[0].nu]
    trees += [state.params] if stage == 3 else []
    for tree in trees:
        for layer, name, dim in kernels:
            leaf, spec = tree[layer][name], SPECS[layer][name]
            assert leaf.sharding.spec[dim] == "data", (layer, leaf.sharding)
            assert leaf.addressable_shards[0].data.size == zero_held(leaf, spec, mesh, True)
    if stage < 3:  # whole over the data axis, split over 'model' as placed
        assert_split_over_model(state.params, mesh)
    chex.assert_trees_all_close(jax.device_get(state.params), expected(params), **TOL)


def test_zero3_with_accumulation_on_a_model_axis_ends_where_one_device_does():
    mesh, params = mesh_of((4, 2)), params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(
        mse(Megatron().apply),
        mesh=mesh,
        sharding=fdp.Sharding(zero_stage=3),
        accumulation=fdp.Accumulation(steps=2),
        reduction=fdp.Reduction(layout="flat"),
    )
    state = train(step, step.init(state), mesh)
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.addressable_shards[0].data.size == kernel.size // 8
    chex.assert_trees_all_close(jax.device_get(state.params), expected(params), **TOL)


def test_explicit_axes_keep_the_split_of_a_model_written_for_them():
    # On Explicit axes a sharding is part of a value's type: a product over a split
    # contracting dimension names its output's sharding, as under plain jit.
    explicit = (AxisType.Explicit,) * 2
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=explicit)
    rng = np.random.default_rng(1)
    params = {"w1": rng.normal(size=(8, 16)), "w2": rng.normal(size=(16, 4))}
    params = jax.tree.map(lambda x: x.astype(np.float32), params)
    specs = {"w1": P(None, "model"), "w2": P("model")}

    def loss_fn(p, b):  # reshard: how a model on Explicit axes moves a value's split
        h = jax.sharding.reshard(jax.nn.relu(b["x"] @ p["w1"]), P(None, "model"))
        return jnp.mean((jnp.matmul(h, p["w2"], out_sharding=P()) - b["y"]) ** 2)

    tx = optax.adam(1e-2)
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh, specs), tx=tx)
    step = fdp.train_step(loss_fn, mesh=mesh)
    state = train(step, step.init(state), mesh)
    assert_split_over_model(state.params, mesh, specs)
    one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1], axis_types=explicit)
    with jax.set_mesh(one):
        want = reference_steps(
            fdp.TrainState.create(apply_fn=None, params=params, tx=tx), batches(), loss_fn
        )[0].params
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(want), **TOL)


@pytest.mark.parametrize("stage", [1, 3])
def test_hsdp_composes_host_x_data_x_model(stage):
    # ZeRO inside each "host", replicated across them, tensor parallel over 'model'.
    mesh = jax.make_mesh((2, 2, 2), ("host", "device", "model"), axis_types=(AxisType.Auto,) * 3)
    params = params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(
        mse(Megatron().apply),
        mesh=mesh,
        axis_name=("host", "device"),
        sharding=fdp.Sharding(zero_stage=stage, shard_over="inner"),
    )
    state = step.init(state)
    for batch in batches():
        state, _ = step(state, fdp.shard_batch(batch, mesh, axis_name=("host", "device")))
    mu = state.opt_state[0].mu["Dense_0"]["kernel"]
    assert mu.sharding.spec == P("device", "model"), mu.sharding
    assert mu.addressable_shards[0].data.size == mu.size // 4
    chex.assert_trees_all_close(jax.device_get(state.params), expected(params), **TOL)


def test_init_sharded_builds_stage3_shares_of_a_declared_split_directly():
    mesh, model = mesh_of((4, 2)), LogicalMegatron()

    def make_state(key):
        params = model.init(key, jnp.zeros((1, 8)))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))

    with nn.logical_axis_rules(RULES):
        step = fdp.train_step(mse(model.apply), mesh=mesh, sharding=fdp.Sharding(zero_stage=3))
        built = step.init_sharded(make_state, jax.random.key(0))
        want = step.init(make_state(jax.random.key(0)))
    kernel = nn.unbox(built.params)["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P("data", "model"), kernel.sharding
    assert kernel.addressable_shards[0].data.size == kernel.size // 8
    # Bit for bit on jax 0.10.2. On 0.12.0.1 one element of the (16, 4) kernel, split
    # P('model', 'data'), is one ulp apart: plain jax.jit(make_state, out_shardings=the
    # same shardings) differs from the eager init in the same element, by the same ulp.
    chex.assert_trees_all_close(leaf_values(built), leaf_values(want), rtol=2e-7, atol=0)
    for got, ref in zip(jax.tree.leaves(built), jax.tree.leaves(want), strict=True):
        assert got.sharding == ref.sharding


def test_zero_on_explicit_model_axes_is_refused_naming_the_fix():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match=r"model axes \['model'\] are Explicit.*Auto"):
        fdp.train_step(mse(Megatron().apply), mesh=mesh, sharding=fdp.Sharding(zero_stage=3))
    with jax.set_mesh(mesh):  # the context's mesh, resolved at the first call
        step = fdp.train_step(mse(Megatron().apply), sharding=fdp.Sharding(zero_stage=1))
        state = fdp.TrainState.create(apply_fn=None, params=params_of(), tx=optax.sgd(0.1))
        with pytest.raises(ValueError, match=r"model axes \['model'\] are Explicit"):
            step.init(state)


@pytest.mark.parametrize("stage", [0, 3])
def test_no_parameter_or_gradient_travels_over_the_model_axis(stage):
    # Packing a model-split leaf into a flat buffer would first gather it over 'model'.
    # The compiled step's only collectives over 'model' are the model's own: Megatron's
    # MLP all-reduces its row-parallel output, and the loss's gradient flows back.
    from fdp.observe._hlo import collective_stats

    mesh = mesh_of((4, 2))
    state = fdp.TrainState.create(
        apply_fn=None, params=placed(params_of(), mesh), tx=optax.adam(1e-2)
    )
    step = fdp.train_step(
        mse(Megatron().apply),
        mesh=mesh,
        reduction=fdp.Reduction(layout="flat", bucket_cap_mb=100),
        sharding=fdp.Sharding(zero_stage=stage),
    )
    state = step.init(state)
    compiled = step.lower(state, fdp.shard_batch(batches()[0], mesh)).compile()
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    model_groups = {tuple(sorted(row)) for row in ids.tolist()}  # devices along 'model'
    over_model = [
        c for c in collective_stats(compiled).ops if set(c.groups) <= model_groups and c.groups
    ]
    assert over_model, "the model's own all-reduce over 'model' is in the program"
    assert {c.kind for c in over_model} == {"all-reduce"}, over_model


def test_zero3_gathers_a_model_split_leaf_where_it_lies():
    # Inside a shard_map manual over 'data' only, XLA's partitioner replicates the
    # operand of an all-gather over 'data' on the 'model' axis it owns: a kernel split
    # over 'model' was gathered whole over 'model' first, and its gradient (the
    # transpose) reduce-scattered whole. gather_leaf gathers each device's model shard.
    from fdp.step.layout._zero import gather_leaf

    mesh = mesh_of((4, 2))
    w = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data", "model")))

    def loss(w):
        def local(w):
            return jnp.sum(gather_leaf(w, 0, "data", P(None, "model")) ** 2)[None]

        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}
        )
        return jnp.sum(mapped(w))

    ops = fdp.collective_stats(jax.jit(jax.grad(loss)).lower(w).compile()).ops
    kinds = {(op.kind, op.group_size, op.shapes[0]) for op in ops if op.kind != "all-reduce"}
    assert kinds == {("all-gather", 4, (8, 8)), ("reduce-scatter", 4, (2, 8))}, kinds
    np.testing.assert_allclose(jax.grad(loss)(w), 8 * np.ones((8, 16)))  # 4 copies x 2w


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)], ids=["4x2", "2x4"])
def test_zero3_scatters_a_model_split_gradient_where_it_lies(shape):
    mesh, params = mesh_of(shape), params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(mse(Megatron().apply), mesh=mesh, sharding=fdp.Sharding(zero_stage=3))
    state = step.init(state)
    lowered = step.lower(state, fdp.shard_batch(batches()[0], mesh))
    ops = fdp.collective_stats(lowered.compile()).ops
    data, model = mesh.shape["data"], mesh.shape["model"]
    gathered = {op.shapes[0] for op in ops if op.kind == "all-gather" and op.group_size == data}
    assert (8, 16 // model) in gathered, gathered  # Dense_0's kernel, still split over 'model'
    assert (8, 16) not in gathered, gathered
    # Nor is an activation gathered over 'model' (the per-use ties once raveled one).
    along_model = [op for op in ops if op.group_size == model and op.kind != "all-reduce"]
    assert not along_model, along_model


@pytest.mark.parametrize(
    "sharding",
    [
        fdp.Sharding(zero_stage=1),
        fdp.Sharding(zero_stage=2),
        fdp.Sharding(zero_stage=3, reshard_after_forward=False),
    ],
    ids=["stage1", "stage2", "stage3-kept"],
)
def test_bucket_scatters_and_gathers_keep_the_model_split(sharding):
    # A bucket's reduce-scatter (and at stage 3 kept gathered, its packed gather) over
    # 'data' inside the shard_map had its operand replicated over 'model' first.
    mesh, params = mesh_of((2, 4)), params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(mse(Megatron().apply), mesh=mesh, sharding=sharding)
    state = step.init(state)
    lowered = step.lower(state, fdp.shard_batch(batches()[0], mesh))
    ops = fdp.collective_stats(lowered.compile()).ops
    along_model = [op for op in ops if op.group_size == 4 and op.kind != "all-reduce"]
    assert not along_model, along_model
    trained = jax.device_get(train(step, state, mesh).params)
    chex.assert_trees_all_close(trained, expected(params), **TOL)


@pytest.mark.parametrize("cap_mb", [25.0, 3e-4], ids=["one-group", "small-groups"])
@pytest.mark.parametrize("shape", [(4, 2), (2, 4)], ids=["4x2", "2x4"])
def test_zero3_gather_groups_keep_the_last_one_and_end_where_one_device_does(
    shape, cap_mb, monkeypatch
):
    # On GPU stage 3 gathers in groups ahead of their use, and the forward pass's last
    # group keeps its gathered values for the backward pass; CPU steps gather at each use.
    # Groups forced here on model-split leaves: one group holding the whole model, all
    # kept; or groups of ~300 shard bytes, the last (the output layer's kernel and
    # bias) kept and those before it gathered again. Adam is blind to a gradient's
    # scale, not to its direction: kept values off by a constant fail both.
    from fdp.step.grads._per_use import _Prefetch

    monkeypatch.setattr(StepConfig, "prefetch_groups", property(lambda self: 1))
    keeps, kept = _Prefetch.keeps, []  # (group, kept?) as the backward pass asks

    def spy(self, group):
        kept.append((group, keeps(self, group)))
        return kept[-1][1]

    monkeypatch.setattr(_Prefetch, "keeps", spy)
    mesh, params = mesh_of(shape), params_of()
    state = fdp.TrainState.create(apply_fn=None, params=placed(params, mesh), tx=optax.adam(1e-2))
    step = fdp.train_step(
        mse(Megatron().apply),
        mesh=mesh,
        sharding=fdp.Sharding(zero_stage=3),
        reduction=fdp.Reduction(bucket_cap_mb=cap_mb),
    )
    assert step.config.gather_group_bytes == int(cap_mb * 2**20)
    state = train(step, step.init(state), mesh)
    groups = {g for g, _ in kept}
    assert {g for g, k in kept if k} == {max(groups)}  # the last group, and only it
    assert (len(groups) == 1) == (cap_mb > 1), kept  # else a group before it, gathered again
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.addressable_shards[0].data.size == kernel.size // 8
    chex.assert_trees_all_close(jax.device_get(state.params), expected(params), **TOL)


class ScannedLayer(nn.Module):
    """A Megatron block, as nn.scan stacks it: each kernel gets a leading layer axis."""

    @nn.compact
    def __call__(self, x, _):
        split, init = nn.with_partitioning, nn.initializers
        h = nn.Dense(
            32,
            kernel_init=split(init.lecun_normal(), (None, "model")),
            bias_init=split(init.zeros_init(), ("model",)),
        )(x)
        out = nn.Dense(16, kernel_init=split(init.lecun_normal(), ("model", None)))
        return x + out(nn.relu(h)), None


class ScannedMegatron(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            ScannedLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=4,
            metadata_params={nn.PARTITION_NAME: None},  # the layer axis is not split
        )
        x, _ = layers()(nn.Dense(16)(x), None)
        return nn.Dense(4)(x)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("shape", [(4, 2), (2, 4)], ids=["4x2", "2x4"])
def test_a_scanned_stack_keeps_its_model_split_and_ends_where_one_device_does(shape, stage):
    # Stages 0-2 reduce each layer's gradient inside the backward loop (a
    # reduce-scatter on each device's model block at stages 1-2); stage 3 gathers per use.
    model, mesh = ScannedMegatron(), mesh_of(shape)
    boxed = model.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
    state = fdp.TrainState.create(apply_fn=None, params=boxed, tx=optax.adam(1e-2))
    step = fdp.train_step(mse(model.apply), mesh=mesh, sharding=fdp.Sharding(zero_stage=stage))
    state = train(step, step.init(state), mesh)
    assert step.config.reduces_scanned_in_loop == (stage < 3)
    kernel = nn.unbox(state.params)["ScanScannedLayer_0"]["Dense_0"]["kernel"]  # (4, 16, 32)
    assert kernel.sharding.spec[2] == "model", kernel.sharding
    per_device = kernel.size // mesh.shape["model"] // (mesh.shape["data"] if stage == 3 else 1)
    assert kernel.addressable_shards[0].data.size == per_device
    plain = nn.unbox(boxed)
    state_one = fdp.TrainState.create(apply_fn=None, params=plain, tx=optax.adam(1e-2))
    want = reference_steps(state_one, batches(), mse(model.apply))[0].params
    chex.assert_trees_all_close(jax.device_get(nn.unbox(state.params)), want, **TOL)
