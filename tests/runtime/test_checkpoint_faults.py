"""fdp.CheckpointManager never drops a save and never loads a damaged checkpoint."""

import contextlib
import glob
import logging
import os
import random
import resource
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _procs import finish, start

import fdp
from fdp.runtime import _ckpt_files


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


def test_a_step_without_checksums_and_nothing_older_is_checksummed_and_restored(tmp_path, caplog):
    # What an fdp without the pending mark left when killed before the checksums
    # (it had let Orbax delete the step before): the step is whole, so it is kept.
    save_steps(tmp_path, [5])
    os.remove(tmp_path / "5" / _ckpt_files.MANIFEST)
    with (
        caplog.at_level(logging.WARNING, "fdp.checkpoint"),
        fdp.CheckpointManager(tmp_path) as ckpt,
    ):
        restored = ckpt.restore(state_of(0))
    assert (restored.step, restored.data_position) == (5, {"step": 5})
    np.testing.assert_array_equal(restored.state["w"], np.full(64, 5.0))
    assert "step=5" in caplog.text and "recorded them now" in caplog.text
    assert _ckpt_files.check(str(tmp_path / "5")) is None


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
        # Wait until a save of this run is complete (sync: `saved s` comes after its
        # checksums; async: `saved s+1` comes once save(s+1) has waited for step s),
        # however slow the machine, then kill it at a random moment.
        lines = [proc.stdout.readline() for _ in range(2 if use_async else 1)]
        assert all(line.startswith("saved") for line in lines), proc.stderr.read()
        complete = int(lines[0].split()[1])
        time.sleep(rng.uniform(0.0, 0.4))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        began = time.monotonic()
        with fdp.CheckpointManager(tmp_path) as ckpt:
            restored = ckpt.restore(template)
        took = time.monotonic() - began
        s = restored.step
        # The step this run completed, or a newer one, never an older one.
        assert s >= max(last, complete) and restored.data_position == {"step": s}, (
            kill,
            s,
            last,
            complete,
        )
        for leaf in jax.tree.leaves(restored.state):
            np.testing.assert_array_equal(leaf, np.full(leaf.shape, s, np.float32))
        assert took < 30
        last = s
    assert last >= 10  # the runs did get further


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_writer_killed_after_orbax_published_a_step_before_its_checksums_loses_nothing(
    tmp_path, marker, use_async
):
    # Issue 32 item 1: with max_to_keep=1, process 0 killed after Orbax published
    # step 3 (and, then, deleted step 2) but before fdp checksummed it; the next
    # start moved step 3 aside as damaged and trained from scratch.
    args = ["tests/workers/ckpt_writer.py", tmp_path, "--keep", "1"]
    args += ["--die-before-checksums-of", "3"] + (["--async"] if use_async else [])
    result = finish(start(args, marker), 120, time.monotonic())
    assert result.returncode == -signal.SIGKILL, result.output
    assert result.stdout.splitlines()[-1] == "dying 3", result.output
    assert not (tmp_path / "3" / _ckpt_files.MANIFEST).exists()
    # The last complete step stays until the new one is complete.
    assert _ckpt_files.check(str(tmp_path / "2")) is None
    template = fdp.replicate({f"w{i}": jnp.zeros((256, 256)) for i in range(8)})
    with fdp.CheckpointManager(tmp_path, max_to_keep=1) as ckpt:
        restored = ckpt.restore(template)
        assert (restored.step, restored.data_position) == (3, {"step": 3})
        for leaf in jax.tree.leaves(restored.state):
            assert leaf.dtype == np.float32
            np.testing.assert_array_equal(leaf, np.full(leaf.shape, 3.0, np.float32))
        ckpt.save(4, restored.state, data_position={"step": 4})  # the run goes on
        assert ckpt.all_steps() == [4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4"]


@contextlib.contextmanager
def disk_full(max_bytes):
    """Writes of a file past `max_bytes` fail (EFBIG), as they would on a full disk."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


# After a failed write, tensorstore's callbacks may reach Orbax's closed event loop
# ("Event loop is closed", raised in a callback, so only reported).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_save_on_a_full_disk_leaves_no_pending_mark_naming_a_missing_step(tmp_path, use_async):
    """Issue 44: after it, the restore left fdp_pending.json naming the step never written."""

    def noise(seed):  # 1 MiB that does not compress
        return fdp.replicate({"w": jax.random.normal(jax.random.key(seed), (1 << 18,))})

    with fdp.CheckpointManager(tmp_path, max_to_keep=None, async_save=use_async) as ckpt:
        ckpt.save(1, noise(1))
        ckpt.wait_until_finished()
        with disk_full(64 * 1024), pytest.raises(Exception, match="File too large"):
            ckpt.save(2, noise(2))
            ckpt.wait_until_finished()
        assert ckpt.all_steps() == [1]
    with fdp.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(noise(0)).step == 1
    assert _ckpt_files.pending_step(str(tmp_path)) is None
    # A writer killed before Orbax published its step leaves such a mark: restore drops it.
    _ckpt_files.mark_pending(str(tmp_path), 3)
    with fdp.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(noise(0)).step == 1
    assert _ckpt_files.pending_step(str(tmp_path)) is None
