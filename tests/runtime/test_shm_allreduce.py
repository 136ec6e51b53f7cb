"""comm_hook='shm_allreduce': gloo's sum through shared memory, across real processes.

The worker (tests/workers/shm_sum.py) trains the same start with 'allreduce' and
'shm_allreduce' under `fdp launch`, 2 processes x 1 CPU device, and stalls one rank
before a last shared-memory sum. tests/workers/shm_default.py trains with no hook: fdp's
default, which sums through shared memory when every process agrees it can.
"""

import uuid

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _procs import launch, survivors
from flax.training.train_state import TrainState

import fdp
from fdp.backends.cpu import _shm


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shm")
    tag = uuid.uuid4().hex
    try:
        done = launch(["--nproc-per-node", "2"], "shm_sum.py", ["--out", out], tag)
    finally:
        left = survivors(tag)
    assert done.returncode == 0 and not left, done.output
    ranks = [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]
    return ranks, [(out / f"stall{r}.txt").read_text() for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_bucket_sum_has_numpys_bits_of_the_scaled_sum(tmp_path, world):
    """One call sums a bucket of four arrays, each element as x0 * s + x1 * s (+ x2 * s)
    in float32, in rank order (chunk boundaries fall inside arrays): numpy's rounding, bit
    for bit, on every rank, on every call."""
    tag = uuid.uuid4().hex
    try:
        nproc = ["--nproc-per-node", str(world)]
        done = launch(nproc, "shm_bucket_sum.py", ["--out", tmp_path], tag)
    finally:
        left = survivors(tag)
    assert done.returncode == 0 and not left, done.output
    draws = np.random.default_rng(3)
    sizes = (7, 1001, 2, 31)
    data = [[draws.normal(size=(1, n)).astype(np.float32) for n in sizes] for _ in range(world)]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]
    for name, scale in (("mean", np.float32(1) / np.float32(world)), ("0.3", np.float32(0.3))):
        for i in range(len(sizes)):
            expected = data[0][i] * scale
            for q in range(1, world):
                expected = expected + data[q][i] * scale
            assert expected.dtype == np.float32
            for r, got in enumerate(ranks):
                assert got[f"{name}/aliased"], "the sums did not run in place of their inputs"
                for call in range(3):
                    np.testing.assert_array_equal(got[f"{name}/{call}/{i}"], expected, f"{r}")
    for got in ranks:  # a bucket split otherwise on another rank is an error, not a sum
        assert "split into different buffers" in str(got["split_error"]), got["split_error"]


def test_the_scale_rounds_as_xla_divides_by_the_world_size():
    """The hook multiplies by float32(1) / float32(n): XLA:CPU's ``g / n`` is that
    multiplication, which for n = 3 is not the true quotient."""
    x = np.random.default_rng(0).normal(size=4096).astype(np.float32)
    for n in (2, 3, 6, 7):
        xla = np.asarray(jax.jit(lambda v, n=n: v / jnp.asarray(n, v.dtype))(x))
        np.testing.assert_array_equal(xla, x * (np.float32(1) / np.float32(n)), f"n={n}")
        if n == 3:
            assert not np.array_equal(xla, x / np.float32(3))  # the check can fail


@pytest.mark.multiprocess
@pytest.mark.slow
def test_buckets_are_summed_unpacked_one_call_each(two_processes):
    """Either layout: one call per bucket on the gradients as they are. The packing that
    XLA's flat all-reduce needs (concatenate or dynamic-update-slice) is not there."""
    (rank0, _), _ = two_processes
    for layout in ("flat", "leaves"):
        calls = rank0[f"calls/{layout}/shm_allreduce"]
        assert len(calls) > 1 and (calls - 1).sum() == 6, calls  # 6 leaves, token first
    assert rank0["calls/flat/allreduce"].size == 0
    unpacked = rank0["packs/leaves/allreduce"]
    assert rank0["packs/flat/allreduce"] > unpacked  # the check can fail
    assert rank0["packs/flat/shm_allreduce"] == unpacked


