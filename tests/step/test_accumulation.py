"""Gradient accumulation (DDP's no_sync): one reduction for K micro-batches."""

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import cross_entropy, make_data, make_state, reference_steps
from flax import nnx
from flax.training.train_state import TrainState

import fdp
from fdp import _compat
from fdp.hooks._contract import mean_all_reduce
from fdp.step.grads._local_grads import local_gradients
from fdp.step.options._config import StepConfig

N, K, B = 8, 4, 2  # devices, micro-batches, examples per device per micro-batch


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_accumulated_step_equals_one_step_on_the_whole_batch(opt):
    init = make_state("cnn", opt)
    loss_fn = cross_entropy(init.apply_fn)
    batches = [make_data(s, K * N * B) for s in range(2)]
    want, want_losses = reference_steps(init, batches, loss_fn)
    step = fdp.train_step(loss_fn, accumulate_steps=K)
    state = fdp.replicate(init)
    for batch, want_loss in zip(batches, want_losses, strict=True):
        state, metrics = step(state, fdp.shard_batch(batch))
        np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.opt_state, want.opt_state, rtol=1e-5, atol=1e-6)


def test_on_cpu_every_micro_batch_runs_in_the_one_loop():
    # The last micro-batch is held after the loop where the reductions can overlap its
    # backward pass (accelerators); XLA:CPU overlaps none, so there the hold would only
    # copy the first K-1 micro-batches and compile the body twice.
    init = make_state("mlp", "sgd")
    step = fdp.train_step(cross_entropy(init.apply_fn), accumulation=fdp.Accumulation(steps=K))
    compiled = step.lower(fdp.replicate(init), fdp.shard_batch(make_data(0, K * N * B)))
    trips = re.findall(r'"known_trip_count":\{"n":"(\d+)"', compiled.compile().as_text())
    assert trips == [str(K)]


def test_accumulation_adds_no_all_reduce():
    init = make_state("mlp", "sgd")
    loss_fn = cross_entropy(init.apply_fn)
    counts = {}
    for k in (1, K):
        step = fdp.train_step(loss_fn, accumulate_steps=k)
        lowered = step.lower(fdp.replicate(init), fdp.shard_batch(make_data(0, K * N * B)))
        stablehlo = lowered.as_text()
        counts[k] = fdp.collective_stats(lowered).count("all-reduce")
        assert ("stablehlo.while" in stablehlo) == (k > 1)
        assert not fdp.loop_collectives(lowered).ops  # nothing communicates per micro-batch
        compiled = lowered.compile()
        assert not fdp.loop_collectives(compiled).ops  # and none after XLA's passes
        assert fdp.collective_stats(compiled).nbytes() == step.plan.nbytes + 4
    assert counts[K] == counts[1]
    # The detector does see a collective inside a loop when there is one.
    mesh = fdp.data_mesh()
    per_step = jax.shard_map(
        lambda x: jax.lax.scan(lambda c, y: (c + jax.lax.psum(y, "data"), None), 0.0, x)[0],
        mesh=mesh,
        in_specs=jax.P("data"),
        out_specs=jax.P(),
    )
    lowered = jax.jit(per_step).lower(fdp.shard_batch(jnp.ones((8 * 3,))))
    assert fdp.loop_collectives(lowered).count("all-reduce") == 1


def test_a_one_trip_loop_of_the_last_micro_batch_and_its_reduction_gives_the_same_means():
    # On GPUs the last micro-batch and the bucket reductions run in a loop of one trip
    # (fdp._compat.run_once), where the accumulator is the loop's parameter. Run here
    # on CPU devices against reducing after that micro-batch: the same sums and means.
    # Not bit for bit: XLA compiles the loop's body on its own (up to 3e-7 relative
    # here); a lost micro-batch or a second division would be off by a quarter or more.
    init = make_state("cnn", "sgd")
    loss_fn = cross_entropy(init.apply_fn)
    mesh = fdp.data_mesh()

    def objective(params, micro_batch, carry, rng):
        return loss_fn(params, micro_batch), {}, carry

    def reduced(inside):
        def per_device(params, batch):
            params = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), params)
            treedef = jax.tree.structure(params)
            out = local_gradients(
                objective,
                params,
                batch,
                None,
                axis_name="data",
                accumulate_steps=K,
                last_after_loop=True,
                finish=(lambda sums: mean_all_reduce(sums, "data")) if inside else None,
            )
            if inside:
                return out.grads
            return jax.tree.unflatten(treedef, mean_all_reduce(jax.tree.leaves(out.grads), "data"))

        run = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(jax.P(), jax.P("data")),
            out_specs=jax.P(),
            check_vma=False,
        )
        return jax.jit(run)(fdp.replicate(init).params, fdp.shard_batch(make_data(3, K * N * B)))

    after, inside = reduced(False), reduced(True)
    chex.assert_trees_all_close(inside, after, rtol=2e-6, atol=1e-8)
    assert (
        "skip-simplify-while-loops_trip-count-one"
        in jax.jit(lambda x: _compat.run_once(lambda y: (y * 2, None), x))
        .lower(jnp.ones(3))
        .as_text()
    )


