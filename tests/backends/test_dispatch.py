"""fdp.backends: the platform decides which accelerations a step and fdp.init get."""

import pytest

import fdp
from fdp import backends
from fdp.backends import cpu
from fdp.step.options._config import StepConfig


@pytest.mark.parametrize(
    ("platform", "expected"),
    [("cpu", cpu.BACKEND), ("gpu", backends.GENERIC), ("tpu", backends.GENERIC)],
)
def test_each_platform_gets_its_backend(platform, expected):
    assert backends.for_platform(platform) is expected


def test_generic_backend_changes_nothing():
    assert not backends.GENERIC.fold_dots and not backends.GENERIC.tune_malloc
    assert backends.GENERIC.default_mean_hook(fdp.data_mesh(), 8) is None
    assert cpu.BACKEND.fold_dots and cpu.BACKEND.tune_malloc


def test_a_step_takes_its_accelerations_from_the_dispatch(monkeypatch):
    """Bound on this CPU mesh, fold_dots is on; the same config bound where the dispatch
    says 'generic' keeps it off: the step asks, it does not decide by itself."""
    assert StepConfig().bind().fold_dots is True
    monkeypatch.setattr(backends, "for_platform", lambda platform: backends.GENERIC)
    bound = StepConfig().bind()
    assert bound.fold_dots is False and bound.comm_hook.name == "allreduce"
    assert StepConfig(fold_dots=True).bind().fold_dots is True  # asked for: kept


def test_backend_hooks_are_known_by_name_beside_the_generic_ones():
    assert backends.resolve_hook("shm_allreduce") is cpu.shm_allreduce()
    assert backends.resolve_hook("bf16_compress").name == "bf16_compress"
    assert fdp.Reduction(comm_hook="shm_allreduce").comm_hook is cpu.shm_allreduce()
    with pytest.raises(ValueError, match="known names: allreduce, .*, shm_allreduce"):
        backends.resolve_hook("nope")
