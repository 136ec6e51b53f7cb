"""Per-bucket overlap of communication and compute, read from XLA:CPU's own profile.

XLA:CPU's thunk executor records every thunk it runs in a ``jax.profiler`` trace: an
event spanning the thunk's execution, named after the HLO instruction, with the module
and a ``run_id`` per execution. A collective's hidden time is the part of its execution
during which some compute thunk of the same program executes too (on another thread);
the rest is exposed: nothing else of the step progresses meanwhile.

Which thunks are collectives, and how many bytes each moves, comes from the compiled
program's HLO text (``lowered.compile().as_text()``): the instruction names are the
thunk names.

PyTorch DDP, for comparison (``torch_intervals``): ``torch.profiler`` records each
bucket's ``gloo:all_reduce`` on ProcessGroupGloo's worker threads, and the backward
pass's ``autograd::engine::evaluate_function: ...`` and the optimizer step on the
training thread; the same measure applies, with those as the compute.

    >>> hlo = "  psum.3 = f32[4]{0} all-reduce(f32[4]{0} x), replica_groups={}"
    >>> collectives(hlo)
    {'psum.3': ('all-reduce', 16)}
    >>> union([(0, 2), (1, 3), (5, 6)])
    4

A collective of 10 ms beside 3 ms of compute on another thread (and a parent span on
its own thread, which does not count):

    >>> run = [
    ...     {"op": "psum.3", "start": 0, "end": 10_000, "tid": 1},
    ...     {"op": "while.1", "start": 0, "end": 10_000, "tid": 1},
    ...     {"op": "dot.2", "start": 5_000, "end": 8_000, "tid": 2},
    ... ]
    >>> result = overlap({"7": run}, {"psum.3": ("all-reduce", 16)})
    >>> result["buckets"][0]["hidden_fraction"], result["step"]["exposed_ms"]
    (0.3, 7.0)
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import re
import statistics
from collections import defaultdict

COLLECTIVE_OPCODES = (
    "all-reduce",
    "all-reduce-start",
    "reduce-scatter",
    "all-gather",
    "all-gather-start",
    "all-to-all",
    "collective-permute",
    "collective-permute-start",
)
# fdp's own collectives, called through XLA's FFI (the shared-memory sum).
COLLECTIVE_TARGETS = ("fdp_shm_sum",)

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\(")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}


def _nbytes(shape: str) -> int:
    """Bytes of an HLO result shape (an array or a tuple of arrays)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype) or int(dtype[1:])
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def collectives(hlo_text: str) -> dict[str, tuple[str, int]]:
    """Instruction name -> (opcode or FFI target, result bytes) of every collective."""
    found = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        if opcode in COLLECTIVE_OPCODES:
            found[name] = (opcode, _nbytes(shape))
        elif opcode == "custom-call":
            target = next((t for t in COLLECTIVE_TARGETS if f'"{t}"' in line), None)
            if target:
                found[name] = (target, _nbytes(shape))
    return found


def union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a list of (start, end) intervals."""
    return sum(end - start for start, end in _disjoint(intervals))


def _clip(intervals, start: float, end: float) -> list[tuple[float, float]]:
    return [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]


def load_events(trace_dir: str) -> list[dict]:
    """The complete ('X') events of the newest perfetto trace under ``trace_dir``."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def thunk_intervals(events: list[dict], module: str) -> dict[str, list[dict]]:
    """Per execution (run_id) of ``module``: its thunks with start, end and thread.

    A thunk's interval is its start event: the thunk's ``Execute`` call, which does
    the thunk's work on that thread (a collective blocks in it until the peers are
    done). The ``end: <name>`` events are not used: they mark when the executor
    processed a completion, which can be long after the work (a completion queued
    behind the rest of the step on a busy pool thread).
    """
    runs: dict[str, list[dict]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["ts"]):
        args = e.get("args", {})
        if args.get("hlo_module") != module or "hlo_op" not in args:
            continue  # only thunk spans (a thunk names its HLO instruction)
        runs[args.get("run_id", "")].append(
            {
                "op": args["hlo_op"],
                "start": e["ts"],
                "end": e["ts"] + e.get("dur", 0.0),
                "tid": e["tid"],
            }
        )
    return dict(runs)


TORCH_COMPUTE = ("autograd::engine::evaluate_function: ", "Optimizer.step")


