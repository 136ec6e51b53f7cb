"""Whether a process of this host is alive: one place for the check fdp's clean-ups make."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a process we may not signal counts).

    Used to tell files left by dead processes (shared-memory regions, coordinator
    claims) from files of running ones.

    Example:
      >>> pid_alive(os.getpid())
      True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True
