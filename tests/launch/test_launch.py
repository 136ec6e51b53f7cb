"""fdp launch: worker environment, output, failure handling, restarts and signals.

Most tests use tests/workers/probe.py, which does not import JAX, so they start in
well under a second; the last ones run JAX workers joined by fdp.init. Every test
checks (through the `marker` fixture) that no process it started is left alive.
"""

import dataclasses
import json
import os
import signal
import socket
import time

import pytest
from _procs import WORKERS, alive, finish, launch, start

from fdp.launch import _env, _summary
from fdp.launch._cli import build_parser
from fdp.launch._config import LaunchConfig, from_namespace

FAILURE_BOUND = 30.0  # seconds from a worker's failure to the launch's exit


def parse(*argv):
    return from_namespace(build_parser().parse_args(list(argv)))


def records(outdir):
    return {
        int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in outdir.glob("ready_*.json")
    }


def test_command_line_passes_script_arguments_through():
    cfg = parse("--nproc-per-node", "2", "train.py", "--lr", "0.1", "--nproc-per-node", "9")
    assert cfg.script == "train.py" and cfg.nproc_per_node == 2
    assert cfg.script_args == ("--lr", "0.1", "--nproc-per-node", "9")
    assert parse("--", "train.py", "-x").script_args == ("-x",)
    assert parse("-m", "pkg.train", "a").module
    # Verbatim, as torchrun: never read as abbreviations of the launcher's options
    # (--n, --h), nor a "--" of the script's dropped.
    cfg = parse("--nproc", "2", "train.py", "--n", "3", "--h", "--", "-m")
    assert cfg.script_args == ("--n", "3", "--h", "--", "-m") and cfg.nproc_per_node == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--master-port", "29500", "t.py"], "needs --master-addr"),
        (["--nnodes", "2", "--master-addr", "h", "t.py"], "needs --master-port"),
        (
            [
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-addr",
                "h",
                "--master-port",
                "1",
                "t.py",
            ],
            r"--node-rank must be in 0\.\.1 for --nnodes 2, got 2",
        ),
        (["--nproc-per-node", "0", "t.py"], "--nproc-per-node must be >= 1, got 0"),
        (["--master-port", "70000", "t.py"], "--master-port must be in 1..65535"),
    ],
)
def test_bad_options_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_each_worker_gets_its_own_gpus_or_cpu_cores():
    cfg = LaunchConfig("t.py", nproc_per_node=2, max_restarts=3, run_id="r1")
    kw = dict(port=1234, restart_count=1, error_file="e", base={}, cpus=[0, 1, 2, 3])
    gpu = _env.worker_env(cfg, 1, gpus=["4", "5", "6", "7"], **kw)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "6,7" and "FDP_CPU_AFFINITY" not in gpu
    assert (gpu["RANK"], gpu["LOCAL_RANK"], gpu["WORLD_SIZE"], gpu["MASTER_PORT"]) == (
        "1",
        "1",
        "2",
        "1234",
    )
    assert (gpu["FDP_RESTART_COUNT"], gpu["FDP_MAX_RESTARTS"], gpu["FDP_RUN_ID"]) == (
        "1",
        "3",
        "r1",
    )
    cpu = _env.worker_env(cfg, 1, gpus=[], **kw)
    assert cpu["FDP_CPU_AFFINITY"] == "2,3" and cpu["OMP_NUM_THREADS"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in cpu
    mine = _env.worker_env(cfg, 0, gpus=[], **{**kw, "base": {"OMP_NUM_THREADS": "7"}})
    assert mine["OMP_NUM_THREADS"] == "7"  # the user's setting wins
    off = LaunchConfig("t.py", nproc_per_node=2, bind_gpus=False, bind_cpus=False)
    plain = _env.worker_env(off, 0, gpus=["0", "1"], **kw)
    assert "CUDA_VISIBLE_DEVICES" not in plain and plain["OMP_NUM_THREADS"] == "1"
    assert _env.detect_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    assert _env.detect_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def exit_of(rank, returncode, *, error=None, tail=()):
    return _summary.WorkerExit(
        rank=rank,
        local_rank=rank,
        pid=100 + rank,
        returncode=returncode,
        elapsed=1.0,
        stopped=False,
        order=3,
        error=error,
        tail=tail,
    )


def test_the_root_cause_is_the_killed_worker_not_its_peers_lost_connection():
    """Seen in the same poll round: rank 1 killed, rank 0 raised because rank 1 vanished."""
    lost = {
        "type": "XlaRuntimeError",
        "message": "INTERNAL: Gloo all-reduce failed: "
        "[pair.cc:534] Connection closed by peer [127.0.0.1]:40211",
    }
    killed = exit_of(1, -signal.SIGKILL)
    peer = exit_of(0, 1, error=lost)
    assert peer.secondary and not killed.secondary
    assert _summary.root_cause([peer, killed]) is killed
    # A traceback of its own still comes before a bare exit code of a peer.
    boom = exit_of(0, 1, error={"type": "ValueError", "message": "bad batch"})
    assert _summary.root_cause([boom, exit_of(1, 1)]) is boom


def test_the_root_cause_is_the_rank_a_shared_error_names():
    """Every rank raised FDP_CHECK_FINITE's error, "first on process 1": blame rank 1."""

    def nan_error(rank, order, stopped=False):
        error = {"type": "FloatingPointError", "message": "... first on process 1", "blames": 1}
        return dataclasses.replace(exit_of(rank, 1, error=error), order=order, stopped=stopped)

    first, named = nan_error(0, order=2), nan_error(1, order=3, stopped=True)
    assert _summary.root_cause([first, named]) is named
    assert "root cause: rank 1 (local rank 1" in _summary.format_failure(
        [first, named], attempt=0, attempts=1, run_id="r"
    )
    # Only the same error counts: a rank that failed otherwise is not blamed by another's.
    other = exit_of(1, 1, error={"type": "ValueError", "message": "bad batch"})
    assert _summary.root_cause([dataclasses.replace(first, order=1), other]).rank == 0


def test_workers_get_torchrun_variables_and_prefixed_output(tmp_path, marker):
    out = launch(["--nproc-per-node", "2"], "probe.py", ["ok", tmp_path], marker, timeout=60)
    assert out.returncode == 0, out.output
    seen = records(tmp_path)
    assert sorted(seen) == [0, 1]
    for rank, rec in seen.items():
        env = rec["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank), str(rank), "0")
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536
        assert env["FDP_RESTART_COUNT"] == "0" and env["FDP_RUN_ID"] == seen[0]["env"]["FDP_RUN_ID"]
        assert rec["argv"][1:] == ["ok", str(tmp_path)]
        assert f"[rank {rank}] out from rank {rank}, attempt 0" in out.stdout
        assert f"[rank {rank}] err from rank {rank}" in out.stderr
    if len(os.sched_getaffinity(0)) >= 2:  # each worker pinned to its own share of cores
        assert not set(seen[0]["affinity"]) & set(seen[1]["affinity"])


def test_each_worker_gets_one_of_the_visible_gpus(tmp_path, marker):
    """GPUs are found without JAX (here from CUDA_VISIBLE_DEVICES; this host has none)."""
    out = launch(
        ["--nproc-per-node", "2"],
        "probe.py",
        ["ok", tmp_path],
        marker,
        timeout=60,
        CUDA_VISIBLE_DEVICES="3,5",
    )
    assert out.returncode == 0, out.output
    envs = {rank: rec["env"] for rank, rec in records(tmp_path).items()}
    assert [envs[r]["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["3", "5"]
    assert "FDP_CPU_AFFINITY" not in envs[0]


def test_log_dir_gets_one_file_per_rank(tmp_path, marker):
    logs = tmp_path / "logs"
    out = launch(
        ["--nproc-per-node", "2", "--log-dir", logs],
        "probe.py",
        ["ok", tmp_path],
        marker,
        timeout=60,
    )
    assert out.returncode == 0, out.output
    for rank in (0, 1):
        text = (logs / "attempt_1" / f"rank_{rank}.log").read_text()
        assert f"out from rank {rank}" in text and f"err from rank {rank}" in text
    assert "[rank" not in out.stdout


def summary(result):
    """fdp launch's failure summary (after the workers' own output)."""
    return result.stderr.split("fdp launch: the worker group failed", 1)[1]


def failure_seconds(result, outdir):
    return result.ended_at - float((outdir / "failed_1").read_text())


def test_a_worker_that_raises_ends_the_launch_with_its_traceback(tmp_path, marker):
    """The other worker sleeps; the launch exits 1 within FAILURE_BOUND s, naming rank 1."""
    out = launch(["--nproc-per-node", "2"], "probe.py", ["raise", tmp_path], marker, timeout=60)
    assert out.returncode == 1, out.output
    assert "root cause: rank 1 (local rank 1" in out.stderr
    assert "ended with exit code 1" in out.stderr
    assert 'raise RuntimeError("rank 1 failed on purpose")' in out.stderr
    assert "RuntimeError: rank 1 failed on purpose" in summary(out)
    assert "stopped after the failure: rank 0 (signal SIGTERM (15))" in out.stderr
    assert failure_seconds(out, tmp_path) < FAILURE_BOUND


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV"])
def test_a_worker_killed_by_a_signal_is_named_with_the_signal(tmp_path, marker, sig):
    out = launch(
        ["--nproc-per-node", "2"], "probe.py", [f"signal:{sig}", tmp_path], marker, timeout=60
    )
    assert out.returncode == 1, out.output
    number = int(getattr(signal, sig))
    assert "root cause: rank 1 (local rank 1" in out.stderr
    assert f"ended with signal {sig} ({number})" in out.stderr
    assert "out from rank 1" in summary(out)  # its last output
    assert failure_seconds(out, tmp_path) < FAILURE_BOUND


def test_restarts_the_group_after_a_failure(tmp_path, marker):
    out = launch(
        ["--nproc-per-node", "2", "--max-restarts", "2"],
        "probe.py",
        ["flaky", tmp_path],
        marker,
        timeout=60,
    )
    assert out.returncode == 0, out.output
    assert "attempt 1 of 3 failed: rank 1 ended with exit code 3" in out.stderr
    assert "[rank 0] out from rank 0, attempt 1" in out.stdout
    assert "attempt 2" not in out.stdout
    assert records(tmp_path)[1]["env"]["FDP_RESTART_COUNT"] == "1"


def test_gives_up_after_max_restarts(tmp_path, marker):
    out = launch(
        ["--nproc-per-node", "2", "--max-restarts", "2"],
        "probe.py",
        ["fail", tmp_path],
        marker,
        timeout=60,
    )
    assert out.returncode == 1, out.output
    assert [f"attempt {a}" in out.stdout for a in range(3)] == [True] * 3
    assert "failed (attempt 3 of 3" in out.stderr and "exit code 4" in out.stderr


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, marker):
    out = launch(
        ["--nproc-per-node", "2", "--grace-period", "1"],
        "probe.py",
        ["stubborn", tmp_path],
        marker,
        timeout=60,
    )
    assert out.returncode == 1, out.output
    assert "rank 0 (signal SIGKILL (9))" in out.stderr
    assert failure_seconds(out, tmp_path) < FAILURE_BOUND


def test_what_a_worker_started_dies_with_it(tmp_path, marker):
    """The workers' `sleep 600` children are killed too (the marker fixture checks)."""
    out = launch(
        ["--nproc-per-node", "2"], "probe.py", ["grandchild", tmp_path], marker, timeout=60
    )
    assert out.returncode == 1 and "exit code 6" in out.stderr, out.output
    for rank in (0, 1):
        assert not alive(int((tmp_path / f"grandchild_{rank}").read_text()))


def wait_ready(outdir, count, timeout=60):
    deadline = time.monotonic() + timeout
    while len(list(outdir.glob("ready_*.json"))) < count:
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.05)


@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_signals_to_the_launcher_reach_the_workers(tmp_path, marker, sig, code):
    started = time.monotonic()
    proc = start(
        ["-m", "fdp.launch", "--nproc-per-node", "2", WORKERS / "probe.py", "trap", tmp_path],
        marker,
    )
    wait_ready(tmp_path, 2)
    proc.send_signal(getattr(signal, sig))
    out = finish(proc, 60, started)
    assert out.returncode == code, out.output
    assert f"received {sig}" in out.stderr
    if sig == "SIGTERM":  # the workers' own handlers ran
        assert sorted(p.name for p in tmp_path.glob("term_*")) == ["term_0", "term_1"]


def test_workers_die_with_a_killed_launcher(tmp_path, marker):
    """SIGKILL gives the agent no chance to stop anyone: the kernel ends the workers."""
    started = time.monotonic()
    proc = start(
        ["-m", "fdp.launch", "--nproc-per-node", "2", WORKERS / "probe.py", "sleep", tmp_path],
        marker,
    )
    wait_ready(tmp_path, 2)
    proc.kill()
    finish(proc, 30, started)
    pids = [rec["pid"] for rec in records(tmp_path).values()]
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]


def test_fdp_launch_subcommand_and_busy_port(tmp_path, marker):
    """`python -m fdp launch` is the same launcher; a fixed port reaches every worker."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    proc = start(
        [
            "-m",
            "fdp",
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            port,
            WORKERS / "probe.py",
            "ok",
            tmp_path,
        ],
        marker,
    )
    out = finish(proc, 60, started)
    assert out.returncode == 0, out.output
    assert {r["env"]["MASTER_PORT"] for r in records(tmp_path).values()} == {str(port)}


def test_the_script_gets_every_argument_after_its_name_unchanged(tmp_path, marker):
    """`fdp launch --nproc-per-node 2 train.py --n 3`: --n is the script's, not ambiguous."""
    script_args = ["ok", str(tmp_path), "--n", "3", "--h", "--version", "--", "--nproc"]
    argv = ["-m", "fdp", "launch", "--nproc-per-node", "2", WORKERS / "probe.py", *script_args]
    out = finish(start(argv, marker), 60, time.monotonic())
    assert out.returncode == 0, out.output
    assert [rec["argv"][1:] for rec in records(tmp_path).values()] == [script_args] * 2


# JAX workers, joined by fdp.init: the failure of one must not leave the other hanging.


@pytest.mark.parametrize("mode", ["raise", "sigkill"])
def test_a_jax_worker_waiting_at_a_barrier_is_stopped_when_its_peer_dies(tmp_path, marker, mode):
    """Rank 0 waits at a 30-minute barrier; the launch still ends within FAILURE_BOUND s."""
    stamp = tmp_path / "failed_1"
    out = launch(["--nproc-per-node", "2"], "failing.py", [mode, stamp], marker, timeout=120)
    assert out.returncode == 1, out.output
    assert "root cause: rank 1 (local rank 1" in out.stderr
    expected = "exit code 1" if mode == "raise" else "signal SIGKILL (9)"
    assert f"ended with {expected}" in out.stderr
    if mode == "raise":
        assert "RuntimeError: rank 1 failed on purpose" in summary(out)
    assert failure_seconds(out, tmp_path) < FAILURE_BOUND


@pytest.mark.parametrize(("mode", "code"), [("raise0", 1), ("exit0", 3)])
def test_rank_0_leaves_no_coordinator_claim_when_it_fails(tmp_path, marker, mode, code):
    """The bootstrap's os._exit skipped fdp.init's release: the claim file stayed."""
    out = launch(
        ["--nproc-per-node", "2"],
        "failing.py",
        [mode, tmp_path / "stamp"],
        marker,
        timeout=120,
        TMPDIR=str(tmp_path),
    )
    assert out.returncode == 1, out.output
    assert "root cause: rank 0 (local rank 0" in out.stderr
    assert f"ended with exit code {code}" in out.stderr
    assert list(tmp_path.glob("fdp-coordinator-*.json")) == []


def test_a_straggler_is_named_by_monitored_barrier(tmp_path, marker):
    """Rank 1 never arrives; rank 0's monitored_barrier(timeout=3) names it, and the launch ends."""
    stamp = tmp_path / "failed_1"
    out = launch(["--nproc-per-node", "2"], "failing.py", ["straggle", stamp], marker, timeout=120)
    assert out.returncode == 1, out.output
    cause = summary(out)
    assert "root cause: rank 0 (local rank 0" in cause
    assert "process(es) [1] did not arrive within 3 s (arrived: [0])" in cause
    assert failure_seconds(out, tmp_path) < 3 + FAILURE_BOUND


def test_run_directories_of_killed_launchers_are_removed_at_the_next_start(tmp_path, marker):
    """A launcher killed with SIGKILL cannot clean up; the next one removes what it left."""
    dead = start(["-c", "pass"], marker)
    finish(dead, 30, time.monotonic())
    stale = tmp_path / f"fdp-launch-pid{dead.pid}-0123abcd-xyz"
    live = tmp_path / f"fdp-launch-pid{os.getpid()}-0123abcd-xyz"  # this test's: alive
    for d in (stale, live):
        (d / "attempt_0").mkdir(parents=True)
    out = launch(
        ["--nproc-per-node", "1"], "probe.py", ["ok", tmp_path], marker, timeout=60, TMPDIR=tmp_path
    )
    assert out.returncode == 0, out.output
    assert not stale.exists() and live.exists()
    assert [p.name for p in tmp_path.glob("fdp-launch-*")] == [live.name]  # its own is gone too


def test_the_watchdog_blames_the_stopped_worker_then_the_one_behind(tmp_path, marker):
    from fdp.launch._watchdog import Watchdog

    sleeper = start(["-c", "import time; time.sleep(30)"], marker)
    try:
        beats = {r: tmp_path / f"rank_{r}.heartbeat" for r in (0, 1, 2)}
        dog = Watchdog(
            0.3, [(r, sleeper.pid if r == 2 else os.getpid(), str(p)) for r, p in beats.items()]
        )
        assert dog.check({0, 1, 2}) is None  # no step yet: compiling is not a hang
        for r, n in ((0, 7), (1, 5), (2, 6)):
            beats[r].write_text(f"{n:20d}\n")
        assert dog.check({0, 1, 2}) is None
        time.sleep(0.4)
        hang = dog.check({0, 1, 2})
        assert (hang.rank, hang.steps, hang.stopped) == (1, 5, False)  # the one behind
        os.kill(sleeper.pid, signal.SIGSTOP)
        dog.check({0, 1, 2})
        time.sleep(0.4)
        hang = dog.check({0, 1, 2})
        assert (hang.rank, hang.steps, hang.stopped) == (2, 6, True)  # stopped comes first
        assert hang.describe().startswith("hung: it completed no step for 0.")
    finally:
        sleeper.kill()
        sleeper.communicate()


def _beat(path, entered, finished, flag="-", writes=1, waiting=""):
    path.write_text(f"{entered} {finished} {flag} {writes} {waiting}\n")


def test_the_watchdog_names_a_worker_absent_while_a_peer_waits_never_a_slow_compile(tmp_path):
    from fdp.launch._watchdog import Watchdog

    beats = {r: tmp_path / f"rank_{r}.heartbeat" for r in (0, 1)}
    dog = Watchdog(0.3, [(r, os.getpid(), str(p)) for r, p in beats.items()])
    _beat(beats[0], 1, 0, "c")  # rank 0 compiles its first step; rank 1 has not begun one
    dog.check({0, 1})
    time.sleep(0.4)
    assert dog.check({0, 1}) is None  # compiling (however long) waits for no one
    _beat(beats[0], 1, 0, "c", 2, "store key 'host/1'")  # now it waits for its peers
    dog.check({0, 1})
    time.sleep(0.4)
    hang = dog.check({0, 1})
    assert hang is not None
    assert (hang.rank, hang.steps, hang.stopped) == (1, 0, False)
    assert hang.describe().startswith("hung: it did not reach its first step for 0.")
    assert "while rank(s) 0 waited at store key 'host/1'" in hang.describe()
    assert [row.split()[:2] for row in hang.table] == [["rank", "steps"], ["0", "0"], ["1", "0"]]


def test_the_watchdog_says_stopped_only_when_the_process_state_says_so(tmp_path, marker):
    """Issue 32: a worker that never stepped was reported "stopped" though it was not."""
    from fdp.launch._watchdog import Watchdog, process_state

    sleeper = start(["-c", "import time; time.sleep(30)"], marker)  # never steps; not stopped
    try:
        wait_until(lambda: process_state(sleeper.pid) == "S")  # started, and sleeping
        beats = {r: tmp_path / f"rank_{r}.heartbeat" for r in (0, 1)}
        dog = Watchdog(0.3, [(0, os.getpid(), str(beats[0])), (1, sleeper.pid, str(beats[1]))])
        _beat(beats[0], 1, 0, "-", 1, "store key 'host/1'")  # rank 0 waits for rank 1
        dog.check({0, 1})
        time.sleep(0.4)
        hang = dog.check({0, 1})
        assert (hang.rank, hang.steps, hang.stopped) == (1, 0, False)
        assert hang.describe().startswith("hung: it did not reach its first step for 0.")
        assert "stopped" not in hang.describe()
        assert hang.table[2].split()[:2] == ["1", "0"] and "before its first step" in hang.table[2]
        assert "stopped" not in "".join(hang.table)
        os.kill(sleeper.pid, signal.SIGSTOP)  # now it is stopped, and says so
        wait_until(lambda: process_state(sleeper.pid) == "T")
        dog.check({0, 1})
        time.sleep(0.4)
        hang = dog.check({0, 1})
        assert (hang.rank, hang.stopped) == (1, True)
        assert hang.describe().startswith("hung: it has been stopped by a signal for 0.")
        assert hang.describe().endswith(
            "before its first step (/proc state T, e.g. SIGSTOP or SIGTSTP)"
        )
        assert "stopped by a signal (/proc state T)" in hang.table[2]
        os.kill(sleeper.pid, signal.SIGCONT)  # running again: no longer called stopped
        wait_until(lambda: process_state(sleeper.pid) == "S")
        hang = dog.check({0, 1})
        assert not hang.stopped and "stopped" not in hang.describe()
    finally:
        sleeper.kill()
        sleeper.communicate()


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_the_watchdog_never_takes_compiling_or_the_exit_for_a_hang(tmp_path):
    from fdp.launch._watchdog import Watchdog

    beats = {r: tmp_path / f"rank_{r}.heartbeat" for r in (0, 1)}
    dog = Watchdog(0.3, [(r, os.getpid(), str(p)) for r, p in beats.items()])
    _beat(beats[0], 1, 1)  # rank 0 finished its first step and waits for rank 1's...
    _beat(beats[1], 1, 0, "c")  # ...which is still compiling
    dog.check({0, 1})
    time.sleep(0.4)
    assert dog.check({0, 1}) is None
    _beat(beats[0], 5, 5, "x", 2)  # both ran their last step, and their scripts returned
    _beat(beats[1], 5, 5, "x", 2)
    dog.check({0, 1})
    time.sleep(0.4)
    assert dog.check({0, 1}) is None
    _beat(beats[1], 5, 5, "-", 3)  # one is still in its script: a pause, then a hang
    dog.check({0, 1})
    time.sleep(0.4)
    assert dog.check({0, 1}) is None  # a pause without evidence: not before idle_timeout
    dog.idle_timeout = 0.3
    hang = dog.check({0, 1})
    assert hang is not None
    assert (hang.rank, hang.steps) == (1, 5)
    assert hang.describe().startswith("hung: it completed no step for 0.")
    assert "a pause past the --idle-timeout of 0.3 s" in hang.describe()


def test_the_watchdog_takes_a_quiet_pause_for_a_hang_only_with_evidence(tmp_path):
    """Issue 44: a pause of every worker between steps was a hang after --hang-timeout."""
    from fdp.launch._watchdog import Watchdog

    beats = {r: tmp_path / f"rank_{r}.heartbeat" for r in (0, 1)}
    dog = Watchdog(0.3, [(r, os.getpid(), str(p)) for r, p in beats.items()], idle_timeout=0.8)
    asked = []

    def stacks(ranks):
        asked.append(ranks)
        return {}

    for r in (0, 1):
        _beat(beats[r], 3, 3)  # both between steps 3 and 4: an evaluation
    dog.check({0, 1}, stacks)
    time.sleep(0.4)
    assert dog.check({0, 1}, stacks) is None and asked == [[0, 1]]  # looked for a callback
    assert dog.check({0, 1}, stacks) is None and len(asked) == 1  # once per timeout
    _beat(beats[1], 3, 3, "b", 2)  # rank 1 says it is busy: never a hang, however long
    dog.check({0, 1}, stacks)
    time.sleep(0.9)
    assert dog.check({0, 1}, stacks) is None
    _beat(beats[1], 3, 3, "-", 3)  # no longer busy: a hang past the idle limit
    dog.check({0, 1}, stacks)
    time.sleep(0.9)
    hang = dog.check({0, 1}, stacks)
    assert hang is not None and hang.rank == 0
    assert "a pause past the --idle-timeout of 0.8 s" in hang.describe()
    _beat(beats[0], 3, 3, "b", 2)  # busy while its peer waits for it at a host collective
    _beat(beats[1], 3, 3, "-", 4, "fdp.runtime.barrier")  # (a checkpoint's verdict): a pause
    dog.check({0, 1}, stacks)
    time.sleep(0.4)
    assert dog.check({0, 1}, stacks) is None
    time.sleep(0.5)  # ... until the idle limit: then the busy one is blamed
    hang = dog.check({0, 1}, stacks)
    assert hang is not None and hang.rank == 0
    assert "while rank(s) 1 waited at fdp.runtime.barrier" in hang.describe()
    assert "while rank(s) 1 waited at fdp.runtime.barrier" in hang.describe()
    assert "busy" in hang.table[1]
    for r in (0, 1):  # both wait, for different keys: a deadlock, a hang after `timeout`
        _beat(beats[r], 3, 3, "-", 9, f"store key 'k{r}'")
    dog.check({0, 1}, stacks)
    time.sleep(0.4)
    hang = dog.check({0, 1}, stacks)
    assert hang is not None and "some waited for their peers at store key 'k0'" in hang.describe()


def test_every_host_of_a_multi_node_run_gets_the_same_run_id():
    common = ["--nnodes", "2", "--master-addr", "h", "--master-port", "29500", "t.py"]
    node0, node1 = parse("--node-rank", "0", *common), parse("--node-rank", "1", *common)
    assert node0.run_id == node1.run_id != parse("--node-rank", "0", *common[:-2], "1", "t.py")
    assert parse("--run-id", "mine", *common).run_id == "mine"
    assert parse("t.py").run_id != parse("t.py").run_id  # one host: a fresh id per launch


def test_the_files_a_step_call_runs_its_program_from_exist():
    """The watchdog tells a host callback inside a step by these files on the stack; a
    moved file would leave it blind (the callback tests then time out, not fail)."""
    import os

    from fdp.launch._watchdog import STEP_CALLS

    assert STEP_CALLS and all(os.path.isfile(path) for path in STEP_CALLS), STEP_CALLS
