"""ZeRO stage 3 gathering each parameter where it is used (fdp/step/grads/_per_use.py).

Stage 0 (DDP) is the reference: stage 3 must end where it does, whichever way it
gathers. The compiled program must gather in the forward and again in the backward
pass, and its peak must stay below the whole parameters plus their gradients.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, cross_entropy, train_on
from flax import nnx
from test_zero import (
    OPTIMIZERS,
    BNNet,
    NNXNet,
    batches,
    bn_loss,
    mlp_state,
    nnx_loss,
)

import fdp
from fdp.observe._hlo import collective_stats, loop_collectives
from fdp.step.layout._padding import unpad_like


@pytest.mark.parametrize("opt", ["sgd_momentum", "adam", "adamw_decay_mask"])
def test_linen_stage_3_per_use_ends_where_stage_0_does(opt):
    data = batches()
    loss_fn = cross_entropy(MLP().apply)
    ref, ref_metrics = train_on(
        fdp.train_step(loss_fn), fdp.replicate(mlp_state(OPTIMIZERS[opt]())), data
    )
    step = fdp.train_step(loss_fn, zero_stage=3)
    assert step.config.gathers_per_use
    state, metrics = train_on(step, fdp.replicate(mlp_state(OPTIMIZERS[opt]())), data)
    chex.assert_trees_all_close(
        jax.device_get(state.params), jax.device_get(ref.params), atol=2e-6, rtol=1e-5
    )
    # The head bias's optimizer state is kept padded (10 -> 16 floats) and sharded.
    chex.assert_trees_all_close(
        jax.device_get(unpad_like(state.opt_state, ref.opt_state)),
        jax.device_get(ref.opt_state),
        atol=2e-6,
        rtol=1e-5,
    )
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-6)
    # Still a share between steps: the kernels are split, the 10-float head bias is whole.
    assert not state.params["Dense_0"]["kernel"].sharding.is_fully_replicated


@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw_decay_mask"])
def test_nnx_stage_3_per_use_ends_where_stage_0_does(opt):
    data = batches()
    results = {}
    for stage in (0, 3):
        model = NNXNet(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, OPTIMIZERS[opt](), wrt=nnx.Param)
        step = fdp.nnx_train_step(nnx_loss, zero_stage=stage)
        for batch in data:
            metrics = step(model, optimizer, fdp.shard_batch(batch))
        assert step.config.gathers_per_use == (stage == 3)
        results[stage] = jax.device_get(nnx.state(model)), float(metrics["loss"])
    # BatchNorm's gradient cancels: the backward pass's different fusion (the remat)
    # rounds differently, ~1e-7 of the gradient; AdamW amplifies near-zero entries.
    chex.assert_trees_all_close(results[3][0], results[0][0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(results[3][1], results[0][1], rtol=1e-6)


def test_accumulation_unused_parameters_and_buffers_with_per_use_gathers():
    def state():
        variables = BNNet().init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
        return fdp.TrainState.create(
            apply_fn=None,
            params=variables["params"],
            batch_stats=variables["batch_stats"],
            tx=optax.sgd(0.1, momentum=0.9),
        )

    # Four rows per device and micro-batch: with two, a pair of rows nearly equal in one
    # feature gives BatchNorm a variance of 3e-6 against its eps of 1e-5, which scales
    # the rounding of any two summation orders ~300x (2.9e-5 apart on jax 0.12, 2.5e-6
    # on 0.10); with four, stage 3 and stage 0 end 3e-8 apart on both.
    data = batches(2, rows=64)
    settings = dict(accumulate_steps=2, find_unused_parameters=True, buffers="mean")
    ref, _ = train_on(fdp.train_step(bn_loss, **settings), fdp.replicate(state()), data)
    step = fdp.train_step(bn_loss, zero_stage=3, **settings)
    got, _ = train_on(step, fdp.replicate(state()), data)
    chex.assert_trees_all_close(
        jax.device_get((got.params, got.batch_stats)),
        jax.device_get((ref.params, ref.batch_stats)),
        atol=1e-5,
        rtol=1e-5,
    )
    np.testing.assert_array_equal(np.asarray(got.params["unused"]), np.ones((8, 2)))
    assert not np.any(np.asarray(got.opt_state[0].trace["unused"]))
    # The price of accumulating: every micro-batch gathers and reduce-scatters.
    lowered = step.lower(got, fdp.shard_batch(data[0]))
    loop = loop_collectives(lowered)
    assert loop.count("all-gather") >= 2 and loop.count("reduce-scatter") >= 1


class Deep(nn.Module):
    """Eight 256 x 256 layers: the parameters dwarf the activations of a small batch."""

    @nn.compact
    def __call__(self, x):
        for _ in range(8):
            x = jnp.tanh(nn.Dense(256, use_bias=False)(x))
        return x


def deep_loss(params, batch):
    return jnp.mean((Deep().apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


def test_the_compiled_program_gathers_per_use_and_never_holds_every_parameter():
    params = Deep().init(jax.random.key(0), jnp.zeros((1, 256)))["params"]
    state = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    rng = np.random.default_rng(0)
    batch = fdp.shard_batch(
        {"x": rng.normal(size=(16, 256)).astype("f4"), "y": rng.normal(size=(16, 256)).astype("f4")}
    )
    whole = sum(x.nbytes for x in jax.tree.leaves(params))  # 8 x 256 KiB
    per_use = fdp.train_step(deep_loss, zero_stage=3)
    kept = fdp.train_step(
        deep_loss, sharding=fdp.Sharding(zero_stage=3, reshard_after_forward=False)
    )
    programs = {
        name: step.lower(fdp.replicate(state), batch).compile()
        for name, step in (("per_use", per_use), ("kept", kept))
    }
    stats = {name: collective_stats(p) for name, p in programs.items()}
    temp = {name: p.memory_analysis().temp_size_in_bytes for name, p in programs.items()}
    # Per use: each kernel gathered for the forward pass and again for the backward
    # pass (the remat never saves it), its gradient reduce-scattered.
    # (XLA may merge the last layer's two gathers: its backward follows its forward.)
    assert 2 * whole - whole // 8 <= stats["per_use"].nbytes("all-gather") <= 2 * whole
    assert stats["per_use"].nbytes("reduce-scatter") == whole // 8
    assert stats["kept"].nbytes("all-gather") == whole
    # Kept gathered: the whole parameters live through the backward pass, with the
    # whole local gradients. Per use: never all at once (a few layers at a time).
    assert temp["kept"] >= whole
    assert temp["per_use"] < whole // 2


def test_prefetch_must_be_a_bool():
    with pytest.raises(TypeError, match="prefetch must be True or False, got 'no'"):
        fdp.Sharding(zero_stage=3, prefetch="no")


def test_reshard_after_forward_must_be_a_bool():
    with pytest.raises(TypeError, match="reshard_after_forward must be True or False, got 1"):
        fdp.Sharding(zero_stage=3, reshard_after_forward=1)


def test_reshard_after_forward_is_a_sharding_field_not_a_flat_keyword():
    step = fdp.train_step(
        cross_entropy(MLP().apply), sharding=fdp.Sharding(zero_stage=3, reshard_after_forward=False)
    )
    assert not step.config.gathers_per_use
    assert fdp.train_step(cross_entropy(MLP().apply), zero_stage=3).config.gathers_per_use
    with pytest.raises(TypeError, match="reshard_after_forward"):
        fdp.train_step(cross_entropy(MLP().apply), reshard_after_forward=False)


def test_a_hook_without_the_plain_reduce_scatter_keeps_the_parameters_gathered():
    step = fdp.train_step(cross_entropy(MLP().apply), zero_stage=3, comm_hook="bf16_compress")
    assert not step.config.gathers_per_use


class ScannedLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(16)(x)), None


class Scanned(nn.Module):
    """Four layers under ``nn.scan``: one stacked [4, ...] parameter per leaf."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        stack = nn.scan(
            ScannedLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
        )
        x, _ = stack()(x, None)
        return nn.Dense(10)(x)


