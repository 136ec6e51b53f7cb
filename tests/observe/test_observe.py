"""What observability costs the step: nothing at OFF, and no change to any compiled program.

Also: every bucket's reduction is named (``fdp_bucket_<i>``) in the program, so a
profiler trace shows it by bucket index.
"""

import re

import pytest
from _models import cross_entropy, make_data, make_state
from _procs import run

import fdp
from fdp.observe import _observer

pytestmark = pytest.mark.usefixtures("fdp_debug")

CAPS = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.0005}  # 3 buckets for the MLP


def program(compiled_text):
    """The compiled HLO without its Python source locations.

    The stack-frame tables record where the step was traced from (the observer's
    code or a plain call), which says nothing about what the program does.
    """
    text = re.sub(r" stack_frame_id=\d+", "", compiled_text)
    return re.sub(r"\nFileNames\n.*?\nStackFrames\n.*?\n\n", "\n", text, flags=re.S)


def compiled_after_running(level, **kwargs):
    """Runs a fresh step 3 times at ``level``; returns the program its calls compiled."""
    fdp.set_debug_level(level)
    state = fdp.replicate(make_state("mlp", "sgd"))
    loss = cross_entropy(state.apply_fn)
    traces = []

    def counted(params, batch):
        traces.append(1)
        return loss(params, batch)

    step = fdp.train_step(counted, **CAPS, **kwargs)
    batch = fdp.shard_batch(make_data(0, 16))
    for _ in range(3):
        state, _ = step(state, batch)
    traced = len(traces)
    text = step.lower(state, batch).compile().as_text()
    assert len(traces) == traced == 2  # lower() found the calls' trace: no new one
    return text


def test_the_compiled_step_is_the_same_at_every_level():
    runs = [("OFF", {}), ("INFO", {}), ("DETAIL", {}), ("OFF", {"stats": True})]
    texts = [compiled_after_running(level, **kwargs) for level, kwargs in runs]
    assert all(program(t) == program(texts[0]) for t in texts[1:])
    assert "fdp_bucket_2" in texts[0] and "FileNames" in texts[0]  # the normalising kept ops
    assert "FileNames" not in program(texts[0]) and "all-reduce(" in program(texts[0])
    # Nothing of the host side leaks in: no callbacks, prints or custom calls.
    assert not re.search(r"callback|custom-call|debug_print", texts[0])


def test_off_routes_only_the_first_call_through_the_observer(monkeypatch):
    calls = []
    for entry in ("run", "run_compiled"):  # the first call's and the later calls' entries
        original = getattr(_observer.Observer, entry)
        monkeypatch.setattr(
            _observer.Observer,
            entry,
            lambda self, *args, original=original: (calls.append(1), original(self, *args))[1],
        )
    for level, expected in (("OFF", 1), ("INFO", 5)):
        fdp.set_debug_level(level)
        calls.clear()
        state = fdp.replicate(make_state("mlp", "sgd"))
        step = fdp.train_step(cross_entropy(state.apply_fn))
        batch = fdp.shard_batch(make_data(0, 16))
        for _ in range(5):
            state, _ = step(state, batch)
        assert len(calls) == expected, level


def test_observing_does_not_trace_the_step_again():
    traces = {}
    for level in ("OFF", "DETAIL"):
        fdp.set_debug_level(level)
        state = fdp.replicate(make_state("mlp", "sgd"))
        loss = cross_entropy(state.apply_fn)
        count = [0]

        def counted(params, batch, loss=loss, count=count):
            count[0] += 1
            return loss(params, batch)

        step = fdp.train_step(counted)
        for _ in range(3):
            state, _ = step(state, fdp.shard_batch(make_data(0, 16)))
        traces[level] = count[0]
    assert traces["DETAIL"] == traces["OFF"] == 2  # usage analysis, then the step


def test_each_bucket_reduction_is_named_in_the_program():
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn), **CAPS)
    lowered = step.lower(state, fdp.shard_batch(make_data(0, 16)))
    names = [f"fdp_bucket_{i}" for i in range(len(step.plan.buckets))]
    assert len(names) == 3
    # StableHLO locations (what a profiler of the lowered program shows).
    locations = set(re.findall(r'loc\("(fdp_bucket_\d+)/', lowered.as_text(debug_info=True)))
    assert locations == set(names)
    # Compiled HLO op metadata (what XLA's profiler shows): the CPU compiler merges
    # the buckets' all-reduces into one, whose op_name still names every bucket.
    compiled = lowered.compile().as_text()
    reduce_lines = [line for line in compiled.splitlines() if " all-reduce(" in line]
    in_reduces = set(re.findall(r"fdp_bucket_\d+", " ".join(reduce_lines)))
    assert in_reduces == set(names)


PROFILE = """
import re, sys, pathlib
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, "tests")
import fdp
from _models import cross_entropy, make_data, make_state
from _procs import run
state = fdp.replicate(make_state("mlp", "sgd"))
step = fdp.train_step(cross_entropy(state.apply_fn), bucket_cap_mb=0.002, first_bucket_cap_mb=5e-4)
batch = fdp.shard_batch(make_data(0, 16))
state, _ = step(state, batch)
with jax.profiler.trace(sys.argv[1]):
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
(profile,) = pathlib.Path(sys.argv[1]).glob("plugins/profile/*/*.xplane.pb")
print(sorted(set(re.findall(rb"fdp_bucket_\\d+", profile.read_bytes()))))
"""


def test_a_profile_names_each_bucket(tmp_path, marker):
    """The XPlane profile (TensorBoard / XProf) carries the op names, so the buckets.

    In a fresh process: a profile also describes other programs the process compiled.
    """
    out = run(["-c", PROFILE, tmp_path], marker, timeout=120)
    assert out.returncode == 0, out.output
    assert out.stdout.strip() == "[b'fdp_bucket_0', b'fdp_bucket_1', b'fdp_bucket_2']"
