"""Meshes made the way current JAX makes them: ``jax.make_mesh`` (Explicit axes), ``jax.set_mesh``.

Every fdp entry point takes such a mesh and ends where one device on the whole batch does
(plain jax/optax: ``reference_steps``, or the same user step jitted on one device).
"""

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
    NNXMLP,
    cross_entropy,
    make_data,
    make_state,
    nnx_cross_entropy,
    reference_steps,
    train_on,
)
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fdp

STEPS, ROWS = 2, 32
TOL = {"rtol": 1e-5, "atol": 2e-6}  # test_zero's: the sharded update sums in another order


def explicit_mesh(shape=(8,), names=("data",)):
    mesh = jax.make_mesh(shape, names)  # no axis_types: Explicit, as JAX makes them now
    assert mesh.axis_types == (AxisType.Explicit,) * len(names)
    return mesh


def data(steps=STEPS):
    return [make_data(seed, ROWS) for seed in range(steps)]


def context(mesh, under):
    """``with jax.set_mesh(mesh)`` (current JAX's way), or no context mesh at all."""
    return jax.set_mesh(mesh) if under else contextlib.nullcontext()


def assert_on(tree, mesh):
    for leaf in jax.tree.leaves(tree):
        assert leaf.sharding.mesh == mesh, (leaf.sharding, mesh)


def test_replicate_and_shard_batch_place_on_the_explicit_mesh():
    mesh = explicit_mesh()
    init, batch = make_state("mlp", "adam"), make_data(0, ROWS)
    state, placed = fdp.replicate(init, mesh), fdp.shard_batch(batch, mesh)
    assert_on((state, placed), mesh)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state))
    assert placed["x"].sharding.spec == P("data")
    assert placed["x"].addressable_shards[0].data.shape == (ROWS // 8, 8, 8, 1)
    chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(init.params))
    chex.assert_trees_all_equal(jax.device_get(placed), batch)


# (mesh shape, axis names, ZeRO stage, micro-batches, under jax.set_mesh)
TRAIN_STEP_CASES = {
    "stage0": ((8,), ("data",), 0, 1, False),
    "stage1": ((8,), ("data",), 1, 1, False),
    "stage2": ((8,), ("data",), 2, 1, False),
    "stage3": ((8,), ("data",), 3, 1, False),
    "stage0-accumulate": ((8,), ("data",), 0, 2, False),
    "stage3-accumulate": ((8,), ("data",), 3, 2, False),
    "stage0-set_mesh": ((8,), ("data",), 0, 1, True),
    "stage3-set_mesh": ((8,), ("data",), 3, 1, True),
    "2d-stage0": ((4, 2), ("data", "model"), 0, 1, False),
    "2d-stage0-set_mesh": ((4, 2), ("data", "model"), 0, 1, True),
}


@pytest.mark.parametrize(
    ("shape", "names", "stage", "micro", "under"),
    list(TRAIN_STEP_CASES.values()),
    ids=list(TRAIN_STEP_CASES),
)
def test_train_step(shape, names, stage, micro, under):
    mesh = explicit_mesh(shape, names)
    init, batches = make_state("mlp", "adam"), data()
    loss_fn = cross_entropy(init.apply_fn)
    want, want_losses = reference_steps(init, batches, loss_fn)
    with context(mesh, under):
        step = fdp.train_step(
            loss_fn,
            mesh=mesh,
            sharding=fdp.Sharding(zero_stage=stage),
            accumulation=fdp.Accumulation(steps=micro),
        )
        state, metrics = train_on(step, step.init(fdp.replicate(init, mesh)), batches, mesh)
    assert_on(state, mesh)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(want.params), **TOL)
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[-1], rtol=1e-5)
    assert int(state.step) == STEPS


@pytest.mark.parametrize("stage", [0, 3])
def test_under_set_mesh_no_mesh_argument_is_needed(stage):
    """fdp's default mesh is the one jax.set_mesh set (data_mesh()'s Auto axes would clash)."""
    mesh, batches = explicit_mesh(), data()
    init = make_state("mlp", "adam")
    loss_fn = cross_entropy(init.apply_fn)
    want, _ = reference_steps(init, batches, loss_fn)
    with jax.set_mesh(mesh):
        step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=stage))
        state = step.init(fdp.replicate(init))
        for batch in batches:
            state, _ = step(state, fdp.shard_batch(batch))
    assert_on(state, mesh)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(want.params), **TOL)


