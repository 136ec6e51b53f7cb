"""The Quick start demo and the fdp command line, run as a user runs them."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from _procs import run as run_marked

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # This checkout's fdp, not another installed copy.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def demo_accuracy(*args):
    out = run("examples/train_digits.py", *args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8 cpu device(s), mesh {'data': 8}" in out.stdout
    return float(re.search(r"held-out accuracy: ([\d.]+) on 360 images", out.stdout)[1])


@pytest.mark.slow
def test_demo_and_compressed_hooks_reach_high_held_out_accuracy():
    # The Quick start demo as shipped (30 epochs), then with bf16 compression and
    # PowerSGD (rank 2, compressing from step 10): within 1 point of the default;
    # then sharded with ZeRO stage 3.
    default = demo_accuracy("--min-accuracy", "0.95")
    assert default >= 0.95
    for hook in ("bf16_compress", "powersgd"):
        acc = demo_accuracy("--comm-hook", hook, "--powersgd-rank", "2")
        assert abs(acc - default) <= 0.01, (hook, acc, default)
    # ZeRO-3 trains the same parameters as DDP (to rounding): the same accuracy.
    assert abs(demo_accuracy("--zero-stage", "3") - default) <= 0.003


def test_demo_under_fdp_launch_with_two_processes(marker):
    """Each process reads its shard and simulates 4 of the 8 devices."""
    out = run_marked(
        [
            "-m",
            "fdp.launch",
            "--nproc-per-node",
            "2",
            "examples/train_digits.py",
            "--epochs",
            "4",
            "--min-accuracy",
            "0.85",
        ],
        marker,
        timeout=240,
    )
    assert out.returncode == 0, out.output
    assert "[rank 0] fdp " in out.stdout
    assert "8 cpu device(s), mesh {'data': 8} over 2 processes" in out.stdout
    acc = float(re.search(r"\[rank 0\] held-out accuracy: ([\d.]+) on 360 images", out.stdout)[1])
    assert acc >= 0.85
    assert "[rank 1] held-out accuracy" not in out.stdout  # process 0 reports


def test_demo_rejects_a_batch_that_does_not_split():
    out = run("examples/train_digits.py", "--batch-size", "100")
    assert out.returncode == 2
    assert "--batch-size must be a multiple of the 8 devices" in out.stderr


def test_cli_version():
    out = run("-m", "fdp", "version")
    assert out.returncode == 0 and re.fullmatch(r"fdp \d+\.\d+\.\d+\n", out.stdout)
