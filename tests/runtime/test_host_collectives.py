"""Host collectives and the store: one process here, real processes at the end."""

import contextlib
import json
import pickle
import time

import numpy as np
import pytest
from _procs import WORKERS, finish, launch, start

from fdp import runtime
from fdp.launch._env import free_port
from fdp.runtime._serialize import dumps, loads


def test_one_process_collectives_return_at_once():
    runtime.barrier(timeout=1)
    runtime.monitored_barrier(timeout=1)
    assert runtime.all_gather_object((1, "a")) == [(1, "a")]
    value = runtime.broadcast_object({"w": np.arange(3.0), "t": (1, None), "b": b"\x00"})
    np.testing.assert_array_equal(value["w"], np.arange(3.0))
    assert value["t"] == (1, None) and value["b"] == b"\x00"


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: runtime.broadcast_object(1, src=1),
            ValueError,
            r"src must be a process index in 0..0, got src=1",
        ),
        (
            lambda: runtime.all_gather_object(object()),
            TypeError,
            "cannot send a value of type object",
        ),
        (lambda: runtime.barrier(timeout=0), ValueError, "timeout must be a positive number"),
    ],
)
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_serialization_round_trips_plain_data_and_never_unpickles(tmp_path):
    value = {"a": [1, 2.5, "s", b"b", None, True], 3: (np.float16(1.5), np.ones((2, 2), np.int8))}
    out = loads(dumps(value))
    assert out["a"] == value["a"] and out[3][0] == np.float16(1.5) and out[3][0].dtype == np.float16
    np.testing.assert_array_equal(out[3][1], value[3][1])

    witness = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):  # unpickling this creates the witness file
            return (open, (str(witness), "w"))

    with pytest.raises(TypeError, match="cannot send a value of type Evil"):
        dumps(Evil())
    # Bytes from a malicious peer (a pickle, as torch's object collectives send) decode
    # to inert data or fail; nothing in them runs.
    with contextlib.suppress(Exception):
        loads(pickle.dumps(Evil()))
    assert not witness.exists()


def test_store_follows_torch_semantics():
    store = runtime.Store("semantics", timeout=1)
    store.set("a/b", "1")  # '/' in a key is just a character
    assert store.get("a/b") == b"1" and not store.check(["a"])
    assert store.add("n", 2) == 2 and store.add("n", -5) == -3
    assert store.compare_set("c", "x", "y") == b"x"  # missing and expected != '': unchanged
    assert not store.check(["c"])
    assert store.compare_set("c", "", "y") == b"y"
    assert store.compare_set("c", "z", "w") == b"y"  # mismatch: the current value
    assert store.compare_set("c", b"y", b"w") == b"w"
    assert store.num_keys() == 3  # a/b, n, c
    assert store.delete("c") and not store.delete("c")
    store.set("text", "x")
    with pytest.raises(ValueError, match="key 'text' does not hold a decimal integer"):
        store.add("text", 1)
    with pytest.raises(TimeoutError, match=r"keys \['never'\] were not set within 0.2 s"):
        store.wait(["a/b", "never"], timeout=0.2)
    with pytest.raises(TimeoutError, match="key 'never' was not set within 0.2 s"):
        store.get("never", timeout=0.2)
    with pytest.raises(TypeError, match="value must be str or bytes, got int"):
        store.set("k", 3)
    assert runtime.Store("other").num_keys() == 0  # namespaces do not share keys


# Real processes.


def results(output):
    found = [
        json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line
    ]
    return {r["process_index"]: r for r in found}


def check_two_processes(res, local_world_size):
    assert sorted(res) == [0, 1]
    for rank, r in res.items():
        assert (r["rank_env"], r["process_count"], r["devices"], r["local_devices"]) == (
            rank,
            2,
            4,
            2,
        )
        assert r["local_world_size"] == local_world_size
        assert r["broadcast"] == {"from": 1, "t": [1, 2], "a": [1, 2, 3]}
        assert r["gathered"] == [{"rank": 0, "host_value": 0}, {"rank": 1, "host_value": 10}]
        assert (r["config"], r["counter_after_all"], r["leaders"], r["check"]) == (
            "lr=0.1",
            2,
            1,
            True,
        )
        assert r["num_keys"] == 5  # config, arrivals, leader, ready/0, ready/1
        assert r["get_timeout"][0] == "Store.get: key 'never-set' was not set within 1 s."
        assert r["assembled"] == [0, 0, 1, 1]  # local batches in process order


def test_two_processes_under_fdp_launch(marker):
    out = launch(["--nproc-per-node", "2"], "host_collectives.py", [], marker, timeout=120)
    assert out.returncode == 0, out.output
    res = results(out.stdout)
    check_two_processes(res, local_world_size=2)
    assert [res[r]["local_rank"] for r in (0, 1)] == [0, 1]


