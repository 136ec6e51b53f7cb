"""Debug levels: ``FDP_DEBUG=OFF|INFO|DETAIL``, torch's ``TORCH_DISTRIBUTED_DEBUG``.

fdp logs through the standard :mod:`logging` module, on the ``"fdp"`` logger,
which carries a ``NullHandler``: a program that configures nothing sees nothing.
The debug level decides what fdp does and says:

- ``OFF`` (default): nothing. A step's first call checks the level once; later
  calls do not even do that.
- ``INFO``: each step function logs its settings once (DDP's logging data:
  processes, devices, mesh, parameters, buckets, comm hook, ...) before its first
  step runs, and samples runtime statistics (see :mod:`fdp.observe._stats`).
- ``DETAIL``: INFO, plus a check before the first step that every process is
  about to run the same step (see :mod:`fdp.observe._fingerprint`), and a summary of the
  step's collectives.

As ``TORCH_DISTRIBUTED_DEBUG=INFO`` makes DDP print, setting ``FDP_DEBUG`` (or
calling :func:`set_debug_level`) to INFO or DETAIL makes the ``"fdp"`` logger
pass INFO records and, when neither it nor the root logger has a handler,
attaches one that writes to stderr.
"""

from __future__ import annotations

import enum
import logging
import os
import sys

ENV_VAR = "FDP_DEBUG"

logger = logging.getLogger("fdp")
logger.addHandler(logging.NullHandler())


class DebugLevel(enum.IntEnum):
    """How much fdp checks and logs (``torch.distributed.DebugLevel``)."""

    OFF = 0
    INFO = 1
    DETAIL = 2


# None: follow the FDP_DEBUG environment variable; otherwise set_debug_level's value.
_override: DebugLevel | None = None
# The level fdp gave the "fdp" logger, if it gave it one.
_level_set: int | None = None


class _StderrHandler(logging.StreamHandler):
    """The handler fdp attaches itself, told apart from the user's own.

    It writes to ``sys.stderr`` as it is when a record is written, not as it
    was when the handler was made (like ``logging.lastResort``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        del value


def _parse(value: DebugLevel | str | int, what: str) -> DebugLevel:
    if isinstance(value, DebugLevel):
        return value
    if isinstance(value, str) and value.strip().upper() in DebugLevel.__members__:
        return DebugLevel[value.strip().upper()]
    raise ValueError(f"{what} must be one of OFF, INFO, DETAIL (any case), got {value!r}.")


def _from_env() -> DebugLevel:
    value = os.environ.get(ENV_VAR, "")
    return _parse(value, ENV_VAR) if value.strip() else DebugLevel.OFF


def debug_level() -> DebugLevel:
    """The current debug level.

    The level given to :func:`set_debug_level`, or else the ``FDP_DEBUG``
    environment variable as it is now (unset or empty: ``OFF``). A step reads
    it once, at its first call.

    Raises:
      ValueError: ``FDP_DEBUG`` holds something other than OFF, INFO or DETAIL.

    Example:
      >>> import fdp
      >>> fdp.debug_level()
      <DebugLevel.OFF: 0>
    """
    level = _from_env() if _override is None else _override
    _configure(level)
    return level


def set_debug_level(level: DebugLevel | str | None) -> None:
    """Sets the debug level for steps that have not run yet.

    Args:
      level: ``"OFF"``, ``"INFO"``, ``"DETAIL"`` (any case) or a
        :class:`DebugLevel`; ``None`` follows ``FDP_DEBUG`` again.

    Raises:
      ValueError: an unknown level.

    Example:
      >>> import fdp
      >>> fdp.set_debug_level("info")
      >>> fdp.debug_level()
      <DebugLevel.INFO: 1>
      >>> fdp.set_debug_level(None)  # back to FDP_DEBUG (unset here: OFF)
      >>> fdp.debug_level()
      <DebugLevel.OFF: 0>
    """
    global _override
    _override = None if level is None else _parse(level, "level")
    _configure(debug_level())


def _configure(level: DebugLevel) -> None:
    """Lets INFO records through at INFO and above, and gives them a handler if none is."""
    global _level_set
    # The "fdp" logger's level is fdp's to change only while nobody else changed it:
    # unset, or still the value fdp gave it.
    ours = logger.level == logging.NOTSET or logger.level == _level_set
    if level == DebugLevel.OFF:
        for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
            logger.removeHandler(handler)
        if ours:
            logger.setLevel(logging.NOTSET)
        _level_set = None
        return
    if ours:
        _level_set = logging.DEBUG if level == DebugLevel.DETAIL else logging.INFO
        logger.setLevel(_level_set)
    configured = [h for h in logger.handlers if not isinstance(h, logging.NullHandler)]
    if not configured and not logging.getLogger().handlers:
        logger.addHandler(_StderrHandler())
