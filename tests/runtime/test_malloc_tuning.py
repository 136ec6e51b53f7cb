"""fdp.init's host malloc tuning: the switch, and the same training with it on and off."""

import numpy as np
import pytest
from _procs import launch

from fdp import backends
from fdp.backends.cpu import _memory

TWO = ["--nproc-per-node", "2"]


@pytest.mark.parametrize(
    ("argument", "env", "expected"),
    [
        (None, None, None),  # nothing said: fdp.init tunes
        (None, "0", False),
        (None, "off", False),
        (None, "1", True),
        (True, "0", True),  # the argument wins
        (False, None, False),
    ],
)
def test_the_argument_and_the_variable_decide(argument, env, expected):
    environ = {} if env is None else {_memory.ENV_VAR: env}
    assert _memory.wanted(argument, environ) is expected


def test_a_malformed_variable_is_named():
    with pytest.raises(ValueError, match="FDP_MALLOC_TUNING='maybe' is not understood"):
        _memory.wanted(None, {"FDP_MALLOC_TUNING": "maybe"})


@pytest.mark.parametrize(
    ("argument", "env", "calls"),
    [(None, None, 1), (True, None, 1), (None, "1", 1), (False, None, 0), (None, "0", 0)],
)
def test_one_process_tunes_unless_told_not_to(monkeypatch, argument, env, calls):
    """fdp.init with one process tunes malloc too: one CPU process faults its buffers in
    every step as several do (docs/multihost.md)."""
    assert tunings(monkeypatch, argument, env, visible_gpus="") == calls


def tunings(monkeypatch, argument, env, *, visible_gpus):
    """How many times fdp.init tunes malloc with these settings on a host with those GPUs."""
    import fdp

    made = []
    monkeypatch.setattr(_memory, "tune_malloc", lambda: made.append(1))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_gpus)  # "": no GPU on this host
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    if env is None:
        monkeypatch.delenv(_memory.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(_memory.ENV_VAR, env)
    fdp.init(tune_malloc=argument)
    return len(made)


@pytest.mark.parametrize(("env", "expected"), [(None, "M_MMAP_MAX"), ("0", "{}")])
def test_one_real_process_applies_the_settings(env, expected):
    """In a fresh interpreter (glibc's real mallopt), alone, unless FDP_MALLOC_TUNING=0."""
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if not k.startswith("FDP_")}
    environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU host, where fdp.init tunes by default
    environ.pop("JAX_PLATFORMS", None)
    if env is not None:
        environ[_memory.ENV_VAR] = env
    code = "import fdp; fdp.init(); from fdp.backends.cpu import _memory; print(_memory.applied)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout.splitlines()[-1]


def load(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k[4:]))]


def test_two_processes_train_the_same_with_and_without_tuning(tmp_path, marker):
    """The gloo reduction path with glibc tuned (the default) ends where today's does."""
    runs = {}
    for name, env in (("tuned", {}), ("untuned", {"FDP_MALLOC_TUNING": "0"})):
        out = launch(TWO, "malloc_tuning.py", ["--out", tmp_path / f"{name}.npz"], marker, **env)
        assert out.returncode == 0, out.output
        runs[name] = (load(tmp_path / f"{name}.npz"), out.stdout)
    tuned, untuned = runs["tuned"][0], runs["untuned"][0]
    # Both processes of each run say what fdp.init did.
    settings = "[('M_ARENA_MAX', 1), ('M_MMAP_MAX', 0), ('M_TRIM_THRESHOLD', 1073741824)]"
    assert runs["tuned"][1].count(f"malloc settings: {settings}") == 2, runs["tuned"][1]
    assert runs["untuned"][1].count("malloc settings: []") == 2, runs["untuned"][1]
    assert len(tuned) == len(untuned) == 6
    for i, (a, b) in enumerate(zip(tuned, untuned, strict=True)):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"leaf {i}")
    # Leaves in tree order: b, w of each layer. The first kernel moved from its start.
    start = np.random.default_rng(0).normal(size=(256, 512)).astype(np.float32) / np.sqrt(256)
    assert tuned[1].shape == start.shape
    assert np.abs(tuned[1] - start).max() > 1e-3, "training moved nothing"


@pytest.mark.parametrize(
    ("argument", "env", "calls"),
    [(None, None, 0), (True, None, 1), (None, "1", 1), (False, None, 0), (None, "0", 0)],
)
def test_a_gpu_host_tunes_only_when_asked(monkeypatch, argument, env, calls):
    """On a GPU host XLA's buffers live in GPU memory: malloc tuning was never measured there."""
    assert tunings(monkeypatch, argument, env, visible_gpus="0,1") == calls


def test_gpu_hosts_are_told_without_starting_jax(tmp_path):
    assert not backends.gpu_host({}, dev=str(tmp_path))
    (tmp_path / "nvidia0").touch()
    assert backends.gpu_host({}, dev=str(tmp_path))
    assert not backends.gpu_host({"CUDA_VISIBLE_DEVICES": ""}, dev=str(tmp_path))
    assert not backends.gpu_host({"JAX_PLATFORMS": "cpu"}, dev=str(tmp_path))
    assert backends.gpu_host({"JAX_PLATFORMS": "cuda,cpu"}, dev=str(tmp_path))
