"""fdp reads JAX internals in one module, and fails closed when one moves.

Each test makes one internal look renamed or missing and checks that fdp raises
JaxCompatibilityError naming the JAX version, instead of carrying on (for the
varying axes, carrying on would reduce gradients twice: N-fold gradients).
"""

import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import cross_entropy, make_data, make_state

import fdp
from fdp import _compat

VERSION = rf"jax {jax.__version__}"


def test_the_probes_read_this_jax():
    assert _compat._varying_axes_readable() is True
    assert _compat._auto_reduction_readable() is True


def test_the_probes_hold_inside_a_trace_and_under_a_context_mesh():
    """Run first inside a step's trace, they must not see its mesh (they run on a thread)."""
    seen = []

    def body(x):
        seen.append(
            (
                _compat._on_fresh_thread(_compat._probe_varying_axes),
                _compat._on_fresh_thread(_compat._probe_auto_reduction),
            )
        )
        return x

    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        spec = jax.sharding.PartitionSpec()
        jax.make_jaxpr(jax.shard_map(body, in_specs=spec, out_specs=spec))(jnp.ones(8))
    # (Run in place, jax 0.10.2 refuses the probe's mesh: it is not the context mesh.)
    assert seen == [(True, True)]


IMPORT = """
import sys
import fdp
from fdp import _compat
print(_compat._varying_axes_readable.cache_info().currsize,
      _compat._auto_reduction_readable.cache_info().currsize,
      sorted(m for m in sys.modules if m.startswith("orbax")))
"""


def test_import_fdp_traces_no_probe_and_leaves_orbax_alone():
    """On main, `import fdp` traced the varying-axes probe and imported orbax (~150 ms)."""
    out = subprocess.run(
        [sys.executable, "-c", IMPORT], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split("\n")[-2] == "0 0 []", out.stdout + out.stderr


def test_unreadable_varying_axes_stop_the_step_before_it_runs(monkeypatch):
    monkeypatch.setattr(_compat, "_varying_axes_readable", lambda: False)
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(state.apply_fn), donate=False)
    with pytest.raises(_compat.JaxCompatibilityError, match=f"{VERSION}.*reduce twice"):
        step(state, fdp.shard_batch(make_data(0, 16)))


def test_a_renamed_aval_field_is_what_the_probe_catches(monkeypatch):
    monkeypatch.setattr(_compat, "_raw_varying_axes", lambda x: None)
    assert _compat._probe_varying_axes() is False


def test_a_renamed_auto_reduction_stops_fdp_ddp_naming_jax(monkeypatch):
    monkeypatch.setattr(_compat, "AUTO_REDUCTION_PRIMITIVE", "psum_invariant_renamed")
    assert _compat._probe_auto_reduction() is False
    monkeypatch.setattr(_compat, "_auto_reduction_readable", _compat._probe_auto_reduction)

    @fdp.ddp(batch_argnums=1)
    def step(w, x):  # forgets fdp.reduce_gradients: only the primitive would tell
        return w - jax.grad(lambda w: jnp.mean(x @ w))(w)

    with pytest.raises(_compat.JaxCompatibilityError, match=f"{VERSION}.*psum_invariant_renamed"):
        step(jnp.ones(2), np.ones((8, 2), np.float32))


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


def test_an_experimental_compile_option_this_xla_lacks_is_left_out_with_a_warning(monkeypatch):
    """jaxlib 0.11.2 dropped an option a per-use step sets: compile without it, and say so."""
    device = jax.devices()[0]
    missing = "xla_gpu_fdp_test_option_that_no_xla_has"
    monkeypatch.setitem(_compat._OPTIONAL_OPTION_EFFECTS, missing, "nothing happens")
    options = {missing: True, _compat.GPU_PIPELINED_REDUCE_SCATTER: False, "kept": 1}
    with pytest.warns(UserWarning, match=rf"no compile option '{missing}'.*so nothing happens"):
        kept = _compat.known_compile_options(device, options)
    # This jaxlib has the real option (under its jax 0.12 name there); an option fdp does
    # not mark optional is passed on.
    real = (
        {_compat.GPU_PIPELINED_REDUCE_SCATTER: False}
        if _compat._knows_compile_option(device, _compat.GPU_PIPELINED_REDUCE_SCATTER, False)
        else {_compat.GPU_PIPELINE_REDUCE_SCATTER: "COLLECTIVE_PIPELINING_MODE_OFF"}
    )
    assert kept == {**real, "kept": 1}


def test_the_reduce_scatter_pipeliner_switch_reaches_this_xla_under_one_of_its_names():
    device = jax.devices()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither name known would warn
        kept = _compat.known_compile_options(device, {_compat.GPU_PIPELINED_REDUCE_SCATTER: True})
    assert len(kept) == 1
    ((name, value),) = kept.items()
    jax.jit(lambda v: v + 1).lower(1.0).compile(compiler_options={name: value})


def test_an_unknown_core_compile_option_still_fails_the_compilation():
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda v: v + 1).lower(1.0).compile(compiler_options={"xla_fdp_no_such": True})
    assert not _compat._knows_compile_option(jax.devices()[0], "xla_fdp_no_such_either", 1)
