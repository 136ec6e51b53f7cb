"""fdp.tune and fdp.train_step(bucket_cap_mb="auto"): choosing caps by timing the step.

These tests check what tuning does (candidates, programs, cache, state untouched,
the chosen step's numerics), never which candidate is fastest on this machine.
"""

import logging

import jax
import numpy as np
import pytest
from _models import cross_entropy, make_data, make_state

import fdp
from fdp.step.tune import _tune

pytestmark = pytest.mark.usefixtures("fdp_debug")
FAST = dict(steps=1, rounds=1, warmup=0)


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.setattr(_tune, "_CACHE", {})


def setup():
    state = fdp.replicate(make_state("mlp", "sgd"))
    return state, cross_entropy(state.apply_fn), fdp.shard_batch(make_data(0, 16))


def test_tune_picks_a_candidate_and_leaves_the_state_alone():
    state, loss_fn, batch = setup()
    before = jax.device_get(state.params)
    result = fdp.tune(loss_fn, state, batch, caps=(0.001, 25.0), layouts=("flat",), **FAST)
    chosen = (result.bucket_cap_mb, result.layout)
    assert chosen in {(0.001, "flat"), (25.0, "flat"), (25.0, "auto")}
    # The default is always a candidate, and every timed candidate has a time.
    assert (25.0, "auto") in result.step_s
    assert all(t > 0 for t in result.step_s.values())
    # The caller's arrays were neither donated nor changed.
    assert not any(x.is_deleted() for x in jax.tree.leaves(state.params))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)
    assert fdp.train_step(loss_fn, **result.kwargs()).config.bucket_cap_mb == result.bucket_cap_mb


def test_equal_programs_are_timed_once():
    """A tiny MLP fits one bucket at 25 and at 50 MiB: one program, timed once."""
    state, loss_fn, batch = setup()
    result = fdp.tune(loss_fn, state, batch, caps=(25.0, 50.0), layouts=("flat",), **FAST)
    assert result.same_program[(50.0, "flat")] == (25.0, "flat")
    assert (50.0, "flat") not in result.step_s


def test_a_program_lowered_twice_is_compiled_once():
    """Caps above the model's size lower to the same program: compiled only once."""
    texts, compiled = [], []

    class Lowered:
        def __init__(self, lowered):
            self._lowered = lowered

        def as_text(self):
            texts.append(self._lowered.as_text())
            return texts[-1]

        def compile(self):
            compiled.append(texts[-1])
            return self._lowered.compile()

    def make_step(loss_fn, **kwargs):
        step = fdp.train_step(loss_fn, **kwargs)
        lower = step.lower
        step.lower = lambda *args: Lowered(lower(*args))
        return step

    state, loss_fn, batch = setup()
    fdp.tune(
        loss_fn, state, batch, caps=(25.0, 50.0), layouts=("flat",), make_step=make_step, **FAST
    )
    assert len(texts) == 3  # (25, "auto"), (25, "flat"), (50, "flat")
    assert texts[1] == texts[2] and len(compiled) == len(set(texts)) < 3


def test_results_are_cached_and_logged_at_info(caplog):
    caplog.set_level(logging.INFO, logger="fdp")
    state, loss_fn, batch = setup()
    first = fdp.tune(loss_fn, state, batch, caps=(1.0,), layouts=("auto",), **FAST)
    again = fdp.tune(loss_fn, state, batch, caps=(1.0,), layouts=("auto",), **FAST)
    assert not first.cached and again.cached
    assert again._replace(cached=False) == first
    chose = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fdp.tune: chose")]
    assert len(chose) == 1 and f"bucket_cap_mb={first.bucket_cap_mb:g}" in chose[0]
    # Another batch shape is another signature: tuned again.
    other = fdp.shard_batch(make_data(0, 32))
    assert not fdp.tune(loss_fn, state, other, caps=(1.0,), layouts=("auto",), **FAST).cached
    # Another loss is another program: tuned again, not answered with the first's result.
    another = cross_entropy(state.apply_fn)
    assert not fdp.tune(another, state, batch, caps=(1.0,), layouts=("auto",), **FAST).cached


def test_a_margin_keeps_the_default_unless_beaten_clearly():
    state, loss_fn, batch = setup()
    # No candidate can beat the default by 100%: the default stays.
    result = fdp.tune(loss_fn, state, batch, caps=(0.001,), layouts=("flat",), margin=1.0, **FAST)
    assert (result.bucket_cap_mb, result.layout) == (25.0, "auto")


