"""Fault injection with real processes: each fault is detected in time and blamed exactly.

Workers run tests/workers/faulty.py, a small training loop under `fdp launch`, in which
one rank misbehaves after its step 3: it stops (SIGSTOP, a hang), is killed, or raises.
Other tests signal the launcher, or start a second run and a stranger on the port of a
running one. Time to detect is measured from the fault (a time stamp the worker writes
just before it) to the launcher's exit, against a generous bound; the blamed rank is
asserted exactly. The `marker` fixture checks that no process outlives a test.
"""

import os
import signal
import time

import pytest
from _procs import WORKERS, finish, launch, start

HANG_TIMEOUT = 2.0  # the launcher's --hang-timeout in these tests
BOUND = 30.0  # seconds from a fault to the launcher's exit, beyond HANG_TIMEOUT for hangs
FAST = ["--grace-period", "0.5", "--hang-timeout", str(HANG_TIMEOUT)]


def run_faulty(nproc, mode, rank, outdir, marker, step=3):
    return launch(
        ["--nproc-per-node", str(nproc), *FAST],
        "faulty.py",
        [mode, rank, step, outdir],
        marker,
        timeout=120,
    )


def root_cause(result):
    return result.stderr.split("fdp launch: the worker group failed", 1)[1]


def seconds_to_exit(result, outdir):
    return result.ended_at - float((outdir / "fault").read_text())


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def steps(outdir, rank):
    try:
        return int((outdir / f"steps_{rank}").read_text() or 0)
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize(
    ("nproc", "rank"), [(2, 1), (2, 0), pytest.param(4, 2, marks=pytest.mark.slow)]
)
def test_a_stopped_worker_is_found_hung_and_named_with_its_last_step(tmp_path, marker, nproc, rank):
    """On main, only JAX's heartbeat noticed, after 78-94 s, and blamed a healthy rank."""
    out = run_faulty(nproc, "stop", rank, tmp_path, marker)
    assert out.returncode == 1, out.output
    cause = root_cause(out)
    assert f"root cause: rank {rank} (local rank {rank}," in cause
    assert "hung: it completed no step for" in cause and "after its step 3 (" in cause
    assert "stopped by a signal" in cause
    assert "faulty.py" in cause.split("its Python stack when it hung", 1)[1]  # where it was
    stopped = cause.split("stopped after the failure: ", 1)[1]
    assert all(f"rank {r} (" in stopped for r in set(range(nproc)) - {rank})
    assert HANG_TIMEOUT <= seconds_to_exit(out, tmp_path) < HANG_TIMEOUT + BOUND


@pytest.mark.parametrize(
    ("nproc", "mode", "rank"),
    [pytest.param(4, "kill", 3, marks=pytest.mark.slow), (2, "raise", 1)],
)
def test_a_killed_or_failing_worker_is_named(tmp_path, marker, nproc, mode, rank):
    out = run_faulty(nproc, mode, rank, tmp_path, marker)
    assert out.returncode == 1, out.output
    cause = root_cause(out)
    assert f"root cause: rank {rank} (local rank {rank}," in cause
    if mode == "kill":
        assert "ended with signal SIGKILL (9)" in cause
    else:
        assert "ended with exit code 1" in cause
        assert f"RuntimeError: rank {rank} failed on purpose after step 3" in cause
    assert "hung" not in cause
    assert seconds_to_exit(out, tmp_path) < BOUND


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path, marker):
    started = time.monotonic()
    proc = start(
        [
            "-m",
            "fdp.launch",
            "--nproc-per-node",
            "2",
            *FAST,
            WORKERS / "faulty.py",
            "none",
            0,
            0,
            tmp_path,
        ],
        marker,
    )
    wait_for(lambda: steps(tmp_path, 0) >= 3 and steps(tmp_path, 1) >= 3)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    out = finish(proc, 60, started)
    assert out.returncode == 128 + signal.SIGTERM, out.output
    assert "received SIGTERM; stopped the workers." in out.stderr
    assert out.ended_at - sent < BOUND


