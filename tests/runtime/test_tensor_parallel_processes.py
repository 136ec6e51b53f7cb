"""Data x tensor parallelism over real processes: 2 processes x 4 CPU devices (each 2 data
rows x 2 model columns of a 4 x 2 mesh, or one host of a 2 x 2 x 2 HSDP mesh, gloo between
them) under fdp launch, against 1 process x 8 devices (tests/workers/tensor_parallel.py)."""

import numpy as np
import pytest
from _procs import launch, run


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def launched_like_one(args, tmp_path, marker):
    """The launched run's output, after checking it ends where one process does."""
    worker = "tests/workers/tensor_parallel.py"
    alone = run([worker, "--out", tmp_path / "one.npz", "--devices", "8", *args], marker)
    assert alone.returncode == 0, alone.output
    out = launch(
        ["--nproc-per-node", "2"],
        "tensor_parallel.py",
        ["--out", tmp_path / "two.npz", *args],
        marker,
    )
    assert out.returncode == 0, out.output
    one, two = load(tmp_path / "one.npz"), load(tmp_path / "two.npz")
    assert one.keys() == two.keys() and len(one) == 4
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_two_processes_keep_the_model_split_and_train_like_one(stage, tmp_path, marker):
    out = launched_like_one(["--zero-stage", str(stage)], tmp_path, marker)
    # (8, 16) split over 'model' by columns; at stage 3 over 'data' by rows too.
    spec, shape = ("P(None, 'model')", "(8, 8)") if stage == 0 else ("P('data', 'model')", "(2, 8)")
    for rank in (0, 1):
        assert f"rank {rank}: Dense_0 kernel {spec}, {shape} on each device" in out.stdout, (
            out.output
        )


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_hsdp_across_two_processes_keeps_the_model_split_and_trains_like_one(
    stage, tmp_path, marker
):
    # Each process is a "host" of a (2 host x 2 device x 2 model) mesh: ZeRO shards over
    # 'device' inside a process, the replicas across processes all-reduce through gloo.
    out = launched_like_one(["--zero-stage", str(stage), "--hsdp"], tmp_path, marker)
    # (8, 16) split over 'model' by columns; Adam's moments over 'device' by rows too,
    # the parameters as well at stage 3; never over 'host'.
    shard = "P('device', 'model'), (4, 8)"
    kernel = shard if stage == 3 else "P(None, 'model'), (8, 8)"
    for rank in (0, 1):
        assert f"rank {rank}: Dense_0 kernel {kernel} on each device" in out.stdout, out.output
        assert f"rank {rank}: Dense_0 kernel's Adam mu {shard} on each" in out.stdout, out.output
