"""HierarchicalModelAverager against a transcription of torch's schedule and numpy means."""

import jax
import numpy as np
import pytest
from _hook_harness import N
from _models import cross_entropy, make_data, make_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp
from fdp import hooks
from fdp.step.options._config import StepConfig


def torch_group_size(levels, warmup_steps, step):
    """torch's average_parameters + _find_process_group, transcribed."""
    if step >= warmup_steps:
        for period in reversed(list(levels)):
            if step % period == 0:
                return levels[period]
    return None


def group_means(x, size):
    return np.repeat(x.reshape(N // size, size, *x.shape[1:]).mean(1), size, axis=0)


def test_schedule_is_torchs_largest_dividing_period():
    levels = {2: 2, 3: 4, 6: 8}
    avg = hooks.HierarchicalModelAverager(levels, warmup_steps=3)
    got = [avg.group_size_at(t) for t in range(13)]
    assert got == [torch_group_size(levels, 3, t) for t in range(13)]
    assert got == [None, None, None, 4, 2, None, 8, None, 2, 4, 2, None, 8]


def test_average_within_the_due_groups():
    mesh = fdp.data_mesh()
    levels = {2: 2, 3: 4, 6: 8}
    avg = hooks.HierarchicalModelAverager(levels, warmup_steps=1)
    params = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)

    def body(p, t):
        return avg.average(p, t[0], "data")

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False
        )
    )
    x = jax.device_put(params, NamedSharding(mesh, P("data")))
    for t in range(13):
        size = torch_group_size(levels, 1, t)
        want = params if size is None else group_means(params, size)
        np.testing.assert_allclose(np.asarray(f(x, np.array([t]))), want, rtol=1e-6, err_msg=t)


def test_with_post_local_sgd_in_the_train_step():
    init = make_state("mlp", "sgd")
    state = fdp.TrainState.create(apply_fn=init.apply_fn, params=init.params, tx=init.tx)
    levels = {2: 4, 4: 8}
    step = fdp.train_step(
        cross_entropy(init.apply_fn),
        comm_hook=hooks.post_local_sgd(2, subgroup_size=2),
        model_averager=hooks.HierarchicalModelAverager(levels, warmup_steps=2),
    )
    state = fdp.replicate(state)
    for t in range(9):
        state, _ = step(state, fdp.shard_batch(make_data(t, 16)))
        kernel = np.asarray(state.params["Dense_0"]["kernel"])
        # After warm-up each step's gradients are averaged within pairs, and the
        # averager then makes groups of the due size agree.
        size = 8 if t < 2 else torch_group_size(levels, 2, t) or 2
        for start in range(0, N, size):
            for d in range(start, start + size):
                np.testing.assert_array_equal(kernel[d], kernel[start], err_msg=f"{t} {d}")
        if size < N:
            assert not np.array_equal(kernel[0], kernel[size]), t
    assert state.step.tolist() == [9] * N


@pytest.mark.parametrize(
    ("levels", "match"),
    [
        ({}, "must be a non-empty dict"),
        ({0: 8}, "positive integer periods"),
        ({2: 0}, "positive integer group sizes"),
        ({4: 4, 2: 8}, r"periods must increase .* got \[4, 2\]"),
    ],
)
def test_invalid_dicts_are_rejected(levels, match):
    with pytest.raises(ValueError, match=match):
        hooks.HierarchicalModelAverager(levels)


def test_negative_warmup_and_period_one():
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        hooks.HierarchicalModelAverager({2: 8}, warmup_steps=-1)
    with pytest.warns(UserWarning, match="largest period of 1"):
        hooks.HierarchicalModelAverager({1: 8})


@pytest.mark.parametrize(
    ("levels", "match"),
    [
        ({2: 4, 4: 4}, r"last group size in period_group_size_dict \(4\) must be the 8 devices"),
        ({2: 3, 4: 8}, "Group size 3 in period_group_size_dict must divide the 8 devices"),
    ],
)
def test_group_sizes_must_fit_the_axis(levels, match):
    init = make_state("mlp", "sgd")
    state = fdp.TrainState.create(apply_fn=init.apply_fn, params=init.params, tx=init.tx)
    step = fdp.train_step(
        cross_entropy(init.apply_fn),
        comm_hook=hooks.post_local_sgd(0, subgroup_size=2),
        model_averager=hooks.HierarchicalModelAverager(levels),
    )
    with pytest.raises(ValueError, match=match):
        step(fdp.replicate(state), fdp.shard_batch(make_data(0, 16)))


def hooks_policy(averager):
    return fdp.Reduction(comm_hook="noop", model_averager=averager)


def test_step_config_accepts_both_averagers_only():
    for avg in (hooks.PeriodicModelAverager(2), hooks.HierarchicalModelAverager({2: 8})):
        cfg = StepConfig(reduction=hooks_policy(avg))
        assert hash(cfg) == hash(StepConfig(reduction=hooks_policy(avg)))
    with pytest.raises(
        TypeError,
        match="PeriodicModelAverager, fdp.hooks.HierarchicalModelAverager or fdp.hooks.diloco",
    ):
        fdp.Reduction(model_averager=object())  # type: ignore[arg-type]
