"""The CNN examples (Linen and NNX) run, and a resumed run ends where an uninterrupted one does."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", ROOT / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["cnn_linen", "cnn_nnx"])
def test_resumed_run_ends_where_an_uninterrupted_one_does(name, tmp_path, capsys):
    """BatchNorm, dropout, Adam, accumulation, bf16 compression, checkpoint and evaluation."""
    main = load(name).main
    common = ["--ckpt-every", "2", "--batch-size", "32"]
    straight = main(["--steps", "4", "--ckpt-dir", str(tmp_path / "a"), *common])
    main(["--steps", "2", "--ckpt-dir", str(tmp_path / "b"), *common])
    resumed = main(["--steps", "4", "--ckpt-dir", str(tmp_path / "b"), *common])
    assert "resumed from step 2" in capsys.readouterr().out
    # The batches, dropout keys, BatchNorm statistics and Adam moments all come back.
    assert resumed == straight
    assert 0.0 < straight["train_loss"] < 2.5 and 0.1 < straight["test_accuracy"] <= 1.0