@pytest.mark.multiprocess
@pytest.mark.slow
def test_both_layouts_give_the_bits_of_the_gloo_all_reduce_of_unpacked_gradients(two_processes):
    """4 Adam steps: exactly the parameters of XLA's gloo all-reduce in the 'leaves' layout
    (the same gradients, each element a / 2 + b / 2). XLA's 'flat' program computes some
    gradients in the fusions that pack them, which round differently (~1e-7)."""
    (rank0, rank1), _ = two_processes
    keys = [k for k in rank0 if k.startswith(("flat/shm_allreduce/", "leaves/shm_allreduce/"))]
    assert len(keys) == 12
    for key in keys:
        leaf = key.split("/", 2)[2]
        np.testing.assert_array_equal(rank0[key], rank0[f"leaves/allreduce/{leaf}"], key)
        flat = rank0[f"flat/allreduce/{leaf}"]
        np.testing.assert_allclose(rank0[key], flat, rtol=1e-6, atol=1e-8, err_msg=key)
        # Each rank trained on its own data: only a real sum makes them agree.
        np.testing.assert_array_equal(rank1[key], rank0[key], err_msg=key)
        assert np.abs(rank0[key] - rank0[f"start/{leaf}"]).max() > 1e-3, key


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stalled_peer_is_an_error_naming_its_rank(two_processes):
    _, (stall, late) = two_processes
    assert stall.startswith("JaxRuntimeError"), stall
    assert "for rank(s) 1, which did not arrive" in stall
    seconds = float(stall.split(" after ")[1].split(" s:")[0])
    assert 1.9 <= seconds < 4.5, stall  # the 2 s timeout, not rank 1's 5 s sleep
    # The late rank is not left waiting, nor handed stale data: the group is closed.
    assert "rank 0 failed an earlier sum, so this group is unusable" in late, late


def test_one_process_with_several_devices_is_refused_with_the_fix():
    state = fdp.replicate(
        TrainState.create(apply_fn=None, params={"w": np.ones(4, np.float32)}, tx=optax.sgd(0.1))
    )
    step = fdp.train_step(lambda p, b: (b["x"] @ p["w"]).mean(), comm_hook="shm_allreduce")
    batch = fdp.shard_batch({"x": np.ones((8, 4), np.float32)})
    with pytest.raises(ValueError, match="one device per process.*comm_hook='allreduce'"):
        step(state, batch)


def test_capacity_setting_is_checked(monkeypatch):
    monkeypatch.setenv(_shm.CAPACITY_ENV, "lots")
    with pytest.raises(ValueError, match="FDP_SHM_CAPACITY_MB must be a positive number"):
        _shm._capacity()


def test_the_hook_is_known_by_name():
    assert fdp.backends.resolve_hook("shm_allreduce") is fdp.backends.cpu.shm_allreduce()


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    """shm_default.py under `fdp launch`, 2 processes: as they are, with rank 1 opted out
    (FDP_SHM_ALLREDUCE=0), with rank 1 unable to compile the sum, and with room for
    buckets of 10,432 bytes only (FDP_SHM_CAPACITY_MB=0.01: the tiny buckets fit, the
    whole model's 11,260 bytes do not)."""
    runs = {}
    for mode, rank1, env in (
        ("none", "none", {}),
        ("off", "off", {}),
        ("no-compiler", "no-compiler", {}),
        ("small", "none", {"FDP_SHM_CAPACITY_MB": "0.01"}),
    ):
        out = tmp_path_factory.mktemp(f"default-{mode}")
        tag = uuid.uuid4().hex
        try:
            args = ["--out", out, "--rank1", rank1]
            done = launch(["--nproc-per-node", "2"], "shm_default.py", args, tag, **env)
        finally:
            left = survivors(tag)
        assert done.returncode == 0 and not left, done.output
        runs[mode] = [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]
    return runs


