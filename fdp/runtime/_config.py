"""Where ``fdp.init`` finds its settings: arguments, then variables, then the cluster.

Precedence, highest first:

1. explicit arguments to ``fdp.init``;
2. fdp's variables: ``FDP_COORDINATOR_ADDRESS`` (``host:port``),
   ``FDP_NUM_PROCESSES``, ``FDP_PROCESS_ID``, ``FDP_LOCAL_RANK``,
   ``FDP_LOCAL_WORLD_SIZE``;
3. torchrun's variables: ``MASTER_ADDR`` and ``MASTER_PORT``, ``WORLD_SIZE``,
   ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (what ``fdp launch`` sets);
4. a cluster JAX detects itself (Slurm, Open MPI, Kubernetes with ``jax[k8s]``).

fdp's and torchrun's variables may both be set, but must then agree.
"""

from __future__ import annotations

import importlib.util
import ipaddress
from collections.abc import Mapping
from typing import Any, NamedTuple

FDP_VARS = {
    "coordinator_address": "FDP_COORDINATOR_ADDRESS",
    "num_processes": "FDP_NUM_PROCESSES",
    "process_id": "FDP_PROCESS_ID",
    "local_rank": "FDP_LOCAL_RANK",
    "local_world_size": "FDP_LOCAL_WORLD_SIZE",
}
TORCH_VARS = {
    "num_processes": "WORLD_SIZE",
    "process_id": "RANK",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "LOCAL_WORLD_SIZE",
}
BIND_VAR = "FDP_COORDINATOR_BIND_ADDRESS"


