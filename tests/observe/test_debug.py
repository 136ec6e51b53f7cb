"""Debug levels: FDP_DEBUG and set_debug_level, the INFO log of a known model, and quiet OFF."""

import logging

import jax.numpy as jnp
import optax
import pytest
from _models import cross_entropy, make_data, make_state
from flax import nnx

import fdp
from fdp.observe import _debug

# The tests' MLP on 8x8x1 inputs: Dense 64->32, 32->16, 16->10, float32.
MLP_LEAVES = 6
MLP_BYTES = 4 * (64 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10)


pytestmark = pytest.mark.usefixtures("fdp_debug")


def fdp_records(caplog):
    return [r for r in caplog.records if r.name == "fdp"]


def run_mlp(steps=2, **kwargs):
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn), **kwargs)
    batch = fdp.shard_batch(make_data(0, 16))
    for _ in range(steps):
        state, _ = step(state, batch)
    return step


def test_levels_from_the_environment_and_from_set_debug_level(monkeypatch):
    assert fdp.debug_level() is fdp.DebugLevel.OFF
    monkeypatch.setenv("FDP_DEBUG", "detail")
    assert fdp.debug_level() is fdp.DebugLevel.DETAIL  # read when asked, not only at import
    fdp.set_debug_level("INFO")
    assert fdp.debug_level() is fdp.DebugLevel.INFO  # the function wins over the variable
    fdp.set_debug_level(None)
    assert fdp.debug_level() is fdp.DebugLevel.DETAIL
    monkeypatch.setenv("FDP_DEBUG", "verbose")
    with pytest.raises(ValueError, match=r"FDP_DEBUG must be one of OFF, INFO, DETAIL.*'verbose'"):
        fdp.debug_level()
    with pytest.raises(ValueError, match=r"level must be one of OFF, INFO, DETAIL.*3"):
        fdp.set_debug_level(3)


def test_info_logs_the_settings_of_a_known_model_once(caplog):
    caplog.set_level(logging.DEBUG, logger="fdp")
    fdp.set_debug_level("INFO")
    step = run_mlp(steps=3, bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005, accumulate_steps=2)
    settings = [r.getMessage() for r in fdp_records(caplog) if "before its first step" in r.message]
    assert len(settings) == 1  # once per step function, not per call
    lines = dict(line.strip().split(": ", 1) for line in settings[0].splitlines()[1:])
    plan = step.plan
    expected = {
        "process_index": "0",
        "process_count": "1",
        "platform": "cpu",
        "device_count": "8",
        "mesh": "{'data': 8}",
        "num_parameter_leaves": str(MLP_LEAVES),
        "total_parameter_size_bytes": str(MLP_BYTES),
        "dtypes": "{'float32': 6}",
        "bucket_cap_mb": "0.002",
        "first_bucket_cap_mb": "0.0005",
        "bucket_cap_bytes": str(int(0.002 * 2**20)),
        "first_bucket_cap_bytes": str(int(0.0005 * 2**20)),
        "num_buckets": str(len(plan.buckets)),
        "bucket_sizes": str([b.nbytes for b in plan.buckets]),
        "comm_hook": "allreduce",
        "accumulate_steps": "2",
        "find_unused_parameters": "False",
        "unused_parameters": "[]",
        "buffers": "broadcast",
    }
    assert {k: lines.get(k) for k in expected} == expected
    assert len(plan.buckets) == 3 and sum(b.nbytes for b in plan.buckets) == MLP_BYTES
    assert step.logging_data()["bucket_sizes"] == [b.nbytes for b in plan.buckets]


def test_info_names_unused_parameters_and_the_hook():
    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"]) ** 2)

    params = {"w": jnp.ones((4, 2)), "spare": jnp.ones((3,))}
    state = fdp.replicate(fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)))
    fdp.set_debug_level("INFO")
    step = fdp.train_step(loss_fn, comm_hook="bf16_compress", find_unused_parameters=True)
    step(state, fdp.shard_batch({"x": jnp.ones((8, 4))}))
    data = step.logging_data()
    assert data["unused_parameters"] == ["['spare']"]
    assert data["unused_parameter_size"] == 12
    assert data["comm_hook"] == "bf16_compress"
    assert data["total_parameter_size_bytes"] == 4 * (8 + 3)


def test_nnx_step_logs_too(caplog):
    caplog.set_level(logging.INFO, logger="fdp")
    fdp.set_debug_level("INFO")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2))
    step(model, optimizer, fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones(8)}))
    (message,) = [r.message for r in fdp_records(caplog) if "before its first step" in r.message]
    assert message.startswith("fdp.nnx_train_step (process 0 of 1)")
    assert "  total_parameter_size_bytes: 12" in message.splitlines()


def test_off_is_quiet(caplog):
    caplog.set_level(logging.DEBUG)
    step = run_mlp(steps=3)
    assert fdp_records(caplog) == []
    assert step.stats() == {"enabled": False}
    assert step.logging_data()["num_parameter_leaves"] == MLP_LEAVES  # on request, still there


def test_a_program_that_configured_no_logging_sees_info_on_stderr(monkeypatch, capsys):
    # Libraries (orbax) give the root logger a handler at import; a bare program has none.
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    fdp.set_debug_level("INFO")
    run_mlp(steps=1)
    err = capsys.readouterr().err
    assert "fdp INFO: fdp.train_step (process 0 of 1), before its first step:" in err
    fdp.set_debug_level("OFF")  # and back off, the handler goes
    assert not any(isinstance(h, _debug._StderrHandler) for h in logging.getLogger("fdp").handlers)


def test_the_level_is_read_at_the_first_call(caplog):
    caplog.set_level(logging.INFO, logger="fdp")
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn))
    fdp.set_debug_level("INFO")  # after construction, before the first call: applies
    step(state, fdp.shard_batch(make_data(0, 16)))
    assert any("before its first step" in r.message for r in fdp_records(caplog))


def test_a_first_call_that_fails_leaves_the_next_call_a_first_call(caplog):
    caplog.set_level(logging.INFO, logger="fdp")
    fdp.set_debug_level("INFO")
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn), donate=False)
    with pytest.raises(ValueError, match="must be divisible by the 8 devices"):
        step(state, make_data(0, 12))
    state, _ = step(state, fdp.shard_batch(make_data(0, 16)))
    assert step.stats()["steps"] == 1
    assert sum("before its first step" in r.message for r in fdp_records(caplog)) == 1


def test_a_level_the_user_gave_the_fdp_logger_is_kept(caplog):
    caplog.set_level(logging.DEBUG)
    fdp.set_debug_level("DETAIL")
    logging.getLogger("fdp").setLevel(logging.WARNING)  # the user silences fdp
    run_mlp(steps=2)
    assert fdp_records(caplog) == []
    assert logging.getLogger("fdp").level == logging.WARNING
