"""Overlap read from a compiled program's schedule: what runs while each collective flies.

A compiled XLA:GPU module is scheduled (``is_scheduled=true``): the order of the
instructions of its entry computation is the order the GPU's compute stream
issues them, and each collective is an async ``*-start`` / ``*-done`` pair on
the communication stream. Between a start and its done, the compute stream
runs whatever the scheduler put there; that work hides the collective.

:func:`read_schedule` walks that order with a two-stream model: matrix products
take their FLOPs over the GPU's peak, collectives a fixed latency plus their ring
bytes over one link's bandwidth, one at a time on the communication stream, and a ``*-done``
waits for its collective. The time the compute stream waits at the dones is
the *exposed* communication. It is an estimate from the program's structure
(peak rates, no launch latency, elementwise work free), good for comparing two
programs of the same model on the same target; it is not a timing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from fdp.observe._hlo import _HLO_OPS, bucket_indices, collective_stats

_START = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.-]+) = .*? (?P<op>" + "|".join(_HLO_OPS) + r")-start\("
)
_DONE = re.compile(
    r"^\s*(?:ROOT )?%[\w.-]+ = .*? (?:" + "|".join(_HLO_OPS) + r")-done\(%(?P<start>[\w.-]+)\)"
)
_SYNC = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = .*? (?:" + "|".join(_HLO_OPS) + r")\(")
_DEF = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.-]+) = (?P<type>\S+)")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of the schedule.

    Attributes:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``...
      buckets: fdp's buckets it carries (from its metadata; may be empty).
      nbytes: per-device result bytes.
      sent_bytes: ring bytes each device sends (:attr:`fdp.observe._hlo.Collective.sent_bytes`).
      position: index of its start in the entry computation's schedule.
      flops_in_flight: matrix-product FLOPs the compute stream issues between
        its start and its done (0 for a synchronous collective).
      flops_after_start: the share of the program's matrix-product FLOPs issued
        after its start (how much of the step is still to run when it starts).
      products_in_flight: how many instructions with matrix products (gemm
        fusions, a loop counted once) the compute stream issues between its
        start and its done: how far ahead of its use a gather starts.
      seconds: its time alone on the link.
      exposed_seconds: the time the compute stream waited for it.
      backward: traced in a transpose (its metadata's ``op_name`` says
        ``transpose(``): the backward pass's, not the forward pass's.
    """

    kind: str
    buckets: tuple[int, ...]
    nbytes: int
    sent_bytes: float
    position: int
    flops_in_flight: float
    seconds: float
    exposed_seconds: float
    flops_after_start: float = 0.0
    products_in_flight: int = 0
    backward: bool = False


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The overlap estimate of one compiled program on one target.

    Attributes:
      collectives: every collective of the entry computation, in schedule order;
        a loop that communicates contributes its collectives once per trip.
      compute_seconds: matrix products at peak (the entry computation, loops
        counted by their known trip counts).
      comm_seconds: every collective alone on the link, summed.
      exposed_seconds: communication the compute stream waits for.
    """

    collectives: tuple[ScheduledCollective, ...]
    compute_seconds: float
    comm_seconds: float
    exposed_seconds: float

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication time hidden behind computation (1.0 with none)."""
        if self.comm_seconds == 0:
            return 1.0
        return 1.0 - self.exposed_seconds / self.comm_seconds


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in text.splitlines():
        m = re.match(r"(ENTRY )?%([\w.-]+) \(.*\{\s*$", line)
        if name is None and m:
            name = m[2]
            comps[name] = []
            if m[1]:
                entry = name
            continue
        if name is not None:
            if line.startswith("}"):
                name = None
            else:
                comps[name].append(line)
    return comps, entry


def _first_array(type_text: str) -> tuple[str, tuple[int, ...]] | None:
    m = _ARRAY.search(type_text)
    if m is None:
        return None
    return m[1], tuple(int(d) for d in m[2].split(",") if d)


def _dot_flops(line: str, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[float, str]:
    """``(FLOPs, dtype)`` of a ``dot`` or a cuBLAS gemm custom call; ``(0, '')`` otherwise."""
    is_dot = " dot(" in line
    is_gemm = "custom-call(" in line and re.search(r'custom_call_target="__cublas', line)
    if not (is_dot or is_gemm):
        return 0.0, ""
    out = _first_array(line.split("=", 1)[1])
    operands = re.search(r"(?:dot|custom-call)\(%([\w.-]+)", line)
    if out is None or operands is None or operands[1] not in shapes:
        return 0.0, ""
    # Priced by the operands' dtype: a bf16 product accumulating into f32 runs at bf16's rate.
    lhs_dtype, lhs = shapes[operands[1]]
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line) or re.search(
        r'"lhs_contracting_dimensions":\[([^\]]*)\]', line
    )
    contracting = [int(d.strip('" ')) for d in dims[1].split(",") if d.strip('" ')] if dims else []
    k = math.prod(lhs[d] for d in contracting if d < len(lhs))
    return 2.0 * math.prod(out[1]) * k, lhs_dtype