def force_one_trip_loop(monkeypatch):
    """GPU steps' loop of one trip (StepConfig.reduces_with_last_micro_batch), on CPU devices."""
    monkeypatch.setattr(
        StepConfig,
        "reduces_with_last_micro_batch",
        property(lambda self: self.accumulate_steps > 1 and self.zero_stage == 0),
    )


def test_the_step_with_its_one_trip_loop_equals_one_step_on_the_whole_batch(monkeypatch):
    # GPU steps run the last micro-batch and the bucket reductions in a loop of one trip,
    # unchecked by JAX's replication typing. Run that step here, on CPU devices, against
    # one device on the whole batch.
    force_one_trip_loop(monkeypatch)
    init = make_state("cnn", "adam")
    loss_fn = cross_entropy(init.apply_fn)
    batches = [make_data(s, K * N * B) for s in range(2)]
    want, want_losses = reference_steps(init, batches, loss_fn)
    step = fdp.train_step(loss_fn, accumulation=fdp.Accumulation(steps=K))
    state = fdp.replicate(init)
    lowered = step.lower(state, fdp.shard_batch(batches[0]))
    assert step.step_plan.last_in_loop  # the path under test
    assert _compat.XLA_KEEP_ONE_TRIP_LOOP in lowered.as_text()
    assert not fdp.loop_collectives(lowered).ops  # a loop of one trip repeats nothing
    for batch, want_loss in zip(batches, want_losses, strict=True):
        state, metrics = step(state, fdp.shard_batch(batch))
        np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.opt_state, want.opt_state, rtol=1e-5, atol=1e-6)


def per_example_cross_entropy(apply_fn):
    def loss_fn(params, batch):
        logits = apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    return loss_fn


@pytest.mark.parametrize(
    "settings",
    [
        {"reduction": fdp.Reduction(grad_norm=True)},
        {"accumulation": fdp.Accumulation(steps=K, op="sum")},
        {"loss": fdp.Loss(per_example=True)},
        {"loss": fdp.Loss(find_unused_parameters=True)},
    ],
    ids=["grad_norm", "sum", "per_example", "find_unused"],
)
def test_the_one_trip_loop_changes_no_step_result(monkeypatch, settings):
    init = make_state("mlp", "adam")
    per_example = "loss" in settings and settings["loss"].per_example
    loss_of = per_example_cross_entropy if per_example else cross_entropy
    settings = {"accumulation": fdp.Accumulation(steps=K), **settings}
    batches = [fdp.shard_batch(make_data(s, K * N * B)) for s in range(2)]

    def run():  # a new loss function each time: its own plan
        step = fdp.train_step(loss_of(init.apply_fn), **settings)
        state, metrics = fdp.replicate(init), []
        for batch in batches:
            state, m = step(state, batch)
            metrics.append(m)
        return step.step_plan.last_in_loop, state, metrics

    after_loop, want, want_metrics = run()
    force_one_trip_loop(monkeypatch)
    in_loop, got, got_metrics = run()
    assert (after_loop, in_loop) == (False, True)
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got_metrics, want_metrics, rtol=1e-5, atol=1e-6)


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        return nn.Dense(10)(nn.relu(nn.BatchNorm(use_running_average=False)(x)))


def test_the_one_trip_loop_carries_batch_statistics_as_the_step_without_it(monkeypatch):
    variables = BNNet().init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)))
    init = fdp.TrainState.create(
        apply_fn=BNNet().apply,
        params=variables["params"],
        tx=optax.adam(1e-2),
        batch_stats=variables["batch_stats"],
    )
    batches = [fdp.shard_batch(make_data(s, K * N * B)) for s in range(2)]

    def run():
        def loss_fn(params, batch, batch_stats):  # a new function each time: its own plan
            logits, updates = init.apply_fn(
                {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, updates["batch_stats"]

        step = fdp.train_step(loss_fn, accumulation=fdp.Accumulation(steps=K))
        state = fdp.replicate(init)
        for batch in batches:
            state, _ = step(state, batch)
        return step.step_plan.last_in_loop, state

    after_loop, want = run()
    force_one_trip_loop(monkeypatch)
    in_loop, got = run()
    assert (after_loop, in_loop) == (False, True)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), want.batch_stats, init.batch_stats)
    assert min(jax.tree.leaves(moved)) > 1e-3  # the statistics did move
    chex.assert_trees_all_close(got.batch_stats, want.batch_stats, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-5, atol=1e-6)


