"""Runtime statistics: the sampling schedule, step times, examples/s and bytes per step."""

import logging

import jax
import pytest
from _models import cross_entropy, make_data, make_state

import fdp
from fdp.observe import _stats

pytestmark = pytest.mark.usefixtures("fdp_debug")


def test_schedule_is_the_first_steps_then_every_nth():
    schedule = fdp.StatsSchedule()
    assert [n for n in range(1, 1001) if schedule.sampled(n)] == [
        *range(1, 11),
        *range(100, 1001, 100),
    ]
    with pytest.raises(ValueError, match=r"StatsSchedule.every must be an int >= 1, got 0"):
        fdp.train_step(lambda p, b: 0.0, stats=fdp.StatsSchedule(every=0))
    with pytest.raises(ValueError, match=r"tokens_per_example must be None or an int >= 1.*got 0"):
        fdp.train_step(lambda p, b: 0.0, stats=fdp.StatsSchedule(tokens_per_example=0))
    with pytest.raises(TypeError, match="stats must be a bool or a fdp.StatsSchedule, got 5"):
        fdp.train_step(lambda p, b: 0.0, stats=5)


def test_sampled_steps_block_and_unsampled_ones_do_not(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="fdp")
    waits = []
    block = jax.block_until_ready
    monkeypatch.setattr(_stats.jax, "block_until_ready", lambda x: (waits.append(1), block(x))[1])
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(
        cross_entropy(state.apply_fn),
        bucket_cap_mb=0.005,
        first_bucket_cap_mb=0.001,
        stats=fdp.StatsSchedule(first=3, every=4),
    )
    batch = fdp.shard_batch(make_data(0, 16))
    for _ in range(9):
        state, _ = step(state, batch)
    # Steps 1, 2, 3, 4 and 8 are timed: each waits for its inputs and its outputs.
    assert len(waits) == 2 * 5
    stats = step.stats()
    assert stats["enabled"] and stats["steps"] == 9
    assert stats["compiled_steps"] == [1]  # step 1 compiled; it is not averaged
    assert stats["sampled_steps"] == 4  # steps 2, 3, 4, 8
    assert stats["first_step_seconds"] > 0
    assert stats["examples_per_step"] == 16
    assert stats["last_examples_per_second"] == pytest.approx(16 / stats["last_step_seconds"])
    assert stats["avg_examples_per_second"] == pytest.approx(16 / stats["avg_step_seconds"])
    # Bytes all-reduced per step: every gradient bucket, and the loss (one float32).
    assert stats["allreduce_bytes_per_step"] == step.plan.nbytes + 4
    assert stats["allreduce_count_per_step"] == fdp.collective_stats(
        step.lower(state, batch)
    ).count("all-reduce")
    assert stats["sent_bytes_per_step"] == pytest.approx(2 * 7 / 8 * (step.plan.nbytes + 4))
    # stats=... at OFF samples without logging anything.
    assert [r for r in caplog.records if r.name == "fdp"] == []


def test_a_step_that_compiles_again_is_not_averaged():
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn), stats=True)
    for size in (16, 16, 32, 32):  # a new batch size compiles the step again
        state, _ = step(state, fdp.shard_batch(make_data(0, size)))
    stats = step.stats()
    assert stats["compiled_steps"] == [1, 3]
    assert stats["sampled_steps"] == 2 and stats["examples_per_step"] == 32


def test_info_samples_and_logs_the_sampled_steps(caplog):
    caplog.set_level(logging.INFO, logger="fdp")
    fdp.set_debug_level("INFO")
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn))
    batch = fdp.shard_batch(make_data(0, 16))
    for _ in range(12):
        state, _ = step(state, batch)
    logged = [r.message for r in caplog.records if r.name == "fdp" and ": step " in r.message]
    assert len(logged) == 10  # steps 1 to 10; 11 and 12 are not sampled
    assert logged[0].startswith("fdp.train_step: step 1 compiled the step: ")
    assert logged[-1].startswith("fdp.train_step: step 10: ")
    assert f"all-reduced {step.plan.nbytes + 4} bytes per device per step" in logged[-1]
    assert step.stats()["steps"] == 12 and step.stats()["sampled_steps"] == 9


def test_tokens_per_second_when_the_schedule_knows_the_tokens_of_an_example(caplog):
    caplog.set_level(logging.INFO, logger="fdp")
    fdp.set_debug_level("INFO")
    state = fdp.replicate(make_state("mlp", "sgd"))
    schedule = fdp.StatsSchedule(first=3, every=100, tokens_per_example=64)
    step = fdp.train_step(cross_entropy(state.apply_fn), stats=schedule)
    batch = fdp.shard_batch(make_data(0, 16))
    for _ in range(3):
        state, _ = step(state, batch)
    stats = step.stats()
    assert stats["schedule"]["tokens_per_example"] == 64
    assert stats["tokens_per_step"] == 16 * 64
    assert stats["last_tokens_per_second"] == pytest.approx(16 * 64 / stats["last_step_seconds"])
    assert stats["avg_tokens_per_second"] == pytest.approx(16 * 64 / stats["avg_step_seconds"])
    logged = [r.message for r in caplog.records if r.name == "fdp" and ": step 3: " in r.message]
    tokens = stats["last_tokens_per_second"]
    assert f"examples/s ({tokens:.4g} tokens/s); average over" in logged[0]
    # Without tokens_per_example, examples/s only.
    plain = _stats.RuntimeStats(_stats.StatsSchedule()).as_dict()
    assert plain["tokens_per_step"] is plain["last_tokens_per_second"] is None


