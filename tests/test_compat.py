"""fdp reads JAX internals in one module, and fails closed when one moves.

Each test makes one internal look renamed or missing and checks that fdp raises
JaxCompatibilityError naming the JAX version, instead of carrying on (for the
varying axes, carrying on would reduce gradients twice: N-fold gradients).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import cross_entropy, make_data, make_state

import fdp
from fdp import _compat

VERSION = rf"jax {jax.__version__}"


def test_the_import_time_probe_reads_varying_axes_on_this_jax():
    assert _compat._VARYING_AXES_READABLE is True


def test_unreadable_varying_axes_stop_the_step_before_it_runs(monkeypatch):
    monkeypatch.setattr(_compat, "_VARYING_AXES_READABLE", False)
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn), donate=False)
    with pytest.raises(_compat.JaxCompatibilityError, match=f"{VERSION}.*reduce twice"):
        step(state, fdp.shard_batch(make_data(0, 16)))


def test_a_renamed_aval_field_is_what_the_probe_catches(monkeypatch):
    monkeypatch.setattr(_compat, "_raw_varying_axes", lambda x: None)
    assert _compat._varying_axes_are_readable() is False


def test_the_step_is_exact_with_the_field_read(monkeypatch):
    # The control for the test above: with the field readable, 8 devices give the
    # single-device gradient (not 8x), so the guard is what stands between.
    params = {"w": jnp.zeros(2)}
    state = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(1.0))
    batch = {"x": np.arange(16.0, dtype=np.float32).reshape(8, 2)}

    def loss(p, b):
        return jnp.mean(b["x"] @ p["w"])

    new, _ = fdp.train_step(loss)(fdp.replicate(state), fdp.shard_batch(batch))
    np.testing.assert_allclose(new.params["w"], -batch["x"].mean(0), rtol=1e-6)


def test_a_cond_without_branches_is_an_error_not_a_guess():
    eqn = types.SimpleNamespace(params={"branchez": ()})
    with pytest.raises(_compat.JaxCompatibilityError, match=f"{VERSION}.*'branchez'"):
        _compat.cond_branches(eqn)


def test_a_jitted_function_without_a_cache_size_is_an_error():
    with pytest.raises(_compat.JaxCompatibilityError, match=f"{VERSION}.*_cache_size"):
        _compat.jit_cache_size(lambda: None)
    assert _compat.jit_cache_size(jax.jit(lambda x: x)) == 0


def test_a_coordination_client_missing_methods_is_an_error(monkeypatch):
    from jax._src import distributed  # what _compat reads, made to look moved

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.global_state, "client", object())
    with pytest.raises(_compat.JaxCompatibilityError, match=f"{VERSION}.*key_value_set_bytes"):
        _compat.coordination_client()


def test_no_module_but_compat_imports_jax_internals():
    import pathlib
    import re

    root = pathlib.Path(fdp.__file__).parent
    users = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if re.search(r"^\s*(from|import) jax\._src", p.read_text(), re.M)
    ]
    assert users == ["_compat.py"]