def test_a_second_run_and_a_stranger_on_the_port_leave_the_first_run_training(tmp_path, marker):
    """On main, either one joining the first run's coordinator aborted that run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    started = time.monotonic()
    first = start(
        [
            "-m",
            "fdp.launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            port,
            *FAST,
            WORKERS / "faulty.py",
            "none",
            0,
            0,
            first_dir,
        ],
        marker,
    )
    try:
        wait_for(lambda: steps(first_dir, 0) >= 3 and steps(first_dir, 1) >= 3)

        # A second fdp launch on the same port starts no worker and fails at once.
        second = launch(
            ["--nproc-per-node", "2", "--master-port", port, *FAST],
            "faulty.py",
            ["none", 0, 0, second_dir],
            marker,
            timeout=60,
        )
        assert second.returncode == 1, second.output
        assert f"the coordinator port 127.0.0.1:{port} is in use" in second.stderr
        assert "no worker was started" in second.stderr and not list(second_dir.iterdir())

        # A stranger started by hand as rank 1 of that port is refused before it registers.
        stranger = start(
            [WORKERS / "faulty.py", "none", 0, 0, second_dir],
            marker,
            RANK="1",
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        out = finish(stranger, 60, time.monotonic())
        assert out.returncode == 1, out.output
        assert f"the coordinator at 127.0.0.1:{port} belongs to another run" in out.stderr
        assert "FDP_RUN_ID=None; it does not join" in out.stderr

        # The first run trains on, and ends well.
        before = steps(first_dir, 1)
        wait_for(lambda: steps(first_dir, 1) >= before + 3)
        # Both ranks stop after the same step, far enough ahead that neither has done it.
        (first_dir / "finish.tmp").write_text(str(max(steps(first_dir, r) for r in (0, 1)) + 25))
        (first_dir / "finish.tmp").rename(first_dir / "finish")
        result = finish(first, 60, started)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert result.returncode == 0, result.output
    assert "done after step" in result.stdout


# Where a hang happens: inside the compiled step, before the first step, after the last one.


@pytest.mark.parametrize(("nproc", "rank"), [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_a_worker_blocked_in_a_host_callback_inside_the_step_is_blamed(
    tmp_path, marker, nproc, rank
):
    """On main, rank 0 (waiting in the collective) was blamed, with its stack as the cause."""
    out = run_faulty(nproc, "callback", rank, tmp_path, marker)
    assert out.returncode == 1, out.output
    cause = root_cause(out)
    assert f"root cause: rank {rank} (local rank {rank}," in cause
    assert "blocked in a host callback (faulty.py, line" in cause
    assert "in block_in_callback" in cause.split("its Python stack when it hung", 1)[1]
    table = cause.split("where every worker was when the hang was found:", 1)[1]
    rows = [line.split() for line in table.splitlines()[2 : 2 + nproc]]
    assert [row[:2] for row in rows] == [[str(r), "3"] for r in range(nproc)]
    assert HANG_TIMEOUT <= seconds_to_exit(out, tmp_path) < HANG_TIMEOUT + BOUND


@pytest.mark.parametrize("hook", ["default", pytest.param("allreduce", marks=pytest.mark.slow)])
def test_a_worker_that_never_reaches_its_first_step_is_named(tmp_path, marker, hook):
    """Rank 0 waits in its first step: at the shared-memory set-up (the default hook), or
    in XLA's all-reduce. On main, nothing noticed: rank 0 waited for the store's 300 s."""
    out = launch(
        ["--nproc-per-node", "2", "--grace-period", "0.5", "--hang-timeout", "5"],
        "faulty.py",
        ["absent", 1, 0, tmp_path],
        marker,
        timeout=120,
        **({"FAULTY_COMM_HOOK": hook} if hook != "default" else {}),
    )
    assert out.returncode == 1, out.output
    cause = root_cause(out)
    assert "root cause: rank 1 (local rank 1," in cause
    assert "hung: it did not reach its first step for" in cause
    assert "while rank(s) 0 waited" in cause
    assert 5 <= seconds_to_exit(out, tmp_path) < 5 + BOUND


@pytest.mark.parametrize(
    ("mode", "hook"),
    [
        ("latecompile", "allreduce"),
        pytest.param("late", "allreduce", marks=pytest.mark.slow),
        pytest.param("late", "default", marks=pytest.mark.slow),
    ],
)
def test_a_late_and_slow_compile_is_not_a_hang(tmp_path, marker, mode, hook):
    """Rank 1 calls the step 3 s after its peers, then traces for 12 s more, past the 10 s
    --hang-timeout: at its first step (`late`) or at step 4, which every rank compiles
    again for a new batch size (`latecompile`).

    On main, rank 0's wait after its step 3 counted: "rank 0 hung" (`latecompile`); at
    the first step main watched nothing yet, and these cases guard that the wait now
    seen there (rank 0 inside step 1, or at the shared-memory set-up) is not a hang.
    """
    out = launch(
        ["--nproc-per-node", "2", "--grace-period", "0.5", "--hang-timeout", "10"],
        "faulty.py",
        [mode, 1, 3, tmp_path],
        marker,
        timeout=180,
        **({"FAULTY_COMM_HOOK": hook} if hook != "default" else {}),
    )
    assert out.returncode == 0, out.output
    assert "hung" not in out.output
    assert all(f"rank {r} done after step 5" in out.stdout for r in (0, 1))


def test_the_exit_after_the_last_step_is_not_a_hang(tmp_path, marker):
    """Rank 0 takes 8 s to exit, 4 x the --hang-timeout, after its last step.

    On main: "rank 0 hung: it completed no step for 2.0 s after its step 5", and every
    worker warned ResourceWarning (its stack file left open).
    """
    out = run_faulty(2, "slowexit", 0, tmp_path, marker, step=8)
    assert out.returncode == 0, out.output
    assert "hung" not in out.output
    assert all(f"rank {r} done after step 5" in out.stdout for r in (0, 1))
    assert "ResourceWarning" not in out.output
