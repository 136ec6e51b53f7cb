"""FDP_DEBUG=DETAIL: processes about to run different steps fail fast, naming the difference.

The multi-process cases run tests/workers/detail.py under `fdp launch`: 2 processes
x 2 CPU devices (gloo). Without DETAIL, a leaf of another shape on one process gets
to gloo, which aborts with "Received data size doesn't match expected size" (on GPUs,
NCCL would hang); with DETAIL the processes compare their steps first.
"""

import re

import jax.numpy as jnp
import optax
import pytest
from _models import cross_entropy, make_data, make_state
from _procs import launch

import fdp
from fdp.observe import _fingerprint

pytestmark = pytest.mark.usefixtures("fdp_debug")

FAIL_WITHIN = 60.0  # seconds from the first step's call to the end of the run
TWO = ["--nproc-per-node", "2"]


def run_detail(marker, *args):
    out = launch(TWO, "detail.py", list(args), marker, timeout=180, FDP_DEBUG="DETAIL")
    called = [float(t) for t in re.findall(r"first step at ([\d.]+)", out.stdout)]
    assert len(called) == 2, out.output  # both processes got to their first step
    return out, out.ended_at - min(called)


def test_processes_that_agree_train(marker):
    out, _ = run_detail(marker)
    assert out.returncode == 0, out.output
    for rank in (0, 1):
        assert f"[rank {rank}] done: loss" in out.stdout
        assert re.search(rf"\[rank {rank}\] .*2 process\(es\) agree on the step", out.stderr)
        # fdp's own stderr handler ("fdp INFO: "), or the root logger's basic one
        # ("INFO:fdp:") where an import configured it (Orbax did, when `import fdp`
        # imported it).
        line = rf"\[rank {rank}\] (fdp INFO: |INFO:fdp:)fdp\.train_step \(process {rank} of 2\)"
        assert re.search(line, out.stderr), out.stderr


def test_different_bucket_caps_fail_fast_naming_them(marker):
    out, seconds = run_detail(marker, "--cap-mb-rank1", "0.002")
    assert out.returncode == 1, out.output
    summary = out.stderr.split("fdp launch: the worker group failed", 1)[1]
    assert "RuntimeError: Detected mismatch between processes before the first step" in summary
    assert "bucket_cap_mb: 25.0 on process(es) [0]; 0.002 on process(es) [1]" in summary
    assert "buckets: 1 on process(es) [0]; 2 on process(es) [1]" in summary
    assert "bucket 1: (absent) on process(es) [0]; float32, 2 leaf(s), 8320 bytes" in summary
    assert "done:" not in out.stdout  # no step ran
    assert seconds < FAIL_WITHIN, seconds
    print(f"different caps: failed {seconds:.1f} s after the first step was called")


def test_a_different_leaf_shape_fails_fast_naming_the_leaf(marker):
    # The state is placed without fdp.replicate, whose own check would catch this first.
    out, seconds = run_detail(marker, "--narrow-rank", "1")
    assert out.returncode == 1, out.output
    summary = out.stderr.split("fdp launch: the worker group failed", 1)[1]
    assert "Detected mismatch between processes before the first step" in summary
    assert (
        "state.params['Dense_1']['kernel']: float32[32, 16] on process(es) [0]; "
        "float32[32, 8] on process(es) [1]"
    ) in summary
    assert "gloo" not in summary.lower()  # no collective ran
    assert seconds < FAIL_WITHIN, seconds
    print(f"different leaf: failed {seconds:.1f} s after the first step was called")


def test_the_fingerprint_holds_settings_plan_leaves_and_program():
    fdp.set_debug_level("DETAIL")
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn), comm_hook="bf16_compress")
    batch = fdp.shard_batch(make_data(0, 16))
    lowered = step.lower(state, batch)
    fp = _fingerprint.step_fingerprint(
        "fdp.train_step", step.config, step.step_plan, {"state": state, "batch": batch}, lowered
    )
    assert fp["bucket_cap_mb"] == 25.0 and fp["comm_hook"] == "bf16_compress"
    assert fp["mesh"] == "{'data': 8}" and fp["buckets"] == 1
    assert fp["state.params['Dense_0']['kernel']"] == "float32[64, 32]"
    assert fp["batch['x']"] == "float32[16, 8, 8, 1]"
    assert re.fullmatch(r"[0-9a-f]{64}", fp[_fingerprint.PROGRAM])
    # One process: nothing to compare with, and the step runs.
    assert _fingerprint.check_across_processes(fp) == _fingerprint.digest(fp)
    step(state, batch)
    assert step._observer.agreed_digest is not None


def test_the_message_lists_every_difference_with_its_processes():
    base = {"bucket_cap_mb": 25.0, "layout": "leaves", "state['w']": "float32[4]"}
    other = {**base, "state['w']": "float32[5]"}
    del other["layout"]
    message = _fingerprint.mismatch_message([base, base, other])
    assert "  layout: leaves on process(es) [0, 1]; (absent) on process(es) [2]" in message
    assert "  state['w']: float32[4] on process(es) [0, 1]; float32[5] on process(es) [2]" in (
        message
    )
    assert "bucket_cap_mb" not in message
    only_program = _fingerprint.mismatch_message(
        [{"x": 1, _fingerprint.PROGRAM: "a"}] * 1 + [{"x": 1, _fingerprint.PROGRAM: "b"}]
    )
    assert "the processes run different code" in only_program


def test_detail_on_an_nnx_step_runs_on_one_process():
    from flax import nnx

    fdp.set_debug_level("DETAIL")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2))
    step(model, optimizer, fdp.shard_batch({"x": jnp.ones((8, 2)), "y": jnp.ones(8)}))
    assert step._observer.agreed_digest is not None
