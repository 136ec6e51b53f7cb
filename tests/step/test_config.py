"""StepConfig: settings checked once when given, bound to the devices only when used."""

import dataclasses

import jax
import pytest
from _procs import run

import fdp
from fdp.step.options._config import StepConfig

LAZY = """
import jax, jax.numpy as jnp, optax
import fdp
step = fdp.train_step(lambda p, b: jnp.mean(b["x"] @ p["w"]))
nnx_step = fdp.nnx_train_step(lambda m, b: jnp.mean(m(b["x"])))
acc = fdp.grad_accumulator(lambda p, b: jnp.mean(b["x"] @ p["w"]))
jax.config.update("jax_num_cpu_devices", 4)  # allowed: building steps started no backend
state = fdp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
state, metrics = step(fdp.replicate(state), fdp.shard_batch({"x": jnp.ones((8, 2))}))
print(jax.device_count(), step.config.num_replicas, float(metrics["loss"]))
"""


def test_building_a_step_at_module_level_starts_no_backend(marker):
    out = run(["-c", LAZY], marker, timeout=120)
    assert out.returncode == 0, out.output
    assert out.stdout.split() == ["4", "4", "2.0"]


def test_mistakes_are_caught_when_the_config_is_made():
    with pytest.raises(ValueError, match=r"buffers must be one of .*got 'sync'"):
        StepConfig(buffers="sync")
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB"):
        StepConfig(reduction=fdp.Reduction(bucket_cap_mb=-1.0))
    with pytest.raises(TypeError, match="Accumulation.steps must be an int >= 1, got 2.0"):
        StepConfig(accumulation=fdp.Accumulation(steps=2.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="comm_hook='nope' is not a known hook"):
        StepConfig(reduction=fdp.Reduction(comm_hook="nope"))
    with pytest.raises(TypeError, match="reduction must be a fdp.Reduction, got Loss"):
        StepConfig(reduction=fdp.Loss())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        StepConfig(fdp.data_mesh())  # keyword-only


def test_binding_resolves_mesh_and_layout_once():
    cfg = StepConfig(reduction=fdp.Reduction(comm_hook="bf16_compress"))
    assert not cfg.bound and cfg.mesh is None and cfg.layout == "auto"
    with pytest.raises(RuntimeError, match="needs a bound config"):
        cfg.num_replicas  # noqa: B018
    bound = cfg.bind()
    assert bound.bound and bound.num_replicas == 8 and bound.layout == "leaves"
    assert bound.bind() is bound and bound.comm_hook == cfg.comm_hook


def test_a_config_is_hashable_and_equal_by_value():
    mesh = fdp.data_mesh()
    cap = fdp.Reduction(bucket_cap_mb=5.0)
    a = StepConfig(mesh=mesh, reduction=cap, accumulation=fdp.Accumulation(dtype="bfloat16"))
    b = StepConfig(
        mesh=mesh,
        reduction=fdp.Reduction(bucket_cap_mb=5),
        accumulation=fdp.Accumulation(dtype=jax.numpy.bfloat16),
    )
    assert a == b and hash(a) == hash(b)
    assert a != dataclasses.replace(a, reduction=fdp.Reduction(bucket_cap_mb=6.0))


def test_describe_lists_every_setting_as_plain_data():
    cfg = StepConfig(reduction=fdp.Reduction(bucket_cap_mb=5.0)).bind()
    described = cfg.describe()
    policies = {"reduction", "accumulation", "loss", "sharding"}
    names = {f.name for f in dataclasses.fields(StepConfig)} - policies
    for policy in policies:  # flat, under the keywords of fdp 0.1 (logs read the same)
        fields = dataclasses.fields(getattr(cfg, policy))
        names |= {f.metadata.get("old", f.name) for f in fields}
    assert names <= set(described)
    assert described["accumulate_steps"] == 1 and described["zero_stage"] == 0
    assert described["mesh"] == {"data": 8} and described["mesh_device_ids"] == list(range(8))
    assert described["comm_hook"] == "allreduce" and described["bucket_cap_mb"] == 5.0

    def plain(value):
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, str | int | float | bool)

    assert plain(described)


def test_numpy_and_huge_caps_become_plain_floats():
    import numpy as np

    cfg = StepConfig(
        reduction=fdp.Reduction(bucket_cap_mb=np.float32(25), first_bucket_cap_mb=1e308)
    )
    assert (cfg.bucket_cap_mb, cfg.first_bucket_cap_mb) == (25.0, 1e308)
    assert type(cfg.bucket_cap_mb) is float
