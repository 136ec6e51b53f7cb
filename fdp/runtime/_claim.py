"""Which run a coordinator on this host belongs to, checked before a process joins it.

JAX's coordination service takes any process that connects with a valid
process id, and a second process with an id already taken makes the service
abort the running job ("connect with a different incarnation"). So a stray
worker (a second ``fdp launch`` on the same port, a script started by hand
with the same ``MASTER_PORT``) would kill a job it has nothing to do with.

Each run has an id (``FDP_RUN_ID``, made by ``fdp launch``). Process 0 records
its run id and pid in a claim file named after the coordinator's port before it
starts the coordinator; every other process reads the claim before it
registers, and refuses a coordinator of another run with an error on its own
side, leaving that run alone. The claim lives in the temporary directory, so
it protects a coordinator from processes on its own host (JAX offers no way to
ask a remote coordinator anything before registering). Process 0 removes its
claim when it exits; claims of processes that died without removing theirs are
removed by the next claim on this host.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import socket
import tempfile

from fdp._process import pid_alive

RUN_ID_VAR = "FDP_RUN_ID"


def _path(port: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"fdp-coordinator-{port}.json")


def is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (it can be bound to)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def _owner(path: str) -> int | None:
    """The pid recorded in the claim file ``path``, or None if it cannot be read."""
    try:
        with open(path) as f:
            return int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim(port: int, run_id: str | None) -> None:
    """Records that this process (process 0 of run ``run_id``) runs the coordinator on ``port``.

    The claim is removed when this process exits (:func:`release`); the claims of
    dead processes on other ports are removed here.
    """
    record = {"run_id": run_id, "pid": os.getpid()}
    path = _path(port)
    for other in glob.glob(_path(0).replace("-0.json", "-*.json")):
        pid = _owner(other)
        if other != path and pid is not None and not pid_alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(other)
    # Best effort: another user's stale claim on this port may not be ours to replace.
    with contextlib.suppress(OSError):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
        if path not in _held:
            _held.append(path)
            atexit.register(release)


# The claims this process made (process 0 makes one).
_held: list[str] = []


def release() -> None:
    """Removes this process's claims (at exit; after a failure, before ``os._exit``)."""
    while _held:
        path = _held.pop()
        if _owner(path) == os.getpid():  # not a later run's claim on the same port
            with contextlib.suppress(OSError):
                os.unlink(path)


def check(address: str, host: str, port: int, run_id: str | None) -> None:
    """Raises if the coordinator at ``host:port`` (on this host) belongs to another run.

    Raises:
      RuntimeError: naming both run ids, the coordinator's process and the fix.
    """
    if not is_local(host):
        return
    try:
        with open(_path(port)) as f:
            record = json.load(f)
        owner, pid = record.get("run_id"), int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    if owner == run_id or not pid_alive(pid):
        return
    raise RuntimeError(
        f"fdp.init: the coordinator at {address} belongs to another run ({RUN_ID_VAR}="
        f"{owner!r}, process 0 is pid {pid}), and this process has {RUN_ID_VAR}={run_id!r}; "
        "it does not join, because JAX would abort that run. Give this run another "
        f"MASTER_PORT (or FDP_COORDINATOR_ADDRESS), or set {RUN_ID_VAR} to that run's id if "
        "this process belongs to it."
    )
