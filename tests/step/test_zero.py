"""ZeRO stages 1-3 (``zero_stage=``): the same parameters as DDP, 1/N of the memory.

The reference for every stage is a single device stepping on the whole batch (plain
optax), the independent definition of the DDP step; stage 0 is pinned to it elsewhere.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, cross_entropy, device0_bytes, make_data, reference_steps, train_on
from flax import nnx
from flax.training.train_state import TrainState

import fdp
from fdp.observe._hlo import collective_stats, loop_collectives

N = 8
STEPS = 3


def path_label(params):
    """multi_transform labels keyed by parameter path: the head is 'fast'."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "fast" if "Dense_2" in jax.tree_util.keystr(path) else "slow", params
    )


OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_decay_mask": lambda: optax.adamw(
        1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
    "clip_global_norm_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "multi_transform_by_path": lambda: optax.multi_transform(
        {"slow": optax.sgd(0.05), "fast": optax.adam(1e-2)}, path_label
    ),
}


def mlp_state(tx, seed=0):
    model = MLP()  # kernels divide by 8; the head's bias (10) stays whole
    params = model.init(jax.random.key(seed), jnp.zeros((1, 8, 8, 1)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def batches(num=STEPS, rows=32, seed=1):
    data = make_data(seed, rows * num)
    return [{k: v[i * rows : (i + 1) * rows] for k, v in data.items()} for i in range(num)]


def nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_every_stage_ends_where_one_device_on_the_whole_batch_does(opt):
    data = batches()
    loss_fn = cross_entropy(MLP().apply)
    expected, losses = reference_steps(mlp_state(OPTIMIZERS[opt]()), data, loss_fn)
    for stage in (1, 2, 3):
        step = fdp.train_step(loss_fn, zero_stage=stage, layout="flat" if stage == 2 else "leaves")
        state, metrics = train_on(step, fdp.replicate(mlp_state(OPTIMIZERS[opt]())), data)
        chex.assert_trees_all_close(
            jax.device_get(state.params), jax.device_get(expected.params), atol=2e-6, rtol=1e-5
        )
        np.testing.assert_allclose(float(metrics["loss"]), losses[-1], rtol=1e-5)
        assert int(state.step) == STEPS


def test_what_each_device_holds_at_each_stage():
    data = batches(1)
    full = None
    for stage in (0, 1, 2, 3):
        step = fdp.train_step(cross_entropy(MLP().apply), zero_stage=stage)
        state, _ = train_on(step, fdp.replicate(mlp_state(optax.adam(1e-2))), data)
        held = device0_bytes(state.params), device0_bytes(state.opt_state)
        if stage == 0:
            full = held
            assert held == (nbytes(state.params), nbytes(state.opt_state))
            continue
        whole = 10 * 4  # the head's bias: 10 floats, no dimension divisible by 8
        # Optimizer state: 1/N of the shardable bytes; the bias's mu and nu padded to 16
        # floats and sharded (2 floats a device each), Adam's count whole.
        padded = 16 * 4
        assert held[1] == (full[1] - 2 * whole - 4) // N + 2 * padded // N + 4
        assert held[1] <= full[1] / N + 2 * (padded - whole) / N + 4
        if stage == 3:  # parameters are never padded: the bias stays whole
            assert held[0] == (full[0] - whole) // N + whole
        else:
            assert held[0] == full[0]
        report = fdp.describe(step)
        assert "reduced gradients (in the step)   " in report
        assert f"ZeRO stage {stage} over 8 device(s)" in report
        assert "kept whole (no dimension divisible by 8, not padded): ['Dense_2']['bias']" in report
        assert "optimizer state padding (zeros, in all): 48 B, 6 B per device" in report


def compiled(step, state, batch):
    return collective_stats(step.lower(state, fdp.shard_batch(batch)).compile())


def test_the_compiled_collectives_of_each_stage():
    """Read from XLA:CPU's compiled HLO, 2 flat buckets (flat keeps them apart)."""
    state = mlp_state(optax.adam(1e-2))
    grad_bytes = nbytes(state.params)
    whole = 10 * 4
    sharded = grad_bytes - whole
    stats = {}
    for stage in (0, 1, 2, 3):
        step = fdp.train_step(
            cross_entropy(MLP().apply),
            # stage 3 kept gathered: one gather per bucket (per-use gathers: test_per_use.py)
            sharding=fdp.Sharding(zero_stage=stage, reshard_after_forward=False),
            layout="flat",
            bucket_cap_mb=2e-3,
            first_bucket_cap_mb=2e-3,
        )
        stats[stage] = compiled(step, fdp.replicate(state), batches(1)[0])
        assert len(step.plan.buckets) == 2
    assert stats[0].nbytes("all-reduce") >= grad_bytes and stats[0].count("reduce-scatter") == 0
    assert stats[0].count("all-gather") == 0
    # Stages 1 and 2: one reduce-scatter per bucket, each device getting 1/N of the
    # gradients; no gradient-sized all-reduce is left (only the whole bias and the loss);
    # the new parameters are gathered. DDP's bytes: an all-reduce is the two together.
    # The bias's update runs on its share of the padded optimizer state (16 floats), and
    # the new bias, whole between steps, is gathered too.
    padded_bias = 16 * 4
    for stage in (1, 2):
        assert stats[stage].count("reduce-scatter") == 2
        assert stats[stage].nbytes("reduce-scatter") == sharded // N
        assert stats[stage].nbytes("all-reduce") <= whole + 16
        assert stats[stage].nbytes("all-gather") == sharded + padded_bias
    # Stage 3: the parameters gathered once, at the start; the update stays sharded.
    assert stats[3].count("reduce-scatter") == 2
    assert stats[3].nbytes("all-gather") == sharded + padded_bias
    assert stats[3].nbytes("all-reduce") <= whole + 16
    # A hook without a reduce-scatter form: stage 1 all-reduces whole gradients.
    step = fdp.train_step(cross_entropy(MLP().apply), zero_stage=1, comm_hook="quantize_per_tensor")
    hooked = compiled(step, fdp.replicate(state), batches(1)[0])
    assert hooked.count("reduce-scatter") == 0 and hooked.nbytes("all-gather") >= sharded


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(16, use_bias=False)(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        self.param("unused", nn.initializers.ones, (8, 2))
        return nn.Dense(10)(nn.relu(x))


def bn_state():
    model = BNNet()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
    return fdp.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.adam(1e-2),
    )


def bn_loss(params, batch, batch_stats):
    logits, updates = BNNet().apply(
        {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates["batch_stats"]


def test_accumulation_unused_parameters_and_buffers_compose_with_stage_2_and_3():
    data = batches(2)
    settings = dict(accumulate_steps=2, find_unused_parameters=True, buffers="mean")
    ref, _ = train_on(fdp.train_step(bn_loss, **settings), fdp.replicate(bn_state()), data)
    for stage in (2, 3):  # stage 3 kept gathered; per-use gathers: test_per_use.py
        sharding = fdp.Sharding(zero_stage=stage, reshard_after_forward=False)
        step = fdp.train_step(bn_loss, sharding=sharding, **settings)
        state, _ = train_on(step, fdp.replicate(bn_state()), data)
        chex.assert_trees_all_close(
            jax.device_get((state.params, state.batch_stats)),
            jax.device_get((ref.params, ref.batch_stats)),
            atol=2e-6,
            rtol=1e-5,
        )
        # The unused parameter and its Adam moments are untouched, as DDP leaves them.
        np.testing.assert_array_equal(np.asarray(state.params["unused"]), np.ones((8, 2)))
        assert not np.any(np.asarray(state.opt_state[0].mu["unused"]))
        # One reduce-scatter per step, after the micro-batch loop: none inside it.
        lowered = step.lower(state, fdp.shard_batch(data[0]))
        assert loop_collectives(lowered).count("reduce-scatter") == 0
        assert collective_stats(lowered).count("reduce-scatter") >= 1


def test_bf16_compression_of_the_reduce_scatter_and_powersgd_at_stage_1():
    data = batches(1)
    loss_fn = cross_entropy(MLP().apply)
    for hook, stage in (("bf16_compress", 2), ("fp16_compress", 3)):
        ref, _ = train_on(
            fdp.train_step(loss_fn, comm_hook=hook), fdp.replicate(mlp_state(optax.sgd(0.1))), data
        )
        step = fdp.train_step(loss_fn, comm_hook=hook, zero_stage=stage)
        state, _ = train_on(step, fdp.replicate(mlp_state(optax.sgd(0.1))), data)
        chex.assert_trees_all_close(
            jax.device_get(state.params), jax.device_get(ref.params), atol=1e-3
        )
        # The emitted program reduce-scatters 16-bit values: half the f32 shares' bytes.
        lowered = collective_stats(step.lower(state, fdp.shard_batch(data[0])))
        sharded_f32 = nbytes(state.params) - 10 * 4
        assert lowered.nbytes("reduce-scatter") == sharded_f32 // N // 2, hook
    # PowerSGD rebuilds whole gradients: it works with stage 1 (and refuses 2 and 3, below).
    powersgd = fdp.hooks.powersgd(matrix_approximation_rank=2, start_powersgd_iter=2)
    results = []
    for stage in (0, 1):
        state = fdp.replicate(
            fdp.TrainState.create(
                apply_fn=None, params=mlp_state(optax.adam(1e-2)).params, tx=optax.adam(1e-2)
            )
        )
        step = fdp.train_step(loss_fn, comm_hook=powersgd, zero_stage=stage)
        results.append(jax.device_get(train_on(step, state, batches(3))[0].params))
    chex.assert_trees_all_close(results[1], results[0], atol=2e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(zero_stage=4), ValueError, r"zero_stage must be one of \(0, 1, 2, 3\).*got 4"),
        (dict(zero_stage=True), TypeError, "zero_stage must be an int"),
        (dict(zero_stage="2"), TypeError, "zero_stage must be an int"),
        (dict(zero_stage=1, comm_hook="noop"), ValueError, "'noop' lets replicas diverge"),
        (dict(zero_stage=2, comm_hook="powersgd"), ValueError, r"'powersgd\(.*\)' has no reduce-"),
        (
            dict(zero_stage=3, comm_hook="quantize_per_tensor"),
            ValueError,
            "'quantize_per_tensor' has no reduce-scatter",
        ),
        (
            dict(zero_stage=1, model_averager=fdp.hooks.PeriodicModelAverager(period=2)),
            ValueError,
            "model_averager",
        ),
    ],
)
def test_a_stage_and_what_cannot_work_with_it_is_refused_when_the_step_is_built(
    kwargs, error, message
):
    with pytest.raises(error, match=message):
        fdp.train_step(lambda p, b: 0.0, **kwargs)


@pytest.mark.parametrize(("saved", "restored"), [(2, 0), (3, 1)])
def test_a_sharded_checkpoint_restores_onto_another_stage_and_fewer_devices(
    saved, restored, tmp_path
):
    data = batches(4)
    loss_fn = cross_entropy(MLP().apply)
    step8 = fdp.train_step(loss_fn, zero_stage=saved)
    uninterrupted, _ = train_on(step8, fdp.replicate(mlp_state(optax.adam(1e-2))), data)

    state, _ = train_on(step8, fdp.replicate(mlp_state(optax.adam(1e-2))), data[:2])
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, state)
        ckpt.wait_until_finished()
    mesh4 = fdp.data_mesh(devices=jax.devices()[:4])
    step4 = fdp.train_step(loss_fn, mesh=mesh4, zero_stage=restored)
    template = step4.init(fdp.replicate(mlp_state(optax.adam(1e-2)), mesh4))
    with fdp.CheckpointManager(tmp_path) as ckpt:
        resumed = ckpt.restore(template).state
    kernel = resumed.opt_state[0].mu["Dense_0"]["kernel"]
    assert len(kernel.sharding.device_set) == 4
    assert kernel.sharding.is_fully_replicated == (restored == 0)
    resumed, _ = train_on(step4, resumed, data[2:], mesh4)
    chex.assert_trees_all_close(
        jax.device_get(resumed.params), jax.device_get(uninterrupted.params), atol=2e-6, rtol=1e-5
    )


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(64, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.norm(self.body(x.reshape(x.shape[0], -1)))))