def test_a_scanned_layer_stack_ends_where_stage_0_does():  # per layer: test_per_layer.py
    params = Scanned().init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    loss_fn = cross_entropy(Scanned().apply)
    data = batches()
    results = {}
    for stage in (0, 3):
        state = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
        results[stage], _ = train_on(
            fdp.train_step(loss_fn, zero_stage=stage), fdp.replicate(state), data
        )
    chex.assert_trees_all_close(
        jax.device_get(results[3].params), jax.device_get(results[0].params), atol=1e-5, rtol=1e-5
    )


class Tokens(nn.Module):
    """Embedding, layer norm, two products with biases, and a leaf no device count divides."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.LayerNorm()(nn.Embed(64, 32)(tokens))
        scale = self.param("scale", nn.initializers.ones, (3,))
        return nn.Dense(64)(jnp.tanh(nn.Dense(128)(x))) * jnp.mean(scale)


def tokens_loss(params, batch):
    logits = Tokens().apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _deep_case(rng):
    params = Deep().init(jax.random.key(0), jnp.zeros((1, 256)))["params"]
    batch = {
        "x": rng.normal(size=(16, 256)).astype("f4"),
        "y": rng.normal(size=(16, 256)).astype("f4"),
    }
    return deep_loss, params, batch


def _tokens_case(rng):
    params = Tokens().init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    batch = {"x": rng.integers(0, 64, size=(16, 8)), "y": rng.integers(0, 64, size=(16, 8))}
    return tokens_loss, params, batch


def _scan_case(rng):
    from test_per_layer import Stack, linen_loss

    # Layers under nn.scan(nn.remat(...)) between two plain ones, unrolled by 2: the
    # loop body's uses form groups of their own, and a loop ends the outer groups.
    model = Stack(depth=8, width=32, unroll=2)
    params = model.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    batch = {
        "x": rng.normal(size=(16, 16)).astype("f4"),
        "y": rng.normal(size=(16, 8)).astype("f4"),
    }
    return linen_loss(model), params, batch


def _metric(params, batch):
    """A use after the loss's, in ``aux`` only: its backward never runs."""
    x = jnp.tanh(batch["x"][:, :1].astype(jnp.float32)) * jnp.ones((1, 128))
    return jnp.mean(x @ params["Dense_0"]["kernel"])  # 128 x 64: the output layer