class Settings(NamedTuple):
    """Resolved settings of this process.

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordinator, or
        ``None`` for a single process or a detected cluster.
      num_processes: number of processes (``None``: the cluster knows).
      process_id: this process's index (``None``: the cluster knows).
      local_rank: index among the processes of this host, if known.
      local_world_size: processes on this host, if known.
      source: where the settings came from, for messages.
      cluster: the cluster JAX should detect (``'slurm'``...), or ``None``.
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_rank: int | None
    local_world_size: int | None
    source: str
    cluster: str | None = None

    @property
    def multi_process(self) -> bool:
        """Whether ``jax.distributed`` must be initialised."""
        return self.cluster is not None or (self.num_processes or 1) > 1


def _as_int(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {name}={value!r}.") from None


def split_address(name: str, address: str) -> tuple[str, int]:
    """Splits ``host:port`` (``[v6]:port`` for IPv6), checking both parts.

    Raises:
      ValueError: ``address`` has no host or no valid port; the message names ``name``.
    """
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{name} must be host:port with a port in 1..65535 (IPv6 as [addr]:port), "
            f"got {name}={address!r}."
        )
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _from_fdp(environ: Mapping[str, str]) -> dict[str, tuple[str, object]]:
    found: dict[str, tuple[str, object]] = {}
    for field, var in FDP_VARS.items():
        if var not in environ:
            continue
        if field == "coordinator_address":
            split_address(var, environ[var])
            found[field] = (f"{var}={environ[var]}", environ[var].strip())
        else:
            found[field] = (f"{var}={environ[var]}", _as_int(var, environ[var]))
    return found


def _from_torch(environ: Mapping[str, str]) -> dict[str, tuple[str, object]]:
    found: dict[str, tuple[str, object]] = {}
    has_addr, has_port = "MASTER_ADDR" in environ, "MASTER_PORT" in environ
    if has_addr != has_port:
        given, missing = (
            ("MASTER_ADDR", "MASTER_PORT") if has_addr else ("MASTER_PORT", "MASTER_ADDR")
        )
        raise ValueError(
            f"{given}={environ[given]} is set but {missing} is not; set both or neither."
        )
    if has_addr:
        host = environ["MASTER_ADDR"].strip()
        address = join_address(host.strip("[]"), _as_int("MASTER_PORT", environ["MASTER_PORT"]))
        split_address("MASTER_ADDR:MASTER_PORT", address)
        found["coordinator_address"] = (
            f"MASTER_ADDR={environ['MASTER_ADDR']}, MASTER_PORT={environ['MASTER_PORT']}",
            address,
        )
    for field, var in TORCH_VARS.items():
        if var in environ:
            found[field] = (f"{var}={environ[var]}", _as_int(var, environ[var]))
    return found


def detect_cluster(environ: Mapping[str, str]) -> tuple[str, int | None] | None:
    """The cluster JAX would detect, and its process count if the variables say.

    Checks the same variables as JAX's own detectors, without contacting
    anything (Kubernetes also needs the ``kubernetes`` package, as in JAX).
    """
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in environ for v in slurm):
        return "slurm", _as_int("SLURM_NTASKS", environ["SLURM_NTASKS"])
    if "OMPI_MCA_orte_hnp_uri" in environ:
        size = environ.get("OMPI_COMM_WORLD_SIZE")
        return "ompi", None if size is None else _as_int("OMPI_COMM_WORLD_SIZE", size)
    if "KUBERNETES_SERVICE_HOST" in environ and importlib.util.find_spec("kubernetes"):
        return "k8s", None
    return None


def resolve(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_rank: int | None,
    local_world_size: int | None,
    environ: Mapping[str, str],
    *,
    cluster_detection: bool = True,
) -> Settings:
    """Resolves ``fdp.init``'s settings (see the module docstring for the order).

    Raises:
      ValueError: a variable is malformed, fdp's and torchrun's variables
        disagree, a setting is out of range, or the settings are incomplete.
    """
    fdp_found, torch_found = _from_fdp(environ), _from_torch(environ)
    args = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
        "local_rank": local_rank,
        "local_world_size": local_world_size,
    }
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for field, arg in args.items():
        if field in fdp_found and field in torch_found:
            (fdp_text, fdp_value), (torch_text, torch_value) = fdp_found[field], torch_found[field]
            if fdp_value != torch_value:
                raise ValueError(
                    f"fdp's and torchrun's variables disagree: {fdp_text} but {torch_text}. "
                    "Unset one of them or make them equal."
                )
        if arg is not None:
            values[field], origin[field] = arg, f"{field}={arg!r}"
        elif field in fdp_found:
            origin[field], values[field] = fdp_found[field]
        elif field in torch_found:
            origin[field], values[field] = torch_found[field]
    for field in ("num_processes", "process_id", "local_rank", "local_world_size"):
        if values.get(field) is not None and not isinstance(values[field], int):
            raise TypeError(f"{field} must be an int, got {origin[field]}.")
    _check_ranges(values, origin)
    source = _source(args, fdp_found, torch_found)
    lrank, lsize = values.get("local_rank"), values.get("local_world_size")
    n, pid = values.get("num_processes"), values.get("process_id")
    address = values.get("coordinator_address")
    if n is None and pid is None and address is None:
        detected = detect_cluster(environ) if cluster_detection else None
        if detected is not None and detected[1] != 1:
            return Settings(None, detected[1], None, lrank, lsize, detected[0], detected[0])
        return Settings(None, 1, 0, lrank, lsize, source if detected is None else detected[0])
    if n == 1 and pid in (None, 0):
        return Settings(address, 1, 0, lrank, lsize, source)
    missing = [label for field, label in _NEEDED if values.get(field) is None]
    if missing:
        raise ValueError(
            f"incomplete settings for several processes: got {', '.join(origin.values())} "
            f"but no {'; no '.join(missing)}."
        )
    return Settings(address, n, pid, lrank, lsize, source)


_NEEDED = (
    (
        "coordinator_address",
        "coordinator address (FDP_COORDINATOR_ADDRESS, or MASTER_ADDR and MASTER_PORT)",
    ),
    ("num_processes", "number of processes (FDP_NUM_PROCESSES or WORLD_SIZE)"),
    ("process_id", "process id (FDP_PROCESS_ID or RANK)"),
)


def _source(args: Mapping[str, object], fdp_found: Mapping, torch_found: Mapping) -> str:
    if any(a is not None for a in args.values()):
        return "arguments"
    if fdp_found:
        return "FDP_* variables"
    return "torchrun variables" if torch_found else "defaults"


def _check_ranges(values: Mapping[str, Any], origin: Mapping[str, str]) -> None:
    n, pid = values.get("num_processes"), values.get("process_id")
    lrank, lsize = values.get("local_rank"), values.get("local_world_size")
    if isinstance(values.get("coordinator_address"), str):
        split_address(origin["coordinator_address"].split("=")[0], values["coordinator_address"])
    if n is not None and n < 1:
        raise ValueError(
            f"the number of processes must be at least 1, got {origin['num_processes']}."
        )
    if pid is not None and (pid < 0 or (n is not None and pid >= n)):
        bound = f" and {origin['num_processes']}" if n is not None else ""
        raise ValueError(
            f"the process id must satisfy 0 <= process_id < num_processes, got "
            f"{origin['process_id']}{bound}."
        )
    if lsize is not None and (lsize < 1 or (n is not None and lsize > n)):
        raise ValueError(
            f"the local world size must be between 1 and the number of processes, got "
            f"{origin['local_world_size']}"
            + (f" and {origin['num_processes']}." if n is not None else ".")
        )
    if lrank is not None and (lrank < 0 or (lsize is not None and lrank >= lsize)):
        bound = f" and {origin['local_world_size']}" if lsize is not None else ""
        raise ValueError(
            f"the local rank must satisfy 0 <= local_rank < local_world_size, got "
            f"{origin['local_rank']}{bound}."
        )


def bind_address(address: str, explicit: str | None, environ: Mapping[str, str]) -> str | None:
    """Where process 0's coordinator listens.

    In order: ``explicit``, ``FDP_COORDINATOR_BIND_ADDRESS``, the coordinator's
    own address when it is a loopback address (nothing outside this machine
    needs to reach it), else ``None``: JAX's default, every interface.
    """
    if explicit is not None:
        return explicit
    if BIND_VAR in environ:
        split_address(BIND_VAR, environ[BIND_VAR])
        return environ[BIND_VAR].strip()
    host, _ = split_address("coordinator_address", address)
    return address if is_loopback(host) else None
