"""Training with real processes: 2 processes x 2 CPU devices (gloo) against 1 x 4,
kill-and-resume under fdp launch, and a mismatched leaf caught before training.

All runs use tests/workers/train.py: an MLP, Adam, 8 steps of global batch 16 read
with DistributedSampler (2 epochs), checkpoints every 2 steps.
"""

import uuid

import numpy as np
import pytest
from _procs import launch, run, survivors

TWO_BY_TWO = ["--nproc-per-node", "2"]


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Final parameters of an uninterrupted 2-process run (shared by two tests)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    tag = uuid.uuid4().hex
    try:
        out = launch(
            TWO_BY_TWO, "train.py", ["--out", tmp / "params.npz", "--ckpt-dir", tmp / "ck"], tag
        )
    finally:
        left = survivors(tag)
    assert out.returncode == 0 and not left, out.output
    # Orbax finalised every checkpoint from both processes, and kept the last two.
    assert sorted(p.name for p in (tmp / "ck").iterdir()) == ["6", "8"]
    return load(tmp / "params.npz")


def test_two_processes_train_like_one_process_with_four_devices(uninterrupted, tmp_path, marker):
    """Each process feeds its half of every global batch; one process feeds all of it."""
    out = run(
        [
            "tests/workers/train.py",
            "--out",
            tmp_path / "one.npz",
            "--devices",
            "4",
            "--replicas",
            "2",
        ],
        marker,
    )
    assert out.returncode == 0, out.output
    one = load(tmp_path / "one.npz")
    assert int(one["step"]) == int(uninterrupted["step"]) == 8
    assert one.keys() == uninterrupted.keys()
    for name in one:
        np.testing.assert_allclose(
            uninterrupted[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name
        )
    # The update really moved the parameters (so the comparison means something).
    first_kernel = "['Dense_0']['kernel']"
    assert np.abs(one[first_kernel]).sum() > 0


def test_zero_stage_3_over_two_processes_trains_like_the_ddp_run(uninterrupted, tmp_path, marker):
    """ZeRO-3 over 2 processes x 2 devices (parameters and Adam state sharded across both
    processes, each writing its own shards of the checkpoints) ends where DDP does."""
    out = launch(
        TWO_BY_TWO,
        "train.py",
        ["--out", tmp_path / "z.npz", "--ckpt-dir", tmp_path / "ck", "--zero-stage", "3"],
        marker,
    )
    assert out.returncode == 0, out.output
    zero = load(tmp_path / "z.npz")
    assert int(zero["step"]) == 8 and zero.keys() == uninterrupted.keys()
    for name in zero:
        np.testing.assert_allclose(
            uninterrupted[name], zero[name], rtol=1e-5, atol=1e-6, err_msg=name
        )
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["6", "8"]


def test_hybrid_sharding_over_two_processes_trains_like_one_process_with_four_devices(
    tmp_path, marker
):
    """HSDP: ZeRO-3 inside each process (its 2 devices hold half of every parameter and
    of Adam's state), replicated across the 2 processes; gradients reduce-scattered
    inside a process and the halves all-reduced across processes (gloo). Each process
    saves its shards; the parameters end where 1 process x 4 devices (DDP) ends."""
    alone = ["--devices", "4", "--replicas", "2"]  # the same global batches, 1 process
    one = run(["tests/workers/train.py", "--out", tmp_path / "one.npz", *alone], marker)
    assert one.returncode == 0, one.output
    args = ["--out", tmp_path / "h.npz", "--ckpt-dir", tmp_path / "ck", "--zero-stage", "3"]
    out = launch(TWO_BY_TWO, "train.py", [*args, "--host-mesh", "--shard-over", "inner"], marker)
    assert out.returncode == 0, out.output
    # (64, 32) split over a process's 2 devices, not over all 4.
    assert out.stdout.count("Adam mu of Dense_0 kernel: (32, 32) on each device") == 2
    want, got = load(tmp_path / "one.npz"), load(tmp_path / "h.npz")
    assert int(got["step"]) == int(want["step"]) == 8 and got.keys() == want.keys()
    for name in got:
        np.testing.assert_allclose(want[name], got[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["6", "8"]


@pytest.mark.parametrize("hook", [None, "compressed_int8"])
def test_hierarchical_reduction_over_two_processes_trains_like_the_flat_run(
    uninterrupted, tmp_path, marker, hook
):
    """2 processes x 2 devices as a host x device mesh: reduce-scatter inside each process,
    all-reduce of the halves across processes (gloo; int8 all-to-all with the hook),
    all-gather inside: the flat result (close to it with int8, after 8 Adam steps)."""
    extra = [] if hook is None else ["--comm-hook", hook]
    out = launch(
        TWO_BY_TWO, "train.py", ["--out", tmp_path / "h.npz", "--hierarchical", *extra], marker
    )
    assert out.returncode == 0, out.output
    hier = load(tmp_path / "h.npz")
    assert int(hier["step"]) == 8 and hier.keys() == uninterrupted.keys()
    names = [k for k in hier if k != "step"]
    if hook is None:
        for name in names:
            np.testing.assert_allclose(
                uninterrupted[name], hier[name], rtol=1e-5, atol=1e-6, err_msg=name
            )
    else:  # compressed for real, yet close over the whole model
        want = np.concatenate([uninterrupted[k].ravel() for k in names])
        got = np.concatenate([hier[k].ravel() for k in names])
        assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


def test_a_killed_worker_resumes_from_the_last_checkpoint(uninterrupted, tmp_path, marker):
    """Rank 1 SIGKILLs itself after step 5 (last checkpoint: step 4) on the first attempt;
    fdp launch --max-restarts 1 restarts both, which resume at step 4 and finish."""
    out = launch(
        [*TWO_BY_TWO, "--max-restarts", "1"],
        "train.py",
        ["--out", tmp_path / "params.npz", "--ckpt-dir", tmp_path / "ck", "--die-at-step", "5"],
        marker,
    )
    assert out.returncode == 0, out.output
    assert "attempt 1 of 2 failed: rank 1 ended with signal SIGKILL (9)" in out.stderr
    assert "[rank 1] resumed at step 4 from {'epoch': 0, 'batch': 4}" in out.stdout
    assert "[rank 0] resumed at step 4" in out.stdout
    resumed = load(tmp_path / "params.npz")
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:  # the same computations, replayed: bit for bit
        np.testing.assert_array_equal(resumed[name], uninterrupted[name], err_msg=name)


def test_a_leaf_whose_shape_differs_on_one_process_is_named_before_training(tmp_path, marker):
    out = launch(
        TWO_BY_TWO, "train.py", ["--out", tmp_path / "p.npz", "--narrow-rank", "1"], marker
    )
    assert out.returncode == 1, out.output
    summary = out.stderr.split("fdp launch: the worker group failed", 1)[1]
    assert "the state passed to fdp.replicate differs across processes" in summary
    assert (
        ".params['Dense_1']['kernel']: (32, 16) float32 on process(es) [0], "
        "(32, 8) float32 on process(es) [1]"
    ) in summary
    assert "done: step" not in out.stdout  # no step ran


@pytest.mark.slow
def test_typed_prng_keys_train_over_two_processes_like_one_process(tmp_path, marker):
    """nnx.Rngs (nnx.Dropout, with nnx.BatchNorm) and a Linen TrainState holding a
    jax.random.key: replicated, DETAIL-checked, stepped and checkpointed by 2 processes
    x 2 devices. Dropout keys are folded with the device index, so the run ends where
    one process with 4 devices does (tests/workers/prng_train.py)."""
    two = launch(
        TWO_BY_TWO,
        "prng_train.py",
        ["--out", tmp_path / "two.npz", "--ckpt-dir", tmp_path / "ck"],
        marker,
        FDP_DEBUG="DETAIL",
    )
    assert two.returncode == 0, two.output
    one = run(
        ["tests/workers/prng_train.py", "--out", tmp_path / "one.npz", "--devices", "4"], marker
    )
    assert one.returncode == 0, one.output
    two, one = load(tmp_path / "two.npz"), load(tmp_path / "one.npz")
    assert two.keys() == one.keys() and int(two["step"]) == 3
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # Process 1 seeded its own keys: replicate handed it process 0's, bits and all.
    np.testing.assert_array_equal(two["key"], [0, 200])  # jax.random.key(200)'s data
    assert int(two["nnx['drop']['rngs']['count'].value"]) == 3  # one dropout draw a step
