"""Post-local SGD: subgroup averaging, and the periodic model averager."""

import jax
import numpy as np
import pytest
from _hook_harness import N, make_grads, run_hook
from _models import cross_entropy, make_data, make_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp
from fdp import hooks


def test_hook_averages_globally_then_within_subgroups():
    shapes = {"w": (6, 5), "b": (5,)}
    steps = [make_grads(s, shapes) for s in range(3)]
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), steps[0])
    hook = hooks.post_local_sgd(1, subgroup_size=2)
    outs, states = run_hook(hook, steps, fdp.plan_buckets(local))
    for name in shapes:
        np.testing.assert_allclose(
            outs[0][name], np.broadcast_to(steps[0][name].mean(0), outs[0][name].shape), rtol=1e-6
        )
        for t in (1, 2):
            pairs = steps[t][name].reshape(N // 2, 2, *shapes[name]).mean(1)
            np.testing.assert_allclose(outs[t][name], np.repeat(pairs, 2, axis=0), rtol=1e-6)
    assert (states[2]["iter"] == 3).all()

    off = hooks.post_local_sgd(0, subgroup_size=2, post_local_gradient_allreduce=False)
    (out,), _ = run_hook(off, steps[:1], fdp.plan_buckets(local))
    np.testing.assert_array_equal(out["w"], steps[0]["w"])


def test_parameters_differ_across_subgroups_between_averaging_steps():
    init = make_state("mlp", "sgd")
    state = fdp.TrainState.create(apply_fn=init.apply_fn, params=init.params, tx=init.tx)
    step = fdp.train_step(
        cross_entropy(init.apply_fn),
        comm_hook=hooks.post_local_sgd(2, subgroup_size=4),
        model_averager=hooks.PeriodicModelAverager(period=3, warmup_steps=2),
    )
    state = fdp.replicate(state)
    for t in range(7):
        state, _ = step(state, fdp.shard_batch(make_data(t, 16)))
        kernel = np.asarray(state.params["Dense_0"]["kernel"])
        assert kernel.shape[0] == N  # one copy per device
        for group in (range(0, 4), range(4, 8)):  # a subgroup always agrees
            for d in group:
                np.testing.assert_array_equal(kernel[d], kernel[group[0]])
        identical = t < 2 or (t - 2) % 3 == 0  # global phase, or an averaging step
        assert np.array_equal(kernel[0], kernel[4]) == identical, t
    assert state.step.tolist() == [7] * N


def test_model_averager_averages_exactly_when_due():
    mesh = fdp.data_mesh()
    averager = hooks.PeriodicModelAverager(period=2, warmup_steps=1)
    params = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)

    def body(p, t):
        return averager.average(p, t[0], "data")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
    x = jax.device_put(params, NamedSharding(mesh, P("data")))
    for t, due in [(0, False), (1, True), (2, False), (3, True)]:
        out = np.asarray(f(x, np.array([t])))
        want = np.broadcast_to(params.mean(0), params.shape) if due else params
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_period_one_warns():
    with pytest.warns(UserWarning, match="period=1"):
        hooks.PeriodicModelAverager(period=1)


def test_subgroup_size_must_divide_the_axis():
    init = make_state("mlp", "sgd")
    state = fdp.TrainState.create(apply_fn=init.apply_fn, params=init.params, tx=init.tx)
    step = fdp.train_step(
        cross_entropy(init.apply_fn), comm_hook=hooks.post_local_sgd(0, subgroup_size=3)
    )
    with pytest.raises(ValueError, match="subgroup_size=3 must divide the 8 devices"):
        step(fdp.replicate(state), fdp.shard_batch(make_data(0, 16)))
