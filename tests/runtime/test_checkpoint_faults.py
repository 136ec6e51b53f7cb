"""fdp.CheckpointManager never drops a save and never loads a damaged checkpoint."""

import glob
import logging
import os
import random
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _procs import start

import fdp


def state_of(value, dtype=jnp.float32):
    return fdp.replicate(
        {"w": jnp.full((64,), value, dtype), "b": jnp.full((4, 4), value, jnp.float32)}
    )


def save_steps(path, steps, **kw):
    with fdp.CheckpointManager(path, max_to_keep=None, **kw) as ckpt:
        for s in steps:
            ckpt.save(s, state_of(s), data_position={"step": s})


def test_a_save_at_or_below_the_newest_step_raises_naming_both(tmp_path):
    # The reproduction: a run restarted from scratch in an old directory.
    save_steps(tmp_path, [100])
    with fdp.CheckpointManager(tmp_path) as ckpt:
        for s in (20, 100):
            with pytest.raises(
                ValueError, match=rf"step={s}: the newest .* is step 100.*overwrite=True"
            ):
                ckpt.save(s, state_of(s))
        assert ckpt.all_steps() == [100]
        np.testing.assert_array_equal(ckpt.restore(state_of(0)).state["w"], np.full(64, 100.0))


def test_overwrite_replaces_the_step_and_drops_newer_ones(tmp_path):
    save_steps(tmp_path, [20, 40, 100])
    with fdp.CheckpointManager(tmp_path, max_to_keep=None) as ckpt:
        ckpt.save(40, state_of(-4.0), overwrite=True)
        ckpt.save(60, state_of(6.0))
        assert ckpt.all_steps() == [20, 40, 60]
        np.testing.assert_array_equal(ckpt.restore(state_of(0), step=40).state["w"], -4.0)


def flip(path):
    """Flips 8 bytes in the middle of the file (the issue's measured fault)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(8)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


FAULTS = {
    "bit flip in array data": ("state/ocdbt.process_0/d/*", flip),
    "truncated array data": ("state/ocdbt.process_0/d/*", truncate),
    "truncated metadata": ("state/_METADATA", truncate),
    "deleted metadata": ("state/_METADATA", os.remove),
    "deleted data position": ("data_position/metadata", os.remove),
    "save never finished (no checksums)": ("fdp_checksums.json", os.remove),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_newest_step_is_skipped_with_a_warning(tmp_path, fault, caplog):
    save_steps(tmp_path, [1, 2])
    pattern, damage = FAULTS[fault]
    for path in glob.glob(str(tmp_path / "2" / pattern)):
        damage(path)
    with (
        caplog.at_level(logging.WARNING, "fdp.checkpoint"),
        fdp.CheckpointManager(tmp_path) as ckpt,
    ):
        restored = ckpt.restore(state_of(0))
        assert (restored.step, restored.data_position) == (1, {"step": 1})
        np.testing.assert_array_equal(restored.state["w"], np.full(64, 1.0))
        assert ckpt.all_steps() == [1]
        ckpt.save(2, state_of(2))  # the resumed run saves step 2 again
        assert ckpt.restore(state_of(0)).step == 2
    assert "step=2" in caplog.text and "restoring step=1" in caplog.text
    assert (tmp_path / "2.fdp-corrupt").is_dir()


def test_a_damaged_step_asked_for_by_number_is_an_error_naming_it(tmp_path):
    save_steps(tmp_path, [1, 2])
    flip(glob.glob(str(tmp_path / "2/state/ocdbt.process_0/d/*"))[0])
    with fdp.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(
            fdp.CorruptCheckpointError, match=r"step=2 .*checksum.*older step .*\[1\]"
        ):
            ckpt.restore(state_of(0), step=2)
        assert ckpt.restore(state_of(0), step=1).step == 1


def test_when_every_step_is_damaged_nothing_is_loaded_and_a_restart_starts_afresh(tmp_path):
    save_steps(tmp_path, [1])
    truncate(glob.glob(str(tmp_path / "1/state/ocdbt.process_0/d/*"))[0])
    with (
        fdp.CheckpointManager(tmp_path) as ckpt,
        pytest.raises(
            fdp.CorruptCheckpointError, match=r"any checkpoint .*1: .*from the beginning"
        ),
    ):
        ckpt.restore(state_of(0))
    with fdp.CheckpointManager(tmp_path) as ckpt:  # the next attempt: no checkpoint
        assert ckpt.all_steps() == []
    assert (tmp_path / "1.fdp-corrupt").is_dir()


def test_a_template_that_differs_names_every_leaf(tmp_path):
    save_steps(tmp_path, [3])
    template = {"w": jnp.zeros(64, jnp.bfloat16), "c": jnp.zeros(2)}
    with fdp.CheckpointManager(tmp_path) as ckpt, pytest.raises(ValueError) as err:
        ckpt.restore(template)
    message = str(err.value)
    assert "partial_restore" not in message
    assert "b: in the checkpoint, not in the template" in message
    assert "c: in the template, not in the checkpoint" in message
    assert (
        "w: saved float32[64], template bfloat16[64] (dtype differs: restoring would be a lossy"
        in message
    )


def test_a_shape_that_differs_is_named(tmp_path):
    save_steps(tmp_path, [3])
    with (
        fdp.CheckpointManager(tmp_path) as ckpt,
        pytest.raises(ValueError, match=r"w: saved float32\[64\], template float32\[32\] \(shape"),
    ):
        ckpt.restore({"w": jnp.zeros(32), "b": jnp.zeros((4, 4))})


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_killing_the_writer_at_random_moments_never_loses_the_last_intact_step(
    tmp_path, marker, use_async
):
    rng = random.Random(15)
    args = ["tests/workers/ckpt_writer.py", tmp_path] + (["--async"] if use_async else [])
    template = fdp.replicate({f"w{i}": jnp.zeros((256, 256)) for i in range(8)})
    last = 0
    for kill in range(10):
        proc = start(args, marker)
        # Wait for the first save of this run, then kill it at a random moment.
        assert proc.stdout.readline().startswith("saved"), proc.stderr.read()
        time.sleep(rng.uniform(0.0, 0.4))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        began = time.monotonic()
        with fdp.CheckpointManager(tmp_path) as ckpt:
            try:
                restored = ckpt.restore(template)
            except (FileNotFoundError, fdp.CorruptCheckpointError):
                assert last == 0, kill  # only before any save has ever finished
                continue
        took = time.monotonic() - began
        s = restored.step
        # A run killed before its first save finished adds no step: the last one stays.
        assert s >= last and restored.data_position == {"step": s}, (kill, s, last)
        for leaf in jax.tree.leaves(restored.state):
            np.testing.assert_array_equal(leaf, np.full(leaf.shape, s, np.float32))
        assert took < 30
        last = s
    assert last >= 10  # the runs did get further