def test_two_nodes_by_two_launchers(marker):
    """`fdp launch --nnodes 2` on each 'node' (both on localhost here)."""
    port = free_port()
    common = [
        "-m",
        "fdp.launch",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    started = time.monotonic()
    procs = [
        start([*common, "--node-rank", r, WORKERS / "host_collectives.py"], marker) for r in (0, 1)
    ]
    outs = [finish(p, 120, started) for p in procs]
    for out in outs:
        assert out.returncode == 0, out.output
    res = {**results(outs[0].stdout), **results(outs[1].stdout)}
    check_two_processes(res, local_world_size=1)
    assert [res[r]["local_rank"] for r in (0, 1)] == [0, 0]


def test_two_processes_by_hand_with_fdp_variables(marker):
    """No launcher: each process gets FDP_* variables, as on hosts started by hand."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    procs = []
    for rank in (0, 1):
        env = dict(
            FDP_COORDINATOR_ADDRESS=address,
            FDP_NUM_PROCESSES="2",
            FDP_PROCESS_ID=str(rank),
            FDP_LOCAL_RANK=str(rank),
            FDP_LOCAL_WORLD_SIZE="2",
        )
        procs.append(start([WORKERS / "host_collectives.py"], marker, **env))
    outs = [finish(p, 120, started) for p in procs]
    for out in outs:
        assert out.returncode == 0, out.output
    check_two_processes({**results(outs[0].stdout), **results(outs[1].stdout)}, local_world_size=2)


def test_a_faulty_peer_gets_errors_that_name_the_key_the_peer_and_the_expectation(marker):
    """Garbage payload, a stray key, a different collective, unequal local batches (8 and 6
    rows, which main trained on silently): fdp's errors, and then on."""
    out = launch(["--nproc-per-node", "2"], "hostile.py", [], marker, timeout=120)
    assert out.returncode == 0, out.output
    res = results(out.stdout)
    for rank in (0, 1):
        kind, message = res[rank]["garbage"]
        assert kind == "SerializationError", message
        assert "the value of process 0 (key 'fdp/host/0/broadcast_object/value')" in message
        assert "not a value encoded by fdp.runtime (FormatError)" in message
        kind, message = res[rank]["stray"]
        assert kind == "RuntimeError", message
        assert "found the key 'fdp/host/3/all_gather_object/in/x'" in message
        assert "only fdp/host/3/all_gather_object/in/0 to" in message
        assert res[rank]["after"] == [0, 1]
        kind, message = res[rank]["rows"]
        assert kind == "ValueError", message
        assert "same number of rows; got process 0: 8, process 1: 6" in message
        assert res[rank]["equal_rows"] == [8, 2]
    # Found when both reach call #4, not after a timeout: each process is named with its call.
    for rank, own in ((0, "barrier"), (1, "broadcast_object")):
        kind, message = res[rank]["mismatch"]
        assert kind == "RuntimeError", message
        assert message.startswith(
            f"fdp.runtime.{own}: host collective #4 differs across processes: process 0 "
            "called barrier, process 1 called broadcast_object (every process must call"
        )
    # On main each got the other's value: "got process 0: 3, process 1: 8b0df479bbba...".
    crossed = (
        "host collective #7 differs across processes: process 0 called all_gather_object "
        "for fdp.shard_batch's row count check, process 1 called all_gather_object for "
        "fdp.train_step's settings check"
    )
    for rank in (0, 1):
        kind, message = res[rank]["crossed"]
        assert kind == "RuntimeError", message
        assert crossed in message


@pytest.mark.parametrize("bad", [float("nan"), 0, -1, "5", True])
def test_store_and_collective_timeouts_must_be_positive_numbers(bad):
    error = TypeError if isinstance(bad, str | bool) else ValueError
    with pytest.raises(error, match="timeout must be a"):
        runtime.Store("bad-timeout", timeout=bad)
    store = runtime.Store("bad-timeout", timeout=1)
    with pytest.raises(error, match="timeout must be a"):
        store.get("k", timeout=bad)
    for call in (runtime.barrier, runtime.monitored_barrier):
        with pytest.raises(error, match="timeout must be a"):
            call(timeout=bad)


def test_infinite_and_numpy_timeouts_are_accepted():
    store = runtime.Store("inf-timeout", timeout=float("inf"))
    store.set("k", "v")  # (took a lock with an infinite deadline)
    assert store.get("k", timeout=np.float32(2)) == b"v"
    store.wait(["k"], timeout=float("inf"))
    runtime.barrier(timeout=float("inf"))
    runtime.monitored_barrier(timeout=np.float64(1e308))
    assert runtime.broadcast_object(1, timeout=float("inf")) == 1


def test_a_lock_held_by_a_non_utf8_holder_is_named():
    from fdp.runtime import _store

    store = runtime.Store("locked", timeout=0.2)
    store._backend.set("fdp/store-lock/locked/k", b"\xff\xfe peer", overwrite=False)
    try:
        with pytest.raises(TimeoutError, match="key 'k' stayed locked by '\ufffd\ufffd peer'"):
            store.set("k", "v")
    finally:
        _store._LOCAL.delete("fdp/store-lock/locked/k")