def test_a_set_mesh_without_the_data_axis_is_a_clear_error():
    with jax.set_mesh(explicit_mesh((8,), ("batch",))):
        wrong = r"jax.set_mesh: axis_name='data' is not an axis of the mesh, whose axes are \('b"
        with pytest.raises(ValueError, match=wrong):
            fdp.replicate({"w": jnp.ones(3)})
        placed = fdp.shard_batch(np.zeros((8, 2), np.float32), axis_name="batch")
    assert placed.sharding.spec == P("batch")


@pytest.mark.parametrize("stage", [0, 3])
def test_train_step_init_sharded(stage):
    mesh, batches = explicit_mesh(), data()
    init = make_state("mlp", "adam")
    want, _ = reference_steps(init, batches, cross_entropy(init.apply_fn))
    step = fdp.train_step(
        cross_entropy(init.apply_fn), mesh=mesh, sharding=fdp.Sharding(zero_stage=stage)
    )
    state = step.init_sharded(lambda key: make_state("mlp", "adam", seed=key), 0)
    assert_on(state, mesh)
    state, _ = train_on(step, state, batches, mesh)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(want.params), **TOL)


Net, nnx_loss = NNXMLP, nnx_cross_entropy


def nnx_pair():
    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def nnx_params(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("start", ["init", "init_sharded"])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("under", [False, True], ids=["plain", "set_mesh"])
def test_nnx_train_step(under, stage, start):
    mesh, batches = explicit_mesh(), data()
    ref, ref_opt = nnx_pair()
    ref_step = nnx.jit(lambda m, o, b: o.update(m, nnx.grad(nnx_loss)(m, b)))
    for batch in batches:
        ref_step(ref, ref_opt, batch)
    with context(mesh, under):
        step = fdp.nnx_train_step(nnx_loss, mesh=mesh, sharding=fdp.Sharding(zero_stage=stage))
        if start == "init":
            model, opt = nnx_pair()
            step.init(model, opt)
        else:
            model, opt = step.init_sharded(lambda _: nnx_pair(), 0)
        for batch in batches:
            step(model, opt, fdp.shard_batch(batch, mesh))
    assert_on(nnx.state((model, opt)), mesh)
    chex.assert_trees_all_close(nnx_params(model), nnx_params(ref), **TOL)
    assert int(opt.step[...]) == STEPS


TX = optax.sgd(0.1, momentum=0.9)


def linear_loss(params, batch):
    logits = batch["x"].reshape(batch["x"].shape[0], -1) @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def user_step(reduce, local=lambda p: p):
    """A user's own step: grads of ``local(params)``, ``reduce``d, applied with optax."""

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(linear_loss)(local(params), batch)
        updates, opt_state = TX.update(reduce(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def user_run(step, place=lambda x: x):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 10)) * 0.1, jnp.float32), "b": jnp.zeros(10)}
    opt_state, losses = TX.init(params), []
    for batch in data():
        params, opt_state, loss = step(params, opt_state, place(batch))
        losses.append(float(jnp.mean(loss)))
    return params, losses


def reference_user_run():
    device = jax.devices()[0]
    return user_run(jax.jit(user_step(lambda g: g)), lambda b: jax.device_put(b, device))


@pytest.mark.parametrize("under", [False, True], ids=["plain", "set_mesh"])
@pytest.mark.parametrize("how", ["ddp", "shard_map"])
def test_user_step_with_reduce_gradients(how, under):
    mesh = explicit_mesh()
    want, want_losses = reference_user_run()
    with context(mesh, under):
        if how == "ddp":
            step = fdp.ddp(user_step(fdp.reduce_gradients), mesh=mesh, batch_argnums=2)
        else:  # the user's own shard_map: per-device parameters, then the one line
            body = user_step(
                lambda g: fdp.reduce_gradients(g, axis_name="data"),
                local=lambda p: jax.lax.pcast(p, "data", to="varying"),
            )

            def mapped(params, opt_state, batch):
                params, opt_state, loss = body(params, opt_state, batch)
                return params, opt_state, jax.lax.pmean(loss, "data")

            specs = {"in_specs": (P(), P(), P("data")), "out_specs": P()}
            step = jax.jit(jax.shard_map(mapped, mesh=mesh, **specs))
        params, losses = user_run(step, lambda b: fdp.shard_batch(b, mesh))
    chex.assert_trees_all_close(jax.device_get(params), jax.device_get(want), **TOL)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.parametrize("under", [False, True], ids=["plain", "set_mesh"])
def test_data_parallel(under):
    mesh = explicit_mesh()
    w = jnp.arange(12.0).reshape(3, 4)
    x = np.random.default_rng(0).normal(size=(13, 3)).astype(np.float32)  # 13: padded to 16
    with context(mesh, under):
        got = fdp.data_parallel(lambda w, x: x @ w, mesh=mesh)(w, x)
    np.testing.assert_allclose(got, x @ w, rtol=1e-6)
