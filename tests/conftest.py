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
