"""grain pipelines with fdp: shard options per process, iterator state in the checkpoints."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest
from _procs import launch

import fdp

grain = pytest.importorskip("grain")

EXAMPLES = 24


def loader(seed=0, batch=4, shard=None):
    sampler = grain.samplers.IndexSampler(
        EXAMPLES,
        shard_options=shard or fdp.grain_shard_options(),
        shuffle=True,
        seed=seed,
        num_epochs=1,
    )
    return grain.DataLoader(
        data_source=list(range(EXAMPLES)),
        sampler=sampler,
        operations=[grain.transforms.Batch(batch, drop_remainder=True)],
        worker_count=0,
    )


def dataset_iterator():
    return iter(grain.MapDataset.range(EXAMPLES).shuffle(seed=0).batch(4))


def state_of(value):
    return fdp.replicate({"w": jnp.full((3,), value, jnp.float32)})


def test_shard_options_are_grains_own_for_this_process():
    options = fdp.grain_shard_options(drop_remainder=True)
    assert isinstance(options, grain.sharding.ShardByJaxProcess)
    assert (options.shard_index, options.shard_count, options.drop_remainder) == (0, 1, True)


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "FDP_NUM_PROCESSES"])
def test_shard_options_before_fdp_init_under_a_launcher_raise(monkeypatch, variable):
    # Every process would be shard 0 of 1 and read the whole dataset.
    monkeypatch.setenv(variable, "2")
    with pytest.raises(RuntimeError, match=r"before fdp.init\(\): this run has 2 processes"):
        fdp.grain_shard_options()


@pytest.mark.parametrize("make", [lambda: iter(loader()), dataset_iterator], ids=["loader", "map"])
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_restored_iterator_reads_the_rest_of_the_epoch_once(tmp_path, make, async_save):
    batches = make()
    with fdp.CheckpointManager(tmp_path, async_save=async_save) as ckpt:
        before = [next(batches) for _ in range(2)]
        ckpt.save(2, state_of(2.0), data_iterator=batches)
        lost = [next(batches) for _ in range(2)]  # read after the save: not in it
    resumed = make()
    with fdp.CheckpointManager(tmp_path) as ckpt:
        restored = ckpt.restore(state_of(0.0), data_iterator=resumed)
    assert restored.step == 2 and float(restored.state["w"][0]) == 2.0
    after = list(resumed)
    for a, b in zip(lost, after, strict=False):  # the same batches again, in order
        np.testing.assert_array_equal(a, b)
    seen = np.concatenate(before + after).tolist()
    assert sorted(seen) == list(range(EXAMPLES)), collections.Counter(seen)


def test_restoring_without_the_iterator_loads_the_state_alone(tmp_path):
    batches = iter(loader())
    next(batches)
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state_of(1.0), data_position={"batch": 1}, data_iterator=batches)
        restored = ckpt.restore(state_of(0.0))
    assert (restored.step, restored.data_position) == (1, {"batch": 1})


def test_a_checkpoint_without_iterator_state_is_named(tmp_path):
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(3, state_of(3.0))
        with pytest.raises(ValueError, match=r"step=3 .*holds no data iterator state"):
            ckpt.restore(state_of(0.0), data_iterator=iter(loader()))


def test_another_pipeline_is_refused_before_the_state_is_loaded(tmp_path):
    batches = iter(loader(seed=0))
    next(batches)
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state_of(1.0), data_iterator=batches)
        template = state_of(0.0)
        refused = r"Sampler in checkpoint does not match.*same pipeline"
        with pytest.raises(ValueError, match=refused):
            ckpt.restore(template, data_iterator=iter(loader(seed=1)))
    assert float(template["w"][0]) == 0.0


def test_a_template_that_differs_leaves_the_iterator_as_it_was(tmp_path):
    batches = iter(loader())
    next(batches)
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state_of(1.0), data_iterator=batches)
        fresh = iter(loader())
        with pytest.raises(ValueError, match=r"w: saved float32\[3\], template float32\[2\]"):
            ckpt.restore({"w": jnp.zeros(2)}, data_iterator=fresh)
    np.testing.assert_array_equal(next(fresh), next(iter(loader())))  # still at the start


def test_a_data_iterator_that_is_not_grains_is_a_type_error(tmp_path):
    with fdp.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(TypeError, match=r"data_iterator must be a grain iterator.*list_iter"):
            ckpt.save(1, state_of(1.0), data_iterator=iter([1, 2]))
        assert ckpt.all_steps() == []


def test_an_elastic_iterator_resumes_on_another_number_of_processes(tmp_path):
    """What grain allows across world sizes: ElasticIterator's state is the same on every
    shard, so it goes in data_position (JSON, written once) and restores into any count."""

    def elastic(index, count):
        ds = grain.MapDataset.range(EXAMPLES).shuffle(seed=0)
        shard = grain.sharding.ShardOptions(shard_index=index, shard_count=count)
        return iter(grain.experimental.ElasticIterator(ds, 4, shard))

    two = [elastic(0, 2), elastic(1, 2)]
    before = [next(it) for _ in range(2) for it in two]
    assert two[0].get_state() == two[1].get_state()
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, state_of(2.0), data_position=two[0].get_state())
        position = ckpt.restore(state_of(0.0)).data_position
    one = elastic(0, 1)
    one.set_state(position)
    seen = np.concatenate(before + list(one)).tolist()
    assert sorted(seen) == list(range(EXAMPLES)), collections.Counter(seen)


def read_seen(prefix, rank):
    rows = []
    with open(f"{prefix}.rank{rank}") as f:
        for line in f:
            attempt, step, *idx = map(int, line.split())
            rows.append((attempt, step, idx))
    return rows


def test_a_killed_run_resumes_its_grain_pipeline_reading_each_example_once(tmp_path, marker):
    """2 processes x 2 devices read one epoch of 48 examples with a grain DataLoader
    sharded per process; rank 1 SIGKILLs itself after step 5 (checkpoints at 2 and 4);
    fdp launch restarts both, which restore the train state and each its grain iterator
    from step 4: steps 1-4 of the first attempt and 5-6 of the second read the epoch."""
    seen = tmp_path / "seen"
    out = launch(
        ["--nproc-per-node", "2", "--max-restarts", "1"],
        "grain_train.py",
        ["--ckpt-dir", tmp_path / "ck", "--seen", seen, "--die-after-step", "5"],
        marker,
        timeout=300,
    )
    assert out.returncode == 0, out.output
    assert "attempt 1 of 2 failed: rank 1 ended with signal SIGKILL (9)" in out.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] resumed at step 4" in out.stdout
        assert f"[rank {rank}] done: step 6" in out.stdout
    kept = []
    for rank in (0, 1):
        rows = read_seen(seen, rank)
        first = {step: idx for attempt, step, idx in rows if attempt == 0}
        second = [(step, idx) for attempt, step, idx in rows if attempt == 1]
        assert [s for s, _ in second] == [5, 6], rows  # the resumed run starts after step 4
        assert 5 in first or rank == 0, rows  # rank 1 read step 5 before it died
        if 5 in first:  # the resumed iterator reads what the killed one read, in order
            assert first[5] == second[0][1], rows
        kept += [i for s in range(1, 5) for i in first[s]] + [i for _, idx in second for i in idx]
    counts = collections.Counter(kept)
    assert sorted(counts) == list(range(48)) and set(counts.values()) == {1}, counts
    # One process cannot take over the iterator states of two (grain keeps one a process).
    with (
        fdp.CheckpointManager(tmp_path / "ck") as ckpt,
        pytest.raises(ValueError, match=r"step=6 .* of 2 process\(es\) .*this run has 1"),
    ):
        ckpt.restore(state_of(0.0), data_iterator=iter(loader()))
