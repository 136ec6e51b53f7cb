"""Fixtures for tests that start real processes, and for tests that set the debug level."""

import logging
import sys
import uuid

import pytest
from _procs import survivors

# Worker scripts run as programs in child processes; --doctest-modules must not import them.
collect_ignore = ["workers"]


def pytest_collection_modifyitems(items):
    # A test that starts real processes asks for `marker`: mark it `multiprocess`.
    for item in items:
        if "marker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture
def marker():
    """A marker in every child's environment; after the test, none may be alive."""
    if not sys.platform.startswith("linux"):
        pytest.skip("finds leftover processes through /proc (Linux)")
    tag = uuid.uuid4().hex
    yield tag
    left = survivors(tag)
    assert not left, f"processes outlived the test (now killed): {left}"


@pytest.fixture
def fdp_debug(monkeypatch):
    """The debug level starts OFF (FDP_DEBUG unset); the "fdp" logger is restored after."""
    from fdp.observe import _debug

    monkeypatch.delenv("FDP_DEBUG", raising=False)
    logger = logging.getLogger("fdp")
    handlers, level, level_set = list(logger.handlers), logger.level, _debug._level_set
    yield
    _debug._override, _debug._level_set = None, level_set
    logger.handlers[:] = handlers
    logger.setLevel(level)  # (also clears the loggers' cached levels)


@pytest.fixture(scope="session")
def gpu_mesh():
    """8 compile-only H100s (XLA's GPU compiler, no GPU): the GPU compile tier's mesh.

    The compiler is fdp's copy of the CUDA plugin (`fdp gpu-compiler --install`). When it
    is missing, the tier installs it once (FDP_GPU_COMPILER_INSTALL=0 says not to) and
    skips, with the reason, where that fails (no package index, another jaxlib).
    """
    import os

    from fdp.observe import _gpu

    status = _gpu.gpu_compiler_status()
    if status is not None and os.environ.get("FDP_GPU_COMPILER_INSTALL", "1") != "0":
        try:
            _gpu.install_compiler()
        except RuntimeError as e:
            pytest.skip(f"{status}; installing it failed: {e}")
        status = _gpu.gpu_compiler_status()
    if status is not None:
        pytest.skip(status)
    return _gpu.gpu_mesh("h100_sxm", 8)