def nnx_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.parametrize("opt", ["adam", "clip_global_norm_adam"])
def test_nnx_every_stage_ends_where_stage_0_does(opt):
    data = batches()
    results = {}
    for stage in (0, 1, 2, 3):
        model = NNXNet(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, OPTIMIZERS[opt](), wrt=nnx.Param)
        step = fdp.nnx_train_step(nnx_loss, zero_stage=stage)
        for batch in data:
            metrics = step(model, optimizer, fdp.shard_batch(batch))
        results[stage] = jax.device_get(nnx.state(model)), float(metrics["loss"])
        kernel = model.body.kernel[...]
        assert kernel.sharding.is_fully_replicated == (stage < 3)
        mu = optimizer.opt_state
        assert len(jax.tree.leaves(mu)) > 1
    # Sharded sums (the global norm, the reduce-scatter) round differently from whole ones;
    # Adam divides by sqrt(nu), which turns that into up to ~1e-5 on near-zero gradients
    # (0.1% of one step's largest update, lr 1e-2).
    for stage in (1, 2, 3):
        chex.assert_trees_all_close(results[stage][0], results[0][0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(results[stage][1], results[0][1], rtol=1e-6)


def test_nnx_stage_3_holds_a_share_of_the_parameters_and_the_optimizer_state():
    model = NNXNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    full = nbytes(nnx.state(model, nnx.Param)), nbytes(nnx.state(optimizer.opt_state))
    step = fdp.nnx_train_step(nnx_loss, zero_stage=3)
    step(model, optimizer, fdp.shard_batch(batches(1)[0]))
    whole = 10 * 4  # the head's bias
    held = device0_bytes(nnx.state(model, nnx.Param))
    assert held == (full[0] - whole) // N + whole
    assert device0_bytes(nnx.state(optimizer.opt_state)) <= 1.05 * full[1] / N + 3 * whole
    assert "ZeRO stage 3 over 8 device(s)" in fdp.describe(step)
