"""Data x tensor parallelism over real processes: 2 processes x 4 CPU devices (each 2 data
rows x 2 model columns of a 4 x 2 mesh, gloo between them) under fdp launch, against
1 process x 8 devices (tests/workers/tensor_parallel.py)."""

import numpy as np
import pytest
from _procs import launch, run


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_two_processes_keep_the_model_split_and_train_like_one(stage, tmp_path, marker):
    zero = ["--zero-stage", str(stage)]
    alone = run(
        [
            "tests/workers/tensor_parallel.py",
            "--out",
            tmp_path / "one.npz",
            "--devices",
            "8",
            *zero,
        ],
        marker,
    )
    assert alone.returncode == 0, alone.output
    out = launch(
        ["--nproc-per-node", "2"],
        "tensor_parallel.py",
        ["--out", tmp_path / "two.npz", *zero],
        marker,
    )
    assert out.returncode == 0, out.output
    # (8, 16) split over 'model' by columns; at stage 3 over 'data' by rows too.
    spec, shape = ("P(None, 'model')", "(8, 8)") if stage == 0 else ("P('data', 'model')", "(2, 8)")
    for rank in (0, 1):
        assert f"rank {rank}: Dense_0 kernel {spec}, {shape} on each device" in out.stdout, (
            out.output
        )
    one, two = load(tmp_path / "one.npz"), load(tmp_path / "two.npz")
    assert one.keys() == two.keys() and len(one) == 4
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
