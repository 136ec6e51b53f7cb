"""examples/gpt.py trains what one device trains on the whole batch, and resumes exactly."""

import functools
import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _procs import run as run_marked
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A small model: 1 block of width 32, 16-character context, 16 sequences per step in
# 2 micro-batches of 8 (one sequence per device each), no sampling.
TINY = [
    "--block", "16", "--d-model", "32", "--heads", "2", "--layers", "1",
    "--batch-size", "16", "--accumulate-steps", "2", "--warmup", "2",
    "--eval-batches", "1", "--eval-every", "1000", "--sample", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def gpt():
    spec = importlib.util.spec_from_file_location("example_gpt", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


@functools.cache
def reference(gpt, argv):
    """Plain Flax NNX on one device: ``nnx.jit``, the whole batch, no accumulation."""
    args = gpt.parse(list(argv))
    train, held_out = gpt.split_corpus()
    device = jax.devices()[0]
    with jax.default_device(device):
        model = gpt.GPT(gpt.config_from(args), nnx.Rngs(params=args.seed, dropout=args.seed + 1))
        optimizer = gpt.optimizer_for(model, args)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(gpt.loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = []
    for i in range(args.steps):
        batch = gpt.batch_at(train, i, args.batch_size, args.block, args.seed)
        losses.append(float(step(model, optimizer, jax.device_put(batch, device))))
    model.eval()
    evals = [gpt.loss_fn(model, b) for b in gpt.held_out_batches(held_out, args)]
    return losses, float(np.mean([float(x) for x in evals]))


@pytest.mark.parametrize("zero_stage", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_losses_equal_one_device_on_the_whole_batch(gpt, zero_stage):
    """8 devices, accumulation, AdamW + schedule + clipping; ZeRO-3 shards everything."""
    argv = (*TINY, "--steps", "3", "--dropout", "0")
    result = gpt.main([*argv, "--zero-stage", str(zero_stage)])
    losses, eval_loss = reference(gpt, argv)  # the same for every stage
    np.testing.assert_allclose(result["losses"], losses, rtol=2e-5)
    # The held-out loss is computed with the parameters after the last step.
    np.testing.assert_allclose(result["eval_loss"], eval_loss, rtol=2e-5)
    assert losses[-1] < losses[0]
    assert result["tokens_per_s"] > 0 and result["params"] == 19_520


@pytest.mark.slow
def test_resumed_run_ends_where_an_uninterrupted_one_does(gpt, tmp_path, capsys):
    """Checkpoint every 2 steps, stop after 2, resume: dropout streams and Adam come back."""
    common = [*TINY, "--ckpt-every", "2", "--dropout", "0.1", "--zero-stage", "3"]
    straight = gpt.main([*common, "--steps", "4", "--ckpt-dir", str(tmp_path / "a")])
    gpt.main([*common, "--steps", "2", "--ckpt-dir", str(tmp_path / "b")])
    resumed = gpt.main([*common, "--steps", "4", "--ckpt-dir", str(tmp_path / "b")])
    assert "resumed from step 2" in capsys.readouterr().out
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["eval_loss"] == straight["eval_loss"]


@pytest.mark.slow
def test_two_processes_under_fdp_launch_train_as_one_device(gpt, marker, tmp_path):
    """fdp launch, 2 processes x 4 devices, ZeRO-3: the same losses as one device."""
    argv = (*TINY, "--steps", "3", "--dropout", "0")
    out = run_marked(
        [
            "-m",
            "fdp.launch",
            "--nproc-per-node",
            "2",
            "examples/gpt.py",
            *argv,
            "--zero-stage",
            "3",
            "--sample",
            "20",
            "--json",
            str(tmp_path / "result.json"),
        ],
        marker,
        timeout=240,
    )
    assert out.returncode == 0, out.output
    assert "8 devices, 2 process(es)" in out.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    losses, eval_loss = reference(gpt, argv)
    np.testing.assert_allclose(result["losses"], losses, rtol=2e-5)
    np.testing.assert_allclose(result["eval_loss"], eval_loss, rtol=2e-5)
    assert len(result["sample"]) == len("The ") + 20


def test_corpus_is_the_standard_librarys_docstrings(gpt):
    text = gpt.corpus()
    assert len(text) > 100_000 and set(text) <= set(gpt.CHARS)
    assert gpt.decode(gpt.encode("Return the")) == "Return the"
    assert jnp.asarray(gpt.encode(text[:10])).dtype == jnp.int32