def _params(rank, name):
    return {k.split("/", 1)[1]: v for k, v in rank.items() if k.startswith(f"{name}/")}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_default_hook_sums_through_shared_memory_on_one_host(default_runs):
    """No comm_hook, 2 CPU processes on one host: one shared-memory call per bucket and
    only the loss's all-reduce left to XLA; the parameters are those of XLA's all-reduce
    ('leaves': bit for bit; 'flat', today's default layout: within 1e-6)."""
    for rank in default_runs["none"]:
        assert rank["default:shm_calls"] == rank["default:buckets"] > 1
        assert rank["default:all_reduces"] == 1  # the loss
        # DDP's mean, named for its transport (on main it called itself "allreduce").
        assert str(rank["default:hook"]) == "shm_where_possible"
        assert "summed through shared memory by the 2 processes" in str(rank["log"])
        got, leaves = _params(rank, "default"), _params(rank, "allreduce-leaves")
        flat = _params(rank, "allreduce-flat")
        assert len(got) == 6
        for key, value in got.items():
            np.testing.assert_array_equal(value, leaves[key], key)
            np.testing.assert_allclose(value, flat[key], rtol=1e-6, atol=1e-8, err_msg=key)
            np.testing.assert_array_equal(value, _params(default_runs["none"][0], "default")[key])
        # A later program's larger bucket is agreed on again, and summed there too.
        assert rank["big:shm_calls"] == rank["big:buckets"] == 1
        big, xla = _params(rank, "big"), _params(rank, "big-allreduce")
        for key, value in big.items():
            np.testing.assert_allclose(value, xla[key], rtol=1e-6, atol=1e-8, err_msg=key)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_later_bucket_that_some_process_cannot_hold_goes_through_xla(default_runs):
    """Room for 10,432 bytes: the first program's tiny buckets are summed in shared
    memory; the later program's 11,260-byte bucket goes through XLA's all-reduce on
    every process (agreed, not one rank failing), with a warning that names the size."""
    for rank in default_runs["small"]:
        assert rank["default:shm_calls"] == rank["default:buckets"] > 1
        assert rank["big:shm_calls"] == 0 and rank["big:all_reduces"] == 2
        assert (
            "buckets of 11,260 bytes and more go through XLA's all-reduce, not shared memory "
            "(rank 0: a bucket of 11,260 bytes is over FDP_SHM_CAPACITY_MB; rank 1:"
        ) in str(rank["log"])
        big, xla = _params(rank, "big"), _params(rank, "big-allreduce")
        for key, value in big.items():
            np.testing.assert_array_equal(value, xla[key], key)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("rank1", "why"),
    [
        ("off", "rank 1: FDP_SHM_ALLREDUCE=0"),
        ("no-compiler", "rank 1: comm_hook='shm_allreduce' could not run the C++ compiler"),
    ],
)
def test_one_process_that_cannot_or_will_not_keeps_xla_everywhere(default_runs, rank1, why):
    """When one process opts out or has no compiler, every process keeps XLA's all-reduce
    (no hang, no mixed program), and each one's log names the rank and the reason."""
    for rank in default_runs[rank1]:
        assert rank["default:shm_calls"] == 0 and rank["big:shm_calls"] == 0
        assert rank["default:all_reduces"] == rank["default:buckets"] + 1
        assert f"gradients go through XLA's all-reduce, not shared memory ({why}" in str(
            rank["log"]
        )
        for name, xla in (("default", "allreduce-flat"), ("big", "big-allreduce")):
            got, want = _params(rank, name), _params(rank, xla)
            for key, value in got.items():
                np.testing.assert_array_equal(value, want[key], f"{name} {key}")


def test_the_switch_names_itself_when_it_is_neither_on_nor_off(monkeypatch):
    for value, off in (("0", True), ("off", True), ("1", False), ("", False), ("TRUE", False)):
        monkeypatch.setenv(_shm.ENABLE_ENV, value)
        assert bool(_shm._switched_off()) is off, value
    monkeypatch.setenv(_shm.ENABLE_ENV, "sometimes")
    with pytest.raises(ValueError, match="FDP_SHM_ALLREDUCE must be 1 or 0.*'sometimes'"):
        _shm._switched_off()


def test_one_process_keeps_the_default_hook_as_it_is():
    """In one process (this test's 8 CPU devices) the step binds no shared-memory sum."""
    from fdp.hooks._basic import is_default
    from fdp.step.options._config import StepConfig

    bound = StepConfig().bind()
    assert is_default(bound.comm_hook) and bound.check_vma
    assert not is_default(StepConfig(reduction=fdp.Reduction(comm_hook="allreduce")).comm_hook)