@pytest.mark.parametrize(
    ("case", "ahead", "group_bytes", "metric"),
    [
        (_deep_case, 1, 512 * 1024, None),  # groups of two layers
        (_tokens_case, 1, 0, None),  # a group per use
        (_tokens_case, 1, 64 * 1024, _metric),
        (_tokens_case, 2, 16 * 1024, None),
        (_scan_case, 1, 2 * 1024, None),
    ],
)
def test_gathers_in_groups_tied_ahead_give_the_gradients_of_gathers_tied_to_their_use(
    case, ahead, group_bytes, metric
):
    # On GPU the uses form groups of about `group_bytes` of parameters (XLA merges a
    # group's gathers), whose forward gathers are tied to a token of the group `ahead`
    # groups back and whose backward gathers to the cotangents the use opening the group
    # `ahead + 1` later hands back (or the loss's identity, for the last groups); on CPU
    # (ahead 0) each to its own use. Only the order changes: the same numbers, up to the
    # order XLA sums a parameter's cotangents in (1e-6 relative, a layer norm's scale).
    loss, grads = _per_use_gradients(case, ahead, group_bytes, metric)
    own = _per_use_gradients(case, 0, 0, None)  # the metric is aux: no gradient
    chex.assert_trees_all_close((loss, grads), own, rtol=1e-5, atol=1e-8)
    # The sum over devices of each device's mean-loss gradient: N times the full batch's.
    loss_fn, params, batch = case(np.random.default_rng(0))
    full = jax.grad(loss_fn)(params, batch)
    n = fdp.data_mesh().shape["data"]
    chex.assert_trees_all_close(grads, jax.tree.map(lambda g: n * g, full), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("gather_dtype", "barriers"), [(jnp.bfloat16, False), (None, True)], ids=["bf16", "barriers"]
)
def test_the_last_group_kept_gathered_gives_the_gradients_of_gathering_it_again(
    gather_dtype, barriers
):
    # With groups (ahead > 0) the forward pass's last group keeps its gathered values
    # (cast to bf16 for the gather, or tied by optimization barriers) for its backward
    # pass; without (ahead 0) every use gathers again. The same gather dtype and ties:
    # the same numbers.
    kept = _per_use_gradients(_deep_case, 1, 512 * 1024, None, gather_dtype, barriers)
    again = _per_use_gradients(_deep_case, 0, 0, None, gather_dtype, barriers)
    chex.assert_trees_all_close(kept, again, rtol=1e-5, atol=1e-8)


@functools.cache  # each case's ungrouped reference is computed once
def _per_use_gradients(case, ahead, group_bytes, metric, gather_dtype=None, barriers=False):
    """Loss and gradients of ``case`` through per_use_objective on 8 simulated devices."""
    from fdp.step.grads._per_use import per_use_objective
    from fdp.step.layout._zero import shard_dim

    mesh = fdp.data_mesh()
    loss_fn, params, batch = case(np.random.default_rng(0))
    dims = [shard_dim(x.shape, mesh.shape["data"]) for x in jax.tree.leaves(params)]
    assert sum(d is not None for d in dims) >= 6
    specs = [
        jax.P(*[("data" if i == d else None) for i in range(x.ndim)])
        for x, d in zip(jax.tree.leaves(params), dims, strict=True)
    ]
    split = jax.tree.unflatten(jax.tree.structure(params), specs)

    def objective(p, micro, carry, key):
        return loss_fn(p, micro), (() if metric is None else metric(p, micro)), carry

    per_use = per_use_objective(
        objective,
        dims,
        "data",
        ahead=ahead,
        group_bytes=group_bytes,
        gather_dtype=gather_dtype,
        barriers=barriers,
    )

    def local(shards, micro):
        loss, grads = jax.value_and_grad(lambda s: per_use(s, micro, (), None)[0])(shards)
        # (A leaf kept whole is replicated: shard_map sums its gradient over devices.)
        return jax.lax.pmean(loss, "data"), grads

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(split, jax.P("data")), out_specs=(jax.P(), split)
    )
    return jax.jit(mapped)(params, batch)
