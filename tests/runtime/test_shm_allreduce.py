"""comm_hook='shm_allreduce': gloo's sum through shared memory, across real processes.

The worker (tests/workers/shm_sum.py) trains the same start with 'allreduce' and
'shm_allreduce' under `fdp launch`, 2 processes x 1 CPU device, and stalls one rank
before a last shared-memory sum.
"""

import uuid

import numpy as np
import optax
import pytest
from _procs import launch, survivors
from flax.training.train_state import TrainState

import fdp
from fdp.collectives import _shm


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shm")
    tag = uuid.uuid4().hex
    try:
        done = launch(["--nproc-per-node", "2"], "shm_sum.py", ["--out", out], tag)
    finally:
        left = survivors(tag)
    assert done.returncode == 0 and not left, done.output
    ranks = [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]
    return ranks, [(out / f"stall{r}.txt").read_text() for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_flat_buckets_have_the_bits_of_the_gloo_all_reduce(two_processes):
    """With 2 processes each element is a + b either way: exactly today's parameters."""
    (rank0, rank1), _ = two_processes
    keys = [k for k in rank0 if k.startswith("flat/shm_allreduce/")]
    assert len(keys) == 6
    for key in keys:
        gloo = rank0[key.replace("shm_allreduce", "allreduce")]
        np.testing.assert_array_equal(rank0[key], gloo, err_msg=key)
        # Each rank trained on its own data: only a real sum makes them agree.
        np.testing.assert_array_equal(rank1[key], rank0[key], err_msg=key)
        start = rank0[key.replace("flat/shm_allreduce", "start")]
        assert np.abs(rank0[key] - start).max() > 1e-3, key


@pytest.mark.multiprocess
@pytest.mark.slow
def test_leaf_buckets_match_gloo_and_every_rank_agrees(two_processes):
    """XLA's leaves program rounds differently from its own flat one (~1e-7); the shared
    memory sum gives the flat bits in both layouts, identical on every rank."""
    (rank0, rank1), _ = two_processes
    for key in rank0:
        if key.startswith("leaves/shm_allreduce/"):
            gloo = rank0[key.replace("shm_allreduce", "allreduce")]
            np.testing.assert_allclose(rank0[key], gloo, rtol=1e-6, atol=1e-8, err_msg=key)
            np.testing.assert_array_equal(rank0[key], rank0[key.replace("leaves/", "flat/")])
            np.testing.assert_array_equal(rank1[key], rank0[key], err_msg=key)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stalled_peer_is_an_error_naming_its_rank(two_processes):
    _, (stall, late) = two_processes
    assert stall.startswith("JaxRuntimeError"), stall
    assert "for rank(s) 1, which did not arrive" in stall
    seconds = float(stall.split(" after ")[1].split(" s:")[0])
    assert 1.9 <= seconds < 4.5, stall  # the 2 s timeout, not rank 1's 5 s sleep
    # The late rank is not left waiting, nor handed stale data: the group is closed.
    assert "rank 0 failed an earlier sum, so this group is unusable" in late, late


def test_one_process_with_several_devices_is_refused_with_the_fix():
    state = fdp.replicate(
        TrainState.create(apply_fn=None, params={"w": np.ones(4, np.float32)}, tx=optax.sgd(0.1))
    )
    step = fdp.train_step(lambda p, b: (b["x"] @ p["w"]).mean(), comm_hook="shm_allreduce")
    batch = fdp.shard_batch({"x": np.ones((8, 4), np.float32)})
    with pytest.raises(ValueError, match="one device per process.*comm_hook='allreduce'"):
        step(state, batch)


def test_capacity_setting_is_checked(monkeypatch):
    monkeypatch.setenv(_shm.CAPACITY_ENV, "lots")
    with pytest.raises(ValueError, match="FDP_SHM_CAPACITY_MB must be a positive number"):
        _shm._capacity()


def test_the_hook_is_known_by_name():
    assert fdp.hooks.resolve("shm_allreduce") is fdp.hooks.shm_allreduce()
