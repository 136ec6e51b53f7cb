"""The step's policies: each checks its own fields; the flat 0.1 keywords map onto them."""

import dataclasses
import re
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fdp
from fdp.step.options._policies import with_candidate as candidate


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def state_and_batch():
    state = fdp.TrainState.create(
        apply_fn=None, params={"w": jnp.arange(4.0).reshape(2, 2)}, tx=optax.adam(0.1)
    )
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(16, 2)).astype(np.float32),
        "y": rng.normal(size=(16, 2)).astype(np.float32),
    }
    return fdp.replicate(state), fdp.shard_batch(batch)


# -- each policy checks its own fields, naming the field, what it expected and what it got


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: fdp.Reduction(bucket_cap_mb=0), ValueError, r"bucket_cap_mb must be a positive"),
        (lambda: fdp.Reduction(bucket_cap_mb="big"), TypeError, r"bucket_cap_mb"),
        (lambda: fdp.Reduction(first_bucket_cap_mb=-1), ValueError, r"first_bucket_cap_mb must"),
        (
            lambda: fdp.Reduction(layout="packed"),
            ValueError,
            r"layout must be one of \('auto', 'leaves', 'flat'\), got 'packed'",
        ),
        (lambda: fdp.Reduction(comm_hook="bf16"), ValueError, r"comm_hook='bf16' is not a known"),
        (lambda: fdp.Reduction(hierarchical=1), TypeError, r"hierarchical must be True or False"),
        (
            lambda: fdp.Reduction(reduce_dtype=jnp.int32),
            ValueError,
            r"reduce_dtype must be a floating dtype \(e.g. jnp.float32\), got",
        ),
        (
            lambda: fdp.Reduction(reduce_dtype=jnp.float32, comm_hook="bf16_compress"),
            ValueError,
            r"reduce_dtype='float32' sets the dtype of the default .* got comm_hook='bf16_",
        ),
        (lambda: fdp.Reduction(model_averager=3), TypeError, r"model_averager must be a fdp"),
        (lambda: fdp.Accumulation(steps=0), ValueError, r"Accumulation.steps must be >= 1, got 0"),
        (lambda: fdp.Accumulation(steps=True), TypeError, r"Accumulation.steps must be an int"),
        (lambda: fdp.Accumulation(dtype="int8"), ValueError, r"Accumulation.dtype must be a float"),
        (
            lambda: fdp.Accumulation(op="max"),
            ValueError,
            r"Accumulation.op must be one of \('mean', 'sum'\), got 'max'",
        ),
        (lambda: fdp.Loss(has_aux="yes"), TypeError, r"has_aux must be True or False, got 'yes'"),
        (lambda: fdp.Loss(weighting="batch"), ValueError, r"weighting must be one of .*'batch'"),
        (lambda: fdp.Loss(weighting="device"), ValueError, r"'device' .* needs per_example=True"),
        (lambda: fdp.Loss(gather_aux="logits"), TypeError, r"gather_aux must be True, False or"),
        (
            lambda: fdp.Loss(find_unused_parameters=None),
            TypeError,
            r"find_unused_parameters must be True or False, got None",
        ),
        (lambda: fdp.Sharding(zero_stage=4), ValueError, r"zero_stage must be one of .*got 4"),
        (lambda: fdp.Sharding(zero_stage=1.0), TypeError, r"zero_stage must be an int"),
    ],
)
def test_each_policy_checks_its_fields(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_policies_are_frozen_hashable_values():
    a = fdp.Reduction(bucket_cap_mb=np.float32(5), comm_hook="allreduce")
    b = fdp.Reduction(bucket_cap_mb=5.0, comm_hook=a.comm_hook)
    assert a == b and hash(a) == hash(b) and type(a.bucket_cap_mb) is float
    assert fdp.Accumulation(dtype="bfloat16") == fdp.Accumulation(dtype=jnp.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.layout = "flat"  # type: ignore[misc]
    with pytest.raises(TypeError):
        fdp.Sharding(1)  # type: ignore[misc]  # keyword-only


def test_rules_between_policies_are_the_configs():
    with pytest.raises(ValueError, match=r"zero_stage >= 2 leave reduce_dtype unset"):
        fdp.train_step(
            loss_fn,
            reduction=fdp.Reduction(reduce_dtype=jnp.float32),
            sharding=fdp.Sharding(zero_stage=2),
        )
    with pytest.raises(ValueError, match=r"comm hook 'noop' lets replicas diverge.*zero_stage=1"):
        fdp.train_step(
            loss_fn, reduction=fdp.Reduction(comm_hook="noop"), sharding=fdp.Sharding(zero_stage=1)
        )


def test_a_policy_of_the_wrong_type_is_named():
    with pytest.raises(TypeError, match=r"fdp.train_step: reduction= must be a fdp.Reduction, got"):
        fdp.train_step(loss_fn, reduction=fdp.Sharding(zero_stage=1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"loss= must be a fdp.Loss, got dict"):
        fdp.nnx_train_step(loss_fn, loss={"has_aux": True})  # type: ignore[arg-type]


def program(text):
    """Compiled HLO without source locations (the two steps are built on two lines)."""
    text = re.sub(r",? metadata=\{[^}]*\}", "", text)
    # The tables of files, functions, locations and stack frames, before the computations.
    return re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "\n", text)


# -- the flat keywords of fdp 0.1: one shim, a warning naming the new spelling


def old_and_new(builder, old, new):
    """The configs ``builder`` makes from the flat keywords and from the policies."""
    with pytest.warns(DeprecationWarning):
        from_old = builder(loss_fn, **old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns about nothing
        from_new = builder(loss_fn, **new)
    return from_old, from_new


bf16 = fdp.hooks.bf16_compress()
CASES = {
    "zero": (
        {"zero_stage": 2, "bucket_cap_mb": 0.001},
        {"sharding": fdp.Sharding(zero_stage=2), "reduction": fdp.Reduction(bucket_cap_mb=0.001)},
    ),
    "hook": (
        {"comm_hook": bf16, "layout": "flat", "first_bucket_cap_mb": 0.0005},
        {"reduction": fdp.Reduction(comm_hook=bf16, layout="flat", first_bucket_cap_mb=0.0005)},
    ),
    "accumulation": (
        {"accumulate_steps": 2, "accumulate_op": "sum", "accum_dtype": "float32", "has_aux": False},
        {
            "accumulation": fdp.Accumulation(steps=2, op="sum", dtype=jnp.float32),
            "loss": fdp.Loss(has_aux=False),
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flat_keywords_make_the_same_step_as_the_policies(case):
    old, new = CASES[case]
    from_old, from_new = old_and_new(fdp.train_step, old, new)
    assert from_old.config == from_new.config
    state, batch = state_and_batch()
    text_old = program(from_old.lower(state, batch).compile().as_text())
    text_new = program(from_new.lower(state, batch).compile().as_text())
    assert "ENTRY" in text_old and re.search(r"all-reduce|reduce-scatter", text_old)
    assert text_old == text_new


def test_nnx_and_the_accumulator_take_the_flat_keywords_too():
    old = {"accumulate_steps": 2, "comm_hook": bf16, "per_example": True, "weighting": "device"}
    new = {
        "accumulation": fdp.Accumulation(steps=2),
        "reduction": fdp.Reduction(comm_hook=bf16),
        "loss": fdp.Loss(per_example=True, weighting="device"),
    }
    from_old, from_new = old_and_new(fdp.nnx_train_step, old, new)
    assert from_old.config == from_new.config
    old = {"bucket_cap_mb": 2.0, "accumulate_op": "sum"}
    new = {
        "reduction": fdp.Reduction(bucket_cap_mb=2.0),
        "accumulation": fdp.Accumulation(op="sum"),
    }
    from_old, from_new = old_and_new(fdp.grad_accumulator, old, new)
    assert from_old._config == from_new._config


def test_the_warning_names_the_new_spelling():
    with pytest.warns(DeprecationWarning) as caught:
        fdp.train_step(loss_fn, bucket_cap_mb=5.0, accumulate_steps=2, zero_stage=1)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("fdp.train_step: ")
    for advice in (
        "bucket_cap_mb= is deprecated; use reduction=fdp.Reduction(bucket_cap_mb=...)",
        "accumulate_steps= is deprecated; use accumulation=fdp.Accumulation(steps=...)",
        "zero_stage= is deprecated; use sharding=fdp.Sharding(zero_stage=...)",
    ):
        assert advice in message
    assert caught[0].filename == __file__  # points at the caller's line


def test_a_flat_keyword_next_to_its_policy_is_an_error():
    with pytest.raises(
        TypeError,
        match=r"fdp.train_step: got both reduction= and bucket_cap_mb=, which is a field of it; "
        r"pass reduction=fdp.Reduction\(\.\.\., bucket_cap_mb=5.0\) alone",
    ):
        fdp.train_step(loss_fn, reduction=fdp.Reduction(layout="flat"), bucket_cap_mb=5.0)
    with pytest.raises(TypeError, match=r"got both accumulation= and accumulate_steps="):
        fdp.nnx_train_step(loss_fn, accumulation=fdp.Accumulation(), accumulate_steps=2)


def test_flat_keywords_of_other_policies_still_combine():
    with pytest.warns(DeprecationWarning, match="zero_stage= is deprecated"):
        step = fdp.train_step(loss_fn, reduction=fdp.Reduction(bucket_cap_mb=2.0), zero_stage=1)
    assert step.config.zero_stage == 1 and step.config.bucket_cap_mb == 2.0


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match=r"fdp.train_step\(\) got an unexpected keyword .*'cap'"):
        fdp.train_step(loss_fn, cap=2.0)
    with pytest.raises(TypeError, match=r"fdp.grad_accumulator\(\) got an unexpected .*zero_stage"):
        fdp.grad_accumulator(loss_fn, zero_stage=1)  # grad_accumulator takes no sharding


# -- what a front end does not apply is refused, not ignored


def test_the_accumulator_refuses_what_it_does_not_apply():
    with pytest.raises(ValueError, match=r"does not apply Accumulation.steps \(got 4\)"):
        fdp.grad_accumulator(loss_fn, accumulation=fdp.Accumulation(steps=4))
    with pytest.raises(ValueError, match=r"does not apply Loss.has_aux \(got True\)"):
        fdp.grad_accumulator(loss_fn, loss=fdp.Loss(has_aux=True))


def test_nnx_refuses_a_model_averager():
    averager = fdp.hooks.PeriodicModelAverager(period=2)
    with pytest.raises(ValueError, match=r"model_averager=PeriodicModelAverager .* one model per"):
        fdp.nnx_train_step(loss_fn, reduction=fdp.Reduction(model_averager=averager))


def test_the_tuner_varies_the_cap_and_layout_of_the_given_reduction():
    mine = fdp.Reduction(comm_hook=bf16, bucket_cap_mb="auto")
    kwargs = candidate({"reduction": mine, "donate": False}, 2.5, "flat")
    assert kwargs["reduction"] == fdp.Reduction(comm_hook=bf16, bucket_cap_mb=2.5, layout="flat")
    assert kwargs["donate"] is False
    flat = candidate({"comm_hook": bf16}, 2.5, "flat")  # 0.1's spelling stays flat
    assert flat == {"comm_hook": bf16, "bucket_cap_mb": 2.5, "layout": "flat"}
    result = fdp.TuneResult(2.5, "flat", {}, {}, {})
    assert result.kwargs() == {"reduction": fdp.Reduction(bucket_cap_mb=2.5, layout="flat")}
    assert result.reduction(mine) == kwargs["reduction"]


def test_auto_checks_the_other_settings_when_built():
    with pytest.raises(ValueError, match=r"comm hook 'noop' lets replicas diverge"):
        fdp.train_step(
            loss_fn,
            reduction=fdp.Reduction(bucket_cap_mb="auto", comm_hook="noop"),
            sharding=fdp.Sharding(zero_stage=1),
        )
    assert fdp.Reduction(bucket_cap_mb="auto").auto and not fdp.Reduction().auto