def test_the_race_between_the_default_and_the_fastest_screened_decides(monkeypatch):
    """Timings are faked: which candidates race, and that the race (not the screening)
    decides, with the margin applied to the race's times."""
    calls, race = [], {}

    def fake_time_rounds(steps_of, states, cands, rounds, steps, args):
        calls.append((list(cands), rounds))
        if len(calls) == 1:  # screening: the others are faster, the last one fastest
            return {c: 1.0 if c == _tune.DEFAULT else 0.9 - 0.1 * i for i, c in enumerate(cands)}
        # the race: the second fastest of the screening (third finalist) wins
        return {c: 1.0 if c == _tune.DEFAULT else race[cands.index(c)] for c in cands}

    monkeypatch.setattr(_tune, "_time_rounds", fake_time_rounds)
    state, loss_fn, batch = setup()
    kwargs = dict(caps=(0.001, 0.01, 25.0), layouts=("flat", "leaves"), race_rounds=5, **FAST)
    for times, keeps_default in (({1: 0.95, 2: 0.9}, False), ({1: 0.995, 2: 0.99}, True)):
        calls.clear()
        race.update(times)
        _tune._CACHE.clear()
        result = fdp.tune(loss_fn, state, batch, finalists=3, margin=0.03, **kwargs)
        (screened, _), (finals, race_rounds) = calls
        assert len(screened) >= 4 and race_rounds == 5
        # The default and the two fastest others of the screening race.
        assert finals == [_tune.DEFAULT, screened[-1], screened[-2]]
        assert set(result.race_s) == set(finals)
        chosen = (result.bucket_cap_mb, result.layout)
        assert chosen == (_tune.DEFAULT if keeps_default else screened[-2])

    # No race with one finalist: the screening decides.
    calls.clear()
    _tune._CACHE.clear()
    result = fdp.tune(loss_fn, state, batch, finalists=1, **kwargs)
    assert len(calls) == 1 and result.race_s == {}
    assert (result.bucket_cap_mb, result.layout) == calls[0][0][-1]


def test_auto_step_tunes_at_its_first_call_and_trains_like_the_chosen_step(monkeypatch):
    monkeypatch.setattr(_tune, "DEFAULT_CAPS", (1.0, 25.0))  # fewer programs to compile
    state, loss_fn, batch = setup()
    step = fdp.train_step(loss_fn, bucket_cap_mb="auto")
    # On main a proxy cast to the class: not an instance, and no config before the first call.
    assert isinstance(step, fdp.DataParallelStep)
    assert step.config.bucket_cap_mb == 25.0 and step.tuned is None  # DDP's default, until tuned
    ref_state = jax.tree.map(lambda x: x.copy(), state)
    new, metrics = step(state, batch)
    assert step.tuned is not None and step.config.bucket_cap_mb == step.tuned.bucket_cap_mb
    ref = fdp.train_step(loss_fn, **step.tuned.kwargs())
    ref_new, ref_metrics = ref(ref_state, batch)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        jax.device_get(new.params),
        jax.device_get(ref_new.params),
    )


def test_bad_settings_are_named():
    state, loss_fn, batch = setup()
    with pytest.raises(ValueError, match="steps >= 1"):
        fdp.tune(loss_fn, state, batch, steps=0)
    with pytest.raises(ValueError, match="at least one candidate"):
        fdp.tune(loss_fn, state, batch, caps=())
    with pytest.raises(ValueError, match="finalists=0"):
        fdp.tune(loss_fn, state, batch, finalists=0)


def _nnx_setup():
    import optax
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    def make():
        model = Net(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)
    batch = fdp.shard_batch(
        {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.integers(0, 4, 16)}
    )
    return make, loss_fn, batch


