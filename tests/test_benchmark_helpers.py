"""The pure helpers behind benchmarks/overlap.py compute what docs/benchmarks.md says."""

from __future__ import annotations

import doctest
import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


trace = _load("_overlap_trace")


def test_overlap_trace_doctests_pass():
    result = doctest.testmod(trace, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5
    assert result.failed == 0


def test_collectives_reads_tuples_and_fdp_ffi_sums_and_skips_compute():
    hlo = "\n".join(
        [
            "  %ar.1 = (f32[8]{0}, bf16[4]{0}) all-reduce(f32[8]{0} a, bf16[4]{0} b)",
            '  shm.2 = f32[16]{0} custom-call(f32[16]{0} c), custom_call_target="fdp_shm_sum"',
            '  other.3 = f32[16]{0} custom-call(f32[16]{0} c), custom_call_target="cholesky"',
            "  ROOT dot.4 = f32[2,2]{1,0} dot(f32[2,3]{1,0} x, f32[3,2]{1,0} y)",
        ]
    )
    assert trace.collectives(hlo) == {
        "ar.1": ("all-reduce", 8 * 4 + 4 * 2),
        "shm.2": ("fdp_shm_sum", 16 * 4),
    }


def test_only_thunk_spans_of_the_module_count():
    events = [
        {"name": "psum.1", "ts": 0, "dur": 10, "tid": 1,
         "args": {"hlo_module": "m", "hlo_op": "psum.1", "run_id": "5"}},
        {"name": "dot.2", "ts": 2, "dur": 4, "tid": 2,
         "args": {"hlo_module": "m", "hlo_op": "dot.2", "run_id": "5"}},
        # Not thunks of m: a span without an instruction, an end marker, another module.
        {"name": "ThunkExecutor::Execute", "ts": 0, "dur": 50, "tid": 2,
         "args": {"hlo_module": "m"}},
        {"name": "end: dot.2", "ts": 40, "dur": 1, "tid": 2, "args": {}},
        {"name": "add.9", "ts": 0, "dur": 10, "tid": 3,
         "args": {"hlo_module": "other", "hlo_op": "add.9", "run_id": "5"}},
    ]  # fmt: skip
    runs = trace.thunk_intervals(events, "m")
    assert [t["op"] for t in runs["5"]] == ["psum.1", "dot.2"]
    result = trace.overlap(runs, {"psum.1": ("all-reduce", 4)})
    assert result["buckets"][0]["hidden_fraction"] == 0.4
    assert result["step"]["exposed_ms"] == 6 / 1e3


def test_torch_intervals_name_buckets_in_launch_order_within_each_step():
    events = [
        {"name": "bench_step", "ts": 0, "dur": 100, "tid": 1},
        {"name": "gloo:all_reduce", "ts": 60, "dur": 20, "tid": 7},
        {"name": "gloo:all_reduce", "ts": 30, "dur": 20, "tid": 8},
        {"name": "autograd::engine::evaluate_function: MmBackward0", "ts": 35, "dur": 10,
         "tid": 1},
        {"name": "aten::zero_", "ts": 40, "dur": 5, "tid": 1},
        {"name": "bench_step", "ts": 100, "dur": 100, "tid": 1},
        {"name": "gloo:all_reduce", "ts": 150, "dur": 20, "tid": 7},
    ]  # fmt: skip
    runs = trace.torch_intervals(events, "bench_step")
    first = {t["op"]: t["start"] for t in runs["0"] if t["op"].startswith("bucket")}
    assert first == {"bucket0": 30, "bucket1": 60}
    assert [t["op"] for t in runs["1"]] == ["bucket0"]
    colls = {"bucket0": ("gloo:all_reduce", 8), "bucket1": ("gloo:all_reduce", 8)}
    result = trace.overlap(runs, colls)
    assert result["buckets"][0]["hidden_ms"] == 5 / 1e3  # median of 10 and 0 us


def test_the_bound_counts_every_byte_the_shared_memory_sum_moves():
    """shm_bound.py's traffic, against the kernel's three passes counted one by one: copy
    the peers' shares in (read and write each), sum one's own share (read it from every
    process, write it to the output and to shared memory), copy the peers' sums out."""
    bound = _load("shm_bound")
    result = doctest.testmod(bound)
    assert result.attempted >= 2 and result.failed == 0
    for world in range(2, 6):
        share = 4096
        n = share * world
        copy_in = 2 * (world - 1) * share
        summed = world * share + 2 * share
        copy_out = 2 * (world - 1) * share
        expected = copy_in + summed + copy_out
        assert abs(bound.traffic_bytes(n, world) - expected) < 1e-9 * expected, world
