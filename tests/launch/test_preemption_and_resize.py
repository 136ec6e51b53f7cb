"""Preemption (SIGTERM) and resuming on another world size, with real processes under fdp launch.

Workers run tests/workers/resume.py: an MLP trained from the newest checkpoint,
whose data position is a DistributedSampler.position, and which saves and exits
when fdp.reached_preemption says so (or after --stop-after steps of a run).
"""

import os
import pathlib
import signal
import time

import numpy as np
import pytest
from _procs import finish, launch, start

GRACE = 5.0  # fdp launch's default --grace-period


def worker_args(tmp_path, name, *extra):
    return ["--out", tmp_path / f"{name}.npz", "--ckpt-dir", tmp_path / "ck", *map(str, extra)]


def seen(prefix):
    """(epoch, index) of every example every process trained on, over all runs."""
    out = []
    for path in sorted(pathlib.Path(prefix).parent.glob(pathlib.Path(prefix).name + ".rank*")):
        for line in path.read_text().splitlines():
            epoch, *idx = map(int, line.split())
            out += [(epoch, i) for i in idx]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same 12 steps (two epochs of 96 examples, global batch 16) without a stop."""
    from _procs import run

    tmp = tmp_path_factory.mktemp("straight")
    out = run(
        ["tests/workers/resume.py", *worker_args(tmp, "params")], "uninterrupted", timeout=240
    )
    assert out.returncode == 0, out.output
    return dict(np.load(tmp / "params.npz"))


def assert_params_close(path, want):
    got = dict(np.load(path))
    assert int(got["step"]) == int(want["step"]) == 12
    for key in want:
        # Other devices per step: the same examples, summed in another order.
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_world_size_reading_each_example_once(
    tmp_path, marker, uninterrupted, before, after
):
    prefix = tmp_path / "seen"
    first = launch(
        ["--nproc-per-node", str(before)],
        "resume.py",
        worker_args(tmp_path, "a", "--stop-after", 4, "--seen", prefix),
        marker,
        timeout=240,
    )
    assert first.returncode == 0 and "saved step 4 and stopped" in first.stdout, first.output
    second = launch(
        ["--nproc-per-node", str(after)],
        "resume.py",
        worker_args(tmp_path, "b", "--seen", prefix),
        marker,
        timeout=240,
    )
    assert second.returncode == 0, second.output
    assert "resumed at step 4 from {'epoch': 0, 'consumed': 64" in second.stdout
    examples = seen(prefix)
    for epoch in (0, 1):  # every example of both epochs once: none skipped, none twice
        assert sorted(i for e, i in examples if e == epoch) == list(range(96))
    assert_params_close(tmp_path / "b.npz", uninterrupted)


def test_sigterm_saves_at_the_next_step_and_the_next_launch_resumes(
    tmp_path, marker, uninterrupted
):
    proc = start(
        [
            "-m",
            "fdp.launch",
            "--nproc-per-node",
            "2",
            "tests/workers/resume.py",
            *worker_args(tmp_path, "a", "--step-sleep", 0.3, "--seen", tmp_path / "seen"),
        ],
        marker,
    )
    started = time.monotonic()
    for line in proc.stdout:  # the worker's output, prefixed by the launcher
        if "step 3 loss" in line:
            break
    signalled = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)  # the agent forwards it to every worker
    first = finish(proc, 120, started)
    took = first.seconds - (signalled - started)
    assert first.returncode == 128 + signal.SIGTERM, first.output
    assert took < GRACE, f"the workers took {took:.1f} s to stop, more than the grace period"
    saved = [
        int(line.split("saved step ")[1].split()[0])
        for line in first.stdout.splitlines()
        if "saved step" in line
    ]
    assert len(saved) == 2 and saved[0] == saved[1] >= 3, first.output  # both ranks, one step
    second = launch(
        ["--nproc-per-node", "2"],
        "resume.py",
        worker_args(tmp_path, "b", "--seen", tmp_path / "seen"),
        marker,
        timeout=240,
    )
    assert second.returncode == 0, second.output
    assert f"resumed at step {saved[0]}" in second.stdout
    examples = seen(tmp_path / "seen")
    for epoch in (0, 1):
        assert sorted(i for e, i in examples if e == epoch) == list(range(96))
    assert_params_close(tmp_path / "b.npz", uninterrupted)