def test_nnx_auto_step_tunes_on_copies_and_trains_like_the_chosen_step(monkeypatch):
    from flax import nnx

    monkeypatch.setattr(_tune, "DEFAULT_CAPS", (1.0, 25.0))
    make, loss_fn, batch = _nnx_setup()
    model, optimizer = make()
    before = jax.device_get(nnx.state(model, nnx.Param))
    step = fdp.nnx_train_step(loss_fn, bucket_cap_mb="auto")
    # On main a proxy cast to the class: not an instance, and no config before the first call.
    assert isinstance(step, fdp.NNXDataParallelStep)
    assert step.config.bucket_cap_mb == 25.0 and step.tuned is None  # DDP's default, until tuned
    step.lower(model, optimizer, batch)  # tunes on copies: the model is untouched
    assert int(optimizer.step[...]) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(nnx.state(model, nnx.Param)), before)
    assert step.tuned is not None and step.config.bucket_cap_mb == step.tuned.bucket_cap_mb
    assert set(step.tuned.step_s) <= {
        (c, lay) for c in (1.0, 25.0) for lay in _tune.DEFAULT_LAYOUTS
    }
    ref_model, ref_optimizer = make()
    ref = fdp.nnx_train_step(loss_fn, **step.tuned.kwargs())
    for _ in range(2):
        metrics = step(model, optimizer, batch)
        ref_metrics = ref(ref_model, ref_optimizer, batch)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        jax.device_get(nnx.state(model, nnx.Param)),
        jax.device_get(nnx.state(ref_model, nnx.Param)),
    )


def test_nnx_auto_step_checks_its_other_settings_when_built():
    _, loss_fn, _ = _nnx_setup()
    with pytest.raises(ValueError, match="buffers='local'"):
        fdp.nnx_train_step(loss_fn, bucket_cap_mb="auto", buffers="local")


def test_tuning_needs_devices_it_can_run_on():
    """Shapes alone (a step lowered for compile-only GPUs) cannot be timed: said plainly."""
    import jax.numpy as jnp

    state = jax.eval_shape(lambda: make_state("mlp", "sgd"))
    batch = {
        "x": jax.ShapeDtypeStruct((16, 8, 8, 1), jnp.float32),
        "y": jax.ShapeDtypeStruct((16,), jnp.int32),
    }
    with pytest.raises(ValueError, match="times candidate steps by running them"):
        fdp.tune(cross_entropy(state.apply_fn), state, batch)


def test_candidates_of_one_state_shape_share_one_copy(caplog):
    """On main every timed candidate held its own copy of the state until the end."""
    state, loss_fn, batch = setup()
    with caplog.at_level(logging.DEBUG, logger="fdp"):
        result = fdp.tune(
            loss_fn, state, batch, caps=(0.001, 25.0), layouts=("flat", "leaves"), **FAST
        )
    assert len(result.step_s) >= 2  # several programs timed ...
    copies = [r.getMessage() for r in caplog.records if "state copies" in r.getMessage()]
    assert copies == [f"fdp.tune: 1 state copies for {len(result.step_s)} timed programs"]


def test_a_hook_that_keeps_state_is_refused_with_the_fix_named():
    # Its state is shaped by the buckets, which tuning picks per run: once, init made it
    # for the default cap and a tuned call failed ("add got incompatible shapes"), and a
    # checkpoint's hook state would not fit a resumed run that tuned another cap.
    import optax

    base = make_state("mlp", "sgd")
    state = fdp.TrainState.create(apply_fn=base.apply_fn, params=base.params, tx=optax.sgd(0.1))
    state, loss_fn, batch = fdp.replicate(state), cross_entropy(base.apply_fn), setup()[2]
    hook = fdp.hooks.powersgd(matrix_approximation_rank=1)
    auto = fdp.Reduction(bucket_cap_mb="auto", comm_hook=hook)
    fix = r"bucket_cap_mb='auto' with comm hook 'powersgd.*fdp\.tune"
    step = fdp.train_step(loss_fn, reduction=auto)
    for call in (
        lambda: step.init(state),
        lambda: step(state, batch),
        lambda: step.lower(state, batch),
    ):
        with pytest.raises(ValueError, match=fix):
            call()
    assert step.tuned is None  # refused before any timing

    make, nnx_loss, nnx_batch = _nnx_setup()
    model, optimizer = make()
    nnx_step = fdp.nnx_train_step(nnx_loss, reduction=auto)
    for call in (
        lambda: nnx_step.init(model, optimizer),
        lambda: nnx_step(model, optimizer, nnx_batch),
        lambda: nnx_step.lower(model, optimizer, nnx_batch),
    ):
        with pytest.raises(ValueError, match=fix):
            call()
    assert not hasattr(optimizer, "fdp_comm_state")
    # A hook without state tunes as before.
    fdp.train_step(
        loss_fn, reduction=fdp.Reduction(bucket_cap_mb="auto", comm_hook="bf16_compress")
    )
