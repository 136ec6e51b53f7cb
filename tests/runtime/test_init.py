"""fdp.init: where settings come from, their errors, and the failures it reports itself.

Joining real processes is tested in test_host_collectives.py and test_launch.py.
"""

import os
import signal
import socket
import time

import pytest
from _procs import WORKERS, finish, start

import fdp
from fdp.runtime._config import BIND_VAR, bind_address, resolve

TORCHRUN = {
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "WORLD_SIZE": "4",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}


def settings(env, **args):
    fields = (
        "coordinator_address",
        "num_processes",
        "process_id",
        "local_rank",
        "local_world_size",
    )
    return resolve(*(args.get(f) for f in fields), env)


def test_torchrun_variables():
    s = settings(TORCHRUN)
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.1:29500", 4, 3)
    assert (s.local_rank, s.local_world_size, s.source) == (1, 2, "torchrun variables")
    assert s.multi_process


def test_fdp_variables_and_arguments_take_precedence():
    env = {
        **TORCHRUN,
        "FDP_COORDINATOR_ADDRESS": "[::1]:1234",
        "MASTER_ADDR": "::1",
        "MASTER_PORT": "1234",
        "FDP_PROCESS_ID": "3",
    }
    s = settings(env)
    assert (s.coordinator_address, s.process_id, s.source) == ("[::1]:1234", 3, "FDP_* variables")
    s = settings(env, process_id=0, coordinator_address="h:1")
    assert (s.coordinator_address, s.process_id, s.source) == ("h:1", 0, "arguments")


def test_no_variables_is_one_process():
    s = settings({})
    assert (s.num_processes, s.process_id, s.multi_process) == (1, 0, False)
    assert not settings({"WORLD_SIZE": "1", "RANK": "0"}).multi_process


def test_clusters_jax_detects_are_left_to_jax():
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
    }
    s = settings(slurm)
    assert (s.cluster, s.num_processes, s.multi_process) == ("slurm", 8, True)
    # An interactive one-task allocation stays a plain single process.
    assert not settings({**slurm, "SLURM_NTASKS": "1"}).multi_process
    assert settings({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}).cluster == "ompi"
    assert settings({**slurm, **TORCHRUN}).cluster is None  # explicit variables win


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {**TORCHRUN, "RANK": "4"},
            r"0 <= process_id < num_processes, got RANK=4 and WORLD_SIZE=4",
        ),
        ({**TORCHRUN, "RANK": "x"}, r"RANK must be an integer, got RANK='x'"),
        (
            {**TORCHRUN, "LOCAL_RANK": "2"},
            r"0 <= local_rank < local_world_size, got LOCAL_RANK=2 and LOCAL_WORLD_SIZE=2",
        ),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "5"}, r"got LOCAL_WORLD_SIZE=5 and WORLD_SIZE=4"),
        (
            {"MASTER_ADDR": "h", "WORLD_SIZE": "2", "RANK": "1"},
            "MASTER_ADDR=h is set but MASTER_PORT is not",
        ),
        ({"WORLD_SIZE": "2", "RANK": "1"}, r"got WORLD_SIZE=2, RANK=1 but no coordinator address"),
        ({**TORCHRUN, "FDP_PROCESS_ID": "2"}, "disagree: FDP_PROCESS_ID=2 but RANK=3"),
        (
            {"FDP_COORDINATOR_ADDRESS": "host", "FDP_NUM_PROCESSES": "2", "FDP_PROCESS_ID": "0"},
            r"FDP_COORDINATOR_ADDRESS must be host:port .* got FDP_COORDINATOR_ADDRESS='host'",
        ),
        ({**TORCHRUN, "MASTER_PORT": "0"}, "port in 1..65535"),
    ],
)
def test_contradictory_or_malformed_variables_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        settings(env)


def test_init_alone_joins_no_peers(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    fdp.init()
    assert (fdp.process_index(), fdp.process_count(), fdp.local_rank()) == (0, 1, 0)
    assert fdp.local_world_size() == 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_after_the_backend_started_says_so():
    # This test process has run computations already.
    with pytest.raises(RuntimeError, match="must be called before any JAX calls that might"):
        fdp.init(f"127.0.0.1:{free_port()}", 2, 0)


def test_unreachable_coordinator_is_named_within_the_timeout():
    """Nobody listens at the address: TimeoutError naming it, after ~2 s (bound: 10 s)."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=f"coordinator at {address} could not be reached within "
        r"initialization_timeout=2 s \(this is process 1 of 2",
    ):
        fdp.init(address, 2, 1, initialization_timeout=2)
    assert 2 <= time.monotonic() - started < 10


def test_a_busy_coordinator_port_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(OSError, match=f"cannot start the coordinator on {address}: the port"):
            fdp.init(address, 2, 0)


def test_local_rank_from_the_environment(monkeypatch):
    monkeypatch.setattr("fdp.runtime._init._LOCAL", {})
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert (fdp.local_rank(), fdp.local_world_size()) == (3, 4)
    monkeypatch.setenv("FDP_LOCAL_RANK", "2")
    assert fdp.local_rank() == 2


def test_the_coordinator_listens_on_loopback_for_a_loopback_address(monkeypatch):
    assert bind_address("127.0.0.1:5000", None, {}) == "127.0.0.1:5000"
    assert bind_address("localhost:5000", None, {}) == "localhost:5000"
    assert bind_address("10.0.0.1:5000", None, {}) is None  # JAX's default: every interface
    assert bind_address("10.0.0.1:5000", None, {BIND_VAR: "0.0.0.0:5000"}) == "0.0.0.0:5000"
    assert bind_address("10.0.0.1:5000", "[::]:5000", {}) == "[::]:5000"


def test_an_uncaught_exception_ends_the_process_at_once(tmp_path, marker):
    """Without a launcher: rank 1 raises after joining and exits within 20 s, although its
    peer is still running (JAX's shutdown barrier would hold it for shutdown_timeout)."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    procs = {
        rank: start(
            [WORKERS / "failing.py", "raise", tmp_path / "failed_1"],
            marker,
            FDP_COORDINATOR_ADDRESS=address,
            FDP_NUM_PROCESSES="2",
            FDP_PROCESS_ID=str(rank),
        )
        for rank in (0, 1)
    }
    try:
        out = finish(procs[1], 60, started)
        assert out.returncode == 1, out.output
        assert "RuntimeError: rank 1 failed on purpose" in out.stderr
        assert out.ended_at - float((tmp_path / "failed_1").read_text()) < 20
    finally:
        os.killpg(procs[0].pid, signal.SIGKILL)  # rank 0 would wait for JAX's heartbeat timeout
        procs[0].communicate()
