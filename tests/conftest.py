"""Fixtures for tests that start real processes, and for tests that set the debug level."""

import logging
import shutil
import sys
import tempfile
import uuid

import pytest
from _procs import survivors

# Worker scripts run as programs in child processes; --doctest-modules must not import them.
collect_ignore = ["workers"]


_CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config):
    """One persistent compilation cache for this session, removed at its end.

    Many tests compile the same program (a step on the same model, a plain-jit
    reference): XLA compiles each once per session instead of once per test.
    The cache keys on the program and its compile options, so a test still gets
    the program its own settings make. Only this process uses it: worker
    processes compile for themselves.
    """
    import jax

    config.stash[_CACHE_DIR] = tempfile.mkdtemp(prefix="fdp-tests-xla-cache-")
    jax.config.update("jax_compilation_cache_dir", config.stash[_CACHE_DIR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _CACHE_DIR in config.stash:
        shutil.rmtree(config.stash[_CACHE_DIR], ignore_errors=True)


# A compile-only GPU client writes its programs to the cache but cannot load them back
# ("PjRtCompiler must be constructed with a Client"): JAX warns and compiles again.
_GPU_CACHE_MISS = "ignore:Error reading persistent compilation cache entry:UserWarning"


def pytest_collection_modifyitems(items):
    for item in items:
        # A test that starts real processes asks for `marker`: mark it `multiprocess`.
        if "marker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)
        if item.get_closest_marker("gpu_compile") is not None:
            item.add_marker(pytest.mark.filterwarnings(_GPU_CACHE_MISS))


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
    import fcntl
    import os

    from fdp.observe import _gpu

    status = _gpu.gpu_compiler_status()
    if status is not None and os.environ.get("FDP_GPU_COMPILER_INSTALL", "1") != "0":
        # Each pytest-xdist worker gets here: one installs, the others wait on the lock
        # and then find it installed (two pips writing one folder would break it).
        folder = _gpu.compiler_dir()
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            status = _gpu.gpu_compiler_status()
            if status is not None:
                try:
                    _gpu.install_compiler()
                except RuntimeError as e:
                    pytest.skip(f"{status}; installing it failed: {e}")
                status = _gpu.gpu_compiler_status()
    if status is not None:
        pytest.skip(status)
    return _gpu.gpu_mesh("h100_sxm", 8)