def torch_intervals(events: list[dict], step_name: str, comm_name: str = "gloo:all_reduce"):
    """Per step (a ``record_function(step_name)`` window): DDP's buckets and compute.

    Returns the runs in :func:`overlap`'s form; the i-th all-reduce that starts in a
    step is named ``bucket<i>`` (DDP launches its buckets in index order).
    """
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == step_name)
    runs: dict[str, list[dict]] = {}
    for k, (start, end) in enumerate(windows):
        inside = [e for e in events if start <= e["ts"] < end]
        comm = sorted((e for e in inside if e["name"] == comm_name), key=lambda e: e["ts"])
        thunks = [
            {"op": f"bucket{i}", "start": e["ts"], "end": e["ts"] + e["dur"], "tid": e["tid"]}
            for i, e in enumerate(comm)
        ]
        thunks += [
            {"op": e["name"], "start": e["ts"], "end": e["ts"] + e["dur"], "tid": e["tid"]}
            for e in inside
            if e["name"].startswith(TORCH_COMPUTE)
        ]
        runs[str(k)] = thunks
    return runs


def overlap(runs: dict[str, list[dict]], colls: dict[str, tuple[str, int]]) -> dict:
    """Per-bucket and per-step overlap over the traced executions (times in ms).

    Each collective's figures are medians over the steps; collectives are numbered by
    their median start within a step (bucket 0 launches first: in the reverse-order
    plan, the last layers' gradients).
    """
    per_op: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    steps = []
    for thunks in runs.values():
        comm = [t for t in thunks if t["op"] in colls]
        compute = [t for t in thunks if t["op"] not in colls]
        if not comm:
            continue
        first = min(t["start"] for t in thunks)
        last = max(t["end"] for t in thunks)
        comm_iv = [(t["start"], t["end"]) for t in comm]
        comm_total = union(comm_iv)
        # Hidden: collective time during which another thread runs a compute thunk (on
        # its own thread, a span around the collective is a parent, not concurrent work).
        beside = [
            _clip(
                [(c["start"], c["end"]) for c in compute if c["tid"] != t["tid"]],
                t["start"],
                t["end"],
            )
            for t in comm
        ]
        hidden_total = union([piece for pieces in beside for piece in pieces])
        steps.append(
            {
                "step_ms": (last - first) / 1e3,
                "communication_ms": comm_total / 1e3,
                "hidden_ms": hidden_total / 1e3,
                "exposed_ms": (comm_total - hidden_total) / 1e3,
                "threads_running_collectives": len({t["tid"] for t in comm}),
            }
        )
        for t, pieces in zip(comm, beside, strict=True):
            rec = per_op[t["op"]]
            rec["ms"].append((t["end"] - t["start"]) / 1e3)
            rec["hidden_ms"].append(union(pieces) / 1e3)
            rec["start_ms"].append((t["start"] - first) / 1e3)
    med = statistics.median
    buckets = []
    for i, op in enumerate(sorted(per_op, key=lambda op: med(per_op[op]["start_ms"]))):
        rec = per_op[op]
        ms, hidden = med(rec["ms"]), med(rec["hidden_ms"])
        buckets.append(
            {
                "bucket": i,
                "op": op,
                "kind": colls[op][0],
                "mib": colls[op][1] / 2**20,
                "start_ms": med(rec["start_ms"]),
                "ms": ms,
                "hidden_ms": hidden,
                "hidden_fraction": hidden / ms if ms > 0 else float("nan"),
            }
        )
    # Means over the traced steps, so that exposed = communication - hidden holds.
    summary = {k: statistics.fmean(s[k] for s in steps) for k in steps[0]} if steps else {}
    if summary:
        summary["hidden_fraction"] = (
            summary["hidden_ms"] / summary["communication_ms"]
            if summary["communication_ms"] > 0
            else float("nan")
        )
        summary["steps"] = len(steps)
    return {"buckets": buckets, "step": summary}


def op_times(runs: dict[str, list[dict]], top: int | None = None) -> dict[str, float]:
    """Median milliseconds per step of each instruction's thunks, largest first.

    An instruction whose thunk runs several times in one step counts the sum. Spans of
    parents (``while``, ``call``) include their children's time.

    >>> t = lambda op, start, end: {"op": op, "start": start, "end": end, "tid": 1}
    >>> op_times({"1": [t("a", 0, 2000), t("a", 3000, 4000)], "2": [t("a", 0, 1000)]})
    {'a': 2.0}
    """
    per_step: dict[str, list[float]] = defaultdict(list)
    for thunks in runs.values():
        acc: dict[str, float] = defaultdict(float)
        for t in thunks:
            acc[t["op"]] += (t["end"] - t["start"]) / 1e3
        for op, ms in acc.items():
            per_step[op].append(ms)
    med = {op: statistics.median(ms) for op, ms in per_step.items()}
    return dict(sorted(med.items(), key=lambda kv: -kv[1])[:top])  # top=None: all


def _disjoint(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as disjoint (start, end) pieces."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]