def test_a_loss_that_communicates_or_the_finite_guard_keeps_the_reduction_after_the_loop(
    monkeypatch,
):
    # Without replication typing the transpose of a psum is a psum, which would change
    # the gradient of a loss that reduces over the data axis itself; and FDP_CHECK_FINITE
    # tests each device's own gradients, before any reduction.
    force_one_trip_loop(monkeypatch)
    init = make_state("mlp", "sgd")
    batch = fdp.shard_batch(make_data(0, K * N * B))
    local = cross_entropy(init.apply_fn)

    def step_plan(loss_fn):
        step = fdp.train_step(loss_fn, accumulation=fdp.Accumulation(steps=K))
        step.lower(fdp.replicate(init), batch)
        return step.step_plan

    assert step_plan(cross_entropy(init.apply_fn)).last_in_loop
    assert not step_plan(lambda p, b: jax.lax.pmean(local(p, b), "data")).last_in_loop
    monkeypatch.setenv("FDP_CHECK_FINITE", "1")
    assert not step_plan(cross_entropy(init.apply_fn)).last_in_loop


def test_bf16_parameters_accumulate_in_float32():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * N, 16)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(16,)) * 0.01, jnp.bfloat16)
    loss_fn = lambda p, b: jnp.mean((b @ p["w"].astype(jnp.float32)) ** 2)  # noqa: E731
    exact = np.asarray(jax.grad(loss_fn)({"w": w.astype(jnp.float32)}, x)["w"])
    errors = {}
    for dtype in (None, jnp.bfloat16):
        state = TrainState.create(apply_fn=None, params={"w": w}, tx=optax.sgd(1.0))
        step = fdp.train_step(loss_fn, accumulate_steps=64, accum_dtype=dtype)
        new, _ = step(fdp.replicate(state), fdp.shard_batch(x))
        assert new.params["w"].dtype == jnp.bfloat16
        update = np.asarray(w, np.float32) - np.asarray(new.params["w"], np.float32)
        errors[dtype] = np.abs(update - exact).max()
    assert errors[None] < errors[jnp.bfloat16]


def test_the_explicit_pair_never_communicates_and_syncs_once():
    init = make_state("mlp", "adam")
    loss_fn = cross_entropy(init.apply_fn)
    micro = [make_data(s, N * B) for s in range(K)]
    full = {k: np.concatenate([m[k] for m in micro]) for k in micro[0]}
    want, want_losses = reference_steps(init, [full], loss_fn)

    acc = fdp.grad_accumulator(loss_fn)
    state = fdp.replicate(init)
    grads = acc.init(state)
    lowered = acc._accumulate.lower(state, grads, fdp.shard_batch(micro[0]), None, None)
    assert not fdp.collective_stats(lowered).ops  # the local step never communicates
    for m in micro:
        grads, local_losses = acc.accumulate(state, grads, fdp.shard_batch(m))
        assert local_losses.shape == (N,)
    state, metrics = acc.sync(state, grads)
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[0], rtol=1e-5)


def test_nnx_accumulation_matches_the_whole_batch():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(64, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x.reshape(x.shape[0], -1))))

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    batch = make_data(0, K * N * B)
    ref = Net(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    ref_opt.update(ref, nnx.grad(loss_fn)(ref, batch))
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    fdp.nnx_train_step(loss_fn, accumulate_steps=K)(model, opt, fdp.shard_batch(batch))
    chex.assert_trees_all_close(
        nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param), rtol=1e-5, atol=1e-6
    )


def test_accumulation_settings_are_checked():
    init = make_state("mlp", "sgd")
    loss_fn = cross_entropy(init.apply_fn)
    with pytest.raises(ValueError, match="Accumulation.steps must be >= 1, got 0"):
        fdp.train_step(loss_fn, accumulation=fdp.Accumulation(steps=0))
    with pytest.raises(ValueError, match="Accumulation.dtype must be a floating dtype"):
        fdp.train_step(loss_fn, accumulation=fdp.Accumulation(steps=2, dtype=jnp.int32))
    step = fdp.train_step(loss_fn, accumulation=fdp.Accumulation(steps=3), donate=False)
    with pytest.raises(
        ValueError,
        match=r"divisible by the 8 devices of axis 'data' times 3 "
        r"micro-batches \(24\)",
    ):
        step(init, make_data(0, 16))