def _called(line: str) -> list[str]:
    return re.findall(r"(?:calls|to_apply|body)=%([\w.-]+)", line)


def _trip_count(line: str) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    return int(m[1]) if m else 1


def read_schedule(program: Any, target: Any) -> Schedule:
    """The overlap estimate of a compiled program's schedule on ``target``.

    Args:
      program: a ``jax.stages.Compiled`` (or its text) compiled for a GPU.
      target: a :class:`fdp.observe.GpuTarget` or its name (peak FLOP/s, link bandwidth).

    Returns:
      A :class:`Schedule`.
    """
    from fdp.observe._gpu import gpu_target

    spec = gpu_target(target)
    text = program if isinstance(program, str) else program.as_text()
    comps, entry = _computations(text)
    if entry is None:
        raise ValueError("the program has no ENTRY computation: pass a compiled program.")
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for lines in comps.values():
        for line in lines:
            m = _DEF.match(line)
            arr = _first_array(m["type"]) if m else None
            if m and arr:
                shapes[m["name"]] = arr

    memo: dict[str, tuple[float, float]] = {}

    def cost_of(comp: str, depth: int = 0) -> tuple[float, float]:
        if comp in memo or depth > 32:
            return memo.get(comp, (0.0, 0.0))
        memo[comp] = (0.0, 0.0)  # guards recursion
        costs = [line_cost(line, depth + 1) for line in comps.get(comp, [])]
        memo[comp] = (sum(c[0] for c in costs), sum(c[1] for c in costs))
        return memo[comp]

    def line_cost(line: str, depth: int) -> tuple[float, float]:
        """``(seconds, FLOPs)`` of one instruction's matrix products, called ones included."""
        flops, dtype = _dot_flops(line, shapes)
        seconds = flops / spec.flops_per_s(dtype) if flops else 0.0
        trips = _trip_count(line) if " while(" in line else 1
        for comp in _called(line):
            inner = cost_of(comp, depth)
            seconds += inner[0] * trips
            flops += inner[1] * trips
        return seconds, flops

    collectives: list[ScheduledCollective] = []
    issued_at_start: list[float] = []
    # start name -> (index, end, flops at start, products at start)
    pending: dict[str, tuple[int, float, float, int]] = {}
    clock = {"t": 0.0, "link": 0.0, "compute": 0.0, "exposed": 0.0, "flops": 0.0, "products": 0}

    def walk(lines: list[str], position: int | None) -> None:
        """Runs ``lines`` on the two streams (``position``: the loop's, inside one)."""
        for index, line in enumerate(lines):
            where = index if position is None else position
            start, done = _START.match(line), _DONE.match(line)
            loop = re.search(r" while\(.*?body=%([\w.-]+)", line)
            if loop and any(_START.match(x) or _SYNC.match(x) for x in comps.get(loop[1], [])):
                # A loop that communicates (plain jit's accumulation): every trip in order.
                for _ in range(_trip_count(line)):
                    walk(comps[loop[1]], where)
                continue
            if start or (_SYNC.match(line) and not done):
                ops = collective_stats(line).ops
                if ops:
                    issue(ops[0], line, where, bool(start), start["name"] if start else "")
                continue
            if done and done["start"] in pending:
                finish(done["start"])
                continue
            seconds, flops = line_cost(line, 0)
            clock["t"] += seconds
            clock["compute"] += seconds
            clock["flops"] += flops
            clock["products"] += flops > 0

    def issue(op: Any, line: str, where: int, is_async: bool, name: str) -> None:
        alone = spec.collective_latency_s + op.sent_bytes / spec.link_bytes_per_s
        clock["link"] = max(clock["t"], clock["link"]) + alone
        issued_at_start.append(clock["flops"])
        waited = 0.0
        if is_async:
            pending[name] = (len(collectives), clock["link"], clock["flops"], clock["products"])
        else:  # synchronous: the compute stream waits for it, and for the link before it
            waited = clock["link"] - clock["t"]
            clock["exposed"] += waited
            clock["t"] = clock["link"]
        collectives.append(
            ScheduledCollective(
                op.kind,
                bucket_indices(line),
                op.nbytes,
                op.sent_bytes,
                where,
                0.0,
                alone,
                waited,
                backward="transpose(" in line,
            )
        )

    def finish(name: str) -> None:
        index, end, flops_then, products_then = pending.pop(name)
        waited = max(0.0, end - clock["t"])
        clock["exposed"] += waited
        clock["t"] = max(clock["t"], end)
        collectives[index] = dataclasses.replace(
            collectives[index],
            flops_in_flight=clock["flops"] - flops_then,
            products_in_flight=int(clock["products"] - products_then),
            exposed_seconds=waited,
        )

    walk(comps[entry], None)
    compute, exposed, flops_done = clock["compute"], clock["exposed"], clock["flops"]
    comm = sum(c.seconds for c in collectives)
    if flops_done:
        collectives = [
            dataclasses.replace(c, flops_after_start=1.0 - issued / flops_done)
            for c, issued in zip(collectives, issued_at_start, strict=True)
        ]
    return Schedule(tuple(collectives), compute, comm, exposed)
