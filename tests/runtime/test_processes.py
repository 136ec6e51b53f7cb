"""Real processes: fdp.join with uneven data, and the layout chosen for CPU processes."""

import re

import jax
import numpy as np
import optax
from _models import make_data, make_state
from _procs import launch


def test_a_process_that_runs_out_early_joins_with_zero_weight(tmp_path, marker):
    out = launch(["--nproc-per-node", "2"], "join.py", ["--out", tmp_path / "p.npz"], marker)
    assert out.returncode == 0, out.output
    assert "process 0 stepped 3 times" in out.stdout
    assert "process 1 stepped 3 times" in out.stdout  # ran out after 1, kept stepping

    # One device, each step's real examples only: process 0's batch t, and process
    # 1's batch t while it had one.
    init = make_state("mlp", "adam")
    loss_fn = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        init.apply_fn({"params": p}, b["x"]), b["y"]
    ).mean()
    state = jax.device_put(init, jax.devices()[0])
    for t in range(3):
        parts = [make_data(100 + t, 4)] + ([make_data(110 + t, 4)] if t < 1 else [])
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        state = state.apply_gradients(grads=jax.grad(loss_fn)(state.params, batch))
    with np.load(tmp_path / "p.npz") as got:
        for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
            np.testing.assert_allclose(got[jax.tree_util.keystr(path)], leaf, rtol=1e-5, atol=1e-6)


def test_throw_on_early_termination_stops_every_process(tmp_path, marker):
    out = launch(
        ["--nproc-per-node", "2"], "join.py", ["--out", tmp_path / "p.npz", "--throw"], marker
    )
    assert out.returncode != 0
    assert "at step 1 participants ran out of data while others had more (processes [1]" in (
        out.output
    )
    assert "stepped" not in out.stdout


def test_auto_layout_keeps_ddp_buckets_apart_with_several_cpu_processes(marker):
    out = launch(["--nproc-per-node", "2"], "layout.py", [], marker)
    assert out.returncode == 0, out.output
    for rank in (0, 1):  # one all-reduce per DDP bucket, and one for the loss
        line = re.search(
            rf"process {rank}: layout (\w+), (\d+) buckets, (\d+) all-reduces", out.stdout
        )
        assert line and line[1] == "flat", out.stdout
        assert int(line[2]) > 1 and int(line[3]) == int(line[2]) + 1