# Lines as jaxlib 0.10.2 writes fdp's shared-memory sum of a 2-array bucket (shortened).
_SHM_HLO = (
    "  %custom-call.3 = (f32[33]{0}, f32[64,33]{1,0}) custom-call(f32[1]{0} %t, f32[33]{0} %b, "
    'f32[64,33]{1,0} %w), custom_call_target="fdp_shm_sum", custom_call_has_side_effect=true'
)
_SHM_STABLEHLO = (
    "    %132:2 = stablehlo.custom_call @fdp_shm_sum(%131, %123, %122) {has_side_effect = true, "
    "mhlo.backend_config = {scale = 5.000000e-01 : f64}} : (tensor<1xf32>, tensor<33xf32>, "
    "tensor<64x33xf32>) -> (tensor<33xf32>, tensor<64x33xf32>)"
)


@pytest.mark.parametrize("text", [_SHM_HLO, "module @m {\n" + _SHM_STABLEHLO + "\n}"])
def test_shared_memory_sums_are_listed_with_their_bytes(text):
    """The default hook's sums on CPU processes of one host are fdp's FFI calls, not XLA
    collectives: the stats list them as 'shm-sum', with the bucket's bytes as sent."""
    stats = fdp.collective_stats(text)
    nbytes = (33 + 64 * 33) * 4
    assert stats.summary() == {"shm-sum": {"count": 1, "bytes": nbytes}}
    assert stats.sent_bytes() == nbytes and stats.count("all-reduce") == 0
    assert stats.ops[0].shapes == ((33,), (64, 33)) and stats.ops[0].dtypes == ("f32", "f32")


def test_the_bytes_all_reduced_per_step_count_the_shared_memory_sums():
    kinds = {"all-reduce": {"count": 1, "bytes": 4}, "shm-sum": {"count": 3, "bytes": 11260}}
    stats = _stats.RuntimeStats(_stats.StatsSchedule(), collectives=kinds).as_dict()
    assert stats["allreduce_bytes_per_step"] == 11264
    assert stats["allreduce_count_per_step"] == 4


# An all-gather as XLA's partitioner writes it on a 2 x 4 mesh (jaxlib 0.10.2, shortened):
# devices [[0..3], [4..7]] transposed, grouped along the axis of 4.
_MESH_GROUPS_HLO = (
    "  %all-gather.1 = f32[64,32]{1,0} all-gather(%fusion.12), channel_id=3, "
    "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
    "{'axis_0'}, dimensions={0}, use_global_device_ids=true"
)


def test_mesh_groups_that_name_their_devices_are_read():
    (op,) = fdp.collective_stats(_MESH_GROUPS_HLO).ops
    assert op.replica_groups.startswith("mesh['axis_0'=4") and op.replica_groups.endswith(
        "{'axis_0'}"
    )
    assert op.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert op.group_size == 4
    assert op.sent_bytes == 64 * 32 * 4 * 3 / 4


# XLA:GPU's async all-reduce as jaxlib 0.10 writes it (the results) and as 0.12 does
# (operands, then the results that alias them), shortened.
_START_010 = (
    "  %all-reduce-start = (f32[256]{0}, f32[256,256]{1,0}) all-reduce-start(%a, %b), "
    "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true"
)
_START_012 = (
    "  %all-reduce-start = ((f32[256]{0}, f32[256,256]{1,0}), (f32[256]{0}, f32[256,256]{1,0})) "
    "all-reduce-start(%a, %b), channel_id=1, replica_groups=mesh['data'=8] {'data'}, "
    "use_global_device_ids=true, output_to_operand_aliasing={{1,0}: (0, {}), {1,1}: (1, {})}"
)
_START_ONE_012 = (
    "  %all-reduce-start = ((f32[]), f32[]) all-reduce-start(%a), channel_id=1, "
    "replica_groups=mesh['data'=8] {'data'}, output_to_operand_aliasing={{1}: (0, {})}"
)


@pytest.mark.parametrize("line", [_START_010, _START_012])
def test_an_async_all_reduce_counts_its_results_once(line):
    (op,) = fdp.collective_stats(line).ops
    assert op.shapes == ((256,), (256, 256)) and op.nbytes == (256 + 256 * 256) * 4
    assert op.groups == (tuple(range(8)),)
    (op,) = fdp.collective_stats(_START_ONE_012).ops
    assert op.shapes == ((),) and op.nbytes == 4
