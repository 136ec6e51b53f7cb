"""Counting the collectives of a lowered or compiled program, with their bytes.

XLA regroups collectives (the CPU compiler merges every all-reduce of a step into
one; the GPU combiner merges up to a threshold), so what a program really does is
read from its text: the lowered StableHLO shows what fdp emitted, the compiled HLO
what the platform's compiler made of it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

import numpy as np

from fdp import _compat

_HLO_BITS = {
    "pred": 8,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f8e4m3fn": 8,
    "f8e5m2": 8,
}
_MLIR_BITS = {
    "i1": 8,
    "i4": 4,
    "ui4": 4,
    "i8": 8,
    "ui8": 8,
    "i16": 16,
    "ui16": 16,
    "i32": 32,
    "ui32": 32,
    "i64": 64,
    "ui64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "complex<f32>": 64,
    "complex<f64>": 128,
    "f8E4M3FN": 8,
    "f8E5M2": 8,
}
_HLO_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# fdp's shared-memory sum (fdp.backends.cpu, the default on CPU processes of one
# host): an FFI custom call, listed as the kind "shm-sum".
_SHM_TARGET = "fdp_shm_sum"
_MLIR_OPS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "collective_permute": "collective-permute",
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op.

    Attributes:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
        ``collective-permute``, or ``shm-sum`` (fdp's all-reduce through shared
        memory between the processes of one host).
      dtypes: element type of each result (HLO spelling, e.g. ``f32``, ``bf16``).
      shapes: shape of each result, per device.
      nbytes: bytes of all results, per device.
      replica_groups: the replica groups as written in the program; StableHLO's
        mesh-axes groups (``#stablehlo.replica_group_mesh_axes``, whose mesh
        is declared apart) in the compiled-HLO mesh spelling
        ``mesh['x'=4,'y'=2] {'x'}``; empty where the op names none.
      buckets: the indices of fdp's buckets the op carries, read from its
        metadata (``fdp_bucket_N`` scopes; several when XLA combined buckets
        into one op); empty for other collectives or where XLA dropped the
        metadata.
    """

    kind: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    replica_groups: str
    buckets: tuple[int, ...] = ()

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The replica groups, as tuples of logical device ids.

        Reads every spelling the programs use: explicit groups (``{{0,2},{1,3}}``
        in HLO, ``[[0, 2], [1, 3]]`` from StableHLO's ``dense<...>``), iota groups
        ``[G,S]<=[dims]T(perm)`` (an iota over the devices, reshaped to ``dims``,
        transposed by ``perm``, then cut into ``G`` groups of ``S``) and mesh groups
        ``mesh['x'=4,'y'=2] {'x'}``, with or without ``device_ids=(...)`` and
        sub-axes ``'x':(1)2`` (the devices along the named axes, the other axes
        fixed). StableHLO's mesh-axes groups are read as mesh groups (see
        :attr:`replica_groups`). A device id is a position in the program's
        device assignment (the flattened mesh).

        Returns:
          One tuple per group, in the program's order; ``()`` when the program
          names no groups (the op then spans all devices).

        Raises:
          ValueError: ``replica_groups`` is in no spelling above.

        Example:
          >>> line = ("%ar = f32[8]{0} all-reduce(f32[8]{0} %p), channel_id=1, "
          ...         "replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add")
          >>> (op,) = collective_stats(line).ops
          >>> op.groups
          ((0, 2, 4, 6), (1, 3, 5, 7))
          >>> op.group_size
          4
        """
        return _read_groups(self.replica_groups)

    @property
    def group_size(self) -> int:
        """Devices in each replica group, from :attr:`groups` (1 when the program names none)."""
        return max((len(g) for g in self.groups), default=1)

    @property
    def sent_bytes(self) -> float:
        """Bytes each device sends for this op with the usual ring algorithms.

        all-reduce ``2 (g-1)/g x B``; all-gather ``(g-1)/g x B`` (B: the gathered
        result); reduce-scatter ``(g-1) x B`` (B: the scattered result);
        all-to-all ``(g-1)/g x B``; collective-permute ``B``; shm-sum ``B`` (written
        to shared memory: the peers' shares, then this process's summed share).
        """
        g = self.group_size
        factor = {
            "all-reduce": 2 * (g - 1) / g,
            "all-gather": (g - 1) / g,
            "reduce-scatter": g - 1,
            "all-to-all": (g - 1) / g,
            "collective-permute": 1,
            "shm-sum": 1,
        }[self.kind]
        return factor * self.nbytes


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """The collectives of one program.

    Attributes:
      source: ``"stablehlo"`` (lowered: what fdp emitted) or ``"hlo"``
        (compiled: what XLA made of it).
      ops: every collective, in program order.
    """

    source: str
    ops: tuple[Collective, ...]

    def count(self, kind: str = "all-reduce") -> int:
        """Number of ``kind`` ops."""
        return sum(op.kind == kind for op in self.ops)

    def nbytes(self, kind: str = "all-reduce") -> int:
        """Per-device result bytes over all ``kind`` ops."""
        return sum(op.nbytes for op in self.ops if op.kind == kind)

    def sent_bytes(self) -> float:
        """Bytes each device sends over all collectives (ring estimate).

        See :attr:`Collective.sent_bytes`.
        """
        return sum(op.sent_bytes for op in self.ops)

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "bytes": b}}`` for every kind present."""
        out: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
        for op in self.ops:
            out[op.kind]["count"] += 1
            out[op.kind]["bytes"] += op.nbytes
        return dict(out)


_MESH_GROUPS = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>(?:[^()]|\([^()]*\))*)\))?"
    r"\s*\{(?P<grouped>[^}]*)\}"
)
_IOTA_GROUPS = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


def _ints(text: str) -> list[int]:
    return [int(i) for i in re.findall(r"-?\d+", text)]


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """``[dims]T(perm)``: an iota over ``prod(dims)``, reshaped to ``dims``, transposed, flat."""
    shape = _ints(dims)
    devices = np.arange(math.prod(shape)).reshape(shape)
    return devices.transpose(_ints(perm) if perm else None).ravel()


def _mesh_groups(axes: str, ids: str | None, grouped: str) -> np.ndarray:
    """The groups of ``mesh[axes], device_ids=(ids) {grouped}``, as XLA computes them.

    Each mesh axis is split into the sub-axes the groups name (``'x':(pre)size``:
    the sub-axis of ``size`` after ``pre`` major devices); the devices are laid
    out on these dimensions, the grouped ones moved last in the order named, and
    read in groups.
    """
    sizes = {n: int(k) for n, k in re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", axes)}
    refs = [
        (m[1], (int(m[2]), int(m[3])) if m[2] else None)
        for m in re.finditer(r"'?([^',:()\s]+)'?(?::\((\d+)\)(\d+))?", grouped)
    ]
    if not sizes or any(name not in sizes for name, _ in refs):
        raise ValueError(f"mesh groups name axes their mesh lacks: {grouped!r} of {axes!r}.")
    total = math.prod(sizes.values())
    if ids is None or not ids.strip():
        devices = np.arange(total)
    elif iota := re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", ids):
        devices = _iota(iota[1], iota[2])
    else:
        devices = np.array(_ints(ids))
    dims: list[int] = []  # the mesh's axes, split where the groups take sub-axes
    where: dict[tuple[str, tuple[int, int] | None], int] = {}
    for name, size in sizes.items():
        cuts = sorted(sub for n, sub in refs if n == name and sub is not None)
        if any(n == name and sub is None for n, sub in refs):
            where[name, None] = len(dims)
            dims.append(size)
            continue
        done = 1  # devices of the axis laid out so far, major first
        for pre, sub in cuts:
            if pre != done:
                dims.append(pre // done)
            where[name, (pre, sub)] = len(dims)
            dims.append(sub)
            done = pre * sub
        if done != size:
            dims.append(size // done)
    taken = [where[ref] for ref in refs]
    order = [d for d in range(len(dims)) if d not in taken] + taken
    per_group = math.prod(dims[d] for d in taken)
    return devices.reshape(dims).transpose(order).reshape(-1, per_group)


def _read_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """The replica groups written as ``text`` (see :attr:`Collective.groups`)."""
    text = text.strip()
    if mesh := _MESH_GROUPS.fullmatch(text):
        groups = _mesh_groups(mesh["axes"], mesh["ids"], mesh["grouped"])
    elif iota := _IOTA_GROUPS.fullmatch(text):
        groups = _iota(iota["dims"], iota["perm"]).reshape(_ints(iota["shape"]))
    elif re.fullmatch(r"[\d\s,\[\]{}-]*", text):
        # Explicit groups; StableHLO pads uneven groups with -1.
        inner = re.findall(r"[\[{]([\d\s,-]*)[\]}]", text) or [text]
        found = [tuple(i for i in _ints(g) if i >= 0) for g in inner]
        return tuple(g for g in found if g)
    else:
        raise ValueError(f"Cannot read replica groups from {text!r}.")
    return tuple(tuple(int(i) for i in g) for g in groups)


def _sdy_meshes(text: str) -> dict[str, str]:
    """The meshes a StableHLO module declares (``sdy.mesh @name = <[...]>``), by name.

    Each in the compiled-HLO spelling, ``mesh['x'=4,'y'=2]`` (``, device_ids=(...)``
    added where the devices are not in iota order).
    """
    meshes = {}
    for m in re.finditer(
        r'^\s*sdy\.mesh\s+@(?:"([^"]+)"|([\w.$-]+))\s*=\s*<\[([^\]]*)\]'
        r"(?:,\s*device_ids\s*=\s*\[([^\]]*)\])?",
        text,
        flags=re.MULTILINE,
    ):
        axes = re.findall(r'"([^"]+)"\s*=\s*(\d+)', m[3])
        if axes:
            meshes[m[1] or m[2]] = _mesh_spelling(axes, m[4])
    return meshes


def _mesh_spelling(axes: list[tuple[str, str]], ids: str | None) -> str:
    spelled = "mesh[" + ",".join(f"'{name}'={size}" for name, size in axes) + "]"
    if ids and _ints(ids) != list(range(len(_ints(ids)))):
        spelled += ", device_ids=(" + ",".join(str(i) for i in _ints(ids)) + ")"
    return spelled


def _stablehlo_groups(line: str, meshes: dict[str, str]) -> str:
    """The replica groups of a StableHLO op, as :attr:`Collective.replica_groups` holds them.

    ``dense<...>``'s groups as written; mesh-axes groups in the compiled-HLO mesh
    spelling (``mesh['x'=4,'y'=2] {'x'}``), their mesh read from ``meshes`` or inline.
    """
    dense = re.search(r"replica_groups = dense<(.*?)>(?:\s*:\s*tensor<(\d+)x(\d+)x)?", line)
    if dense:
        if re.fullmatch(r"-?\d+", dense[1].strip()) and dense[2]:  # a splat
            row = "[" + ", ".join([dense[1].strip()] * int(dense[3])) + "]"
            return "[" + ", ".join([row] * int(dense[2])) + "]"
        return dense[1]
    start = line.find("replica_groups = #stablehlo.replica_group_mesh_axes<")
    if start < 0:
        return ""
    depth, end = 0, start
    for end in range(line.index("<", start), len(line)):
        depth += {"<": 1, ">": -1}.get(line[end], 0)
        if depth == 0:
            break
    attr = line[start : end + 1]
    inline = re.search(
        r"mesh = #stablehlo\.mesh<axes\s*=\s*\[(.*?)\](?:,\s*device_ids=(.*?)>)?", attr
    )
    if inline:
        axes = re.findall(r'<name = "([^"]+)", size = (\d+)', inline[1])
        ids = re.sub(r"^\s*(?:array<i64:|dense<)|>.*$", "", inline[2] or "")
        mesh = _mesh_spelling(axes, ids or None)
    else:
        ref = re.search(r'mesh = @(?:"([^"]+)"|([\w.$-]+))', attr)
        mesh = meshes.get(ref[1] or ref[2], "") if ref else ""
    if not mesh:  # the mesh is declared in a part of the module not given: as written
        return attr.removeprefix("replica_groups = ")
    grouped = [
        f"'{m[1]}'" + (f":{m[2]}" if m[2] else "")
        for m in re.finditer(
            r'#stablehlo\.axis_ref<name = "([^"]+)"(?:, sub_axis_info = (\(\d+\)\d+))?>', attr
        )
    ]
    return mesh + " {" + ",".join(grouped) + "}"


def _top_level(types: str) -> list[str]:
    """The elements of an HLO tuple type ``(a, (b, c), d)``; ``[types]`` if not a tuple."""
    types = re.sub(r"/\*.*?\*/", "", types).strip()
    if not types.startswith("("):
        return [types]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(types):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(types[start:i])
            start = i + 1
    parts.append(types[start:-1])
    return [p.strip() for p in parts]


def _result_types(op: str, started: bool, types: str) -> str:
    """The results of a collective, from the type of its op.

    XLA:GPU runs collectives as async pairs. ``all-gather-start``,
    ``reduce-scatter-start`` and ``collective-permute-start`` yield
    ``(operands, results[, context...])``: only the results count, as for the
    synchronous op. ``all-reduce-start`` yields its results (jaxlib 0.10), or
    ``((operands), results)`` where they alias its operands (0.12): an
    all-reduce's operands are arrays, so a tuple first names that form.
    """
    if not started:
        return types
    parts = _top_level(types)
    if op == "all-reduce" and not (len(parts) == 2 and parts[0].startswith("(")):
        return types
    return parts[1] if len(parts) >= 2 else types


def _hlo_ops(text: str) -> list[Collective]:
    ops = []
    pattern = re.compile(
        r"=\s*(?P<types>\(.*?\)|\S+)\s+(?P<op>" + "|".join(_HLO_OPS) + r")(?P<start>-start)?\("
    )
    shm = re.compile(r"=\s*(?P<types>\(.*?\)|\S+)\s+custom-call\(")
    for line in text.splitlines():
        m = pattern.search(line)
        if not m and f'custom_call_target="{_SHM_TARGET}"' in line:
            m = shm.search(line)
        if not m:
            continue
        kind = m.groupdict().get("op") or "shm-sum"
        types = _result_types(kind, bool(m.groupdict().get("start")), m["types"])
        shapes, dtypes, nbytes = [], [], 0
        for dt, dims in re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", types):
            if dt not in _HLO_BITS:
                continue
            shape = tuple(int(d) for d in dims.split(",") if d)
            shapes.append(shape)
            dtypes.append(dt)
            nbytes += math.prod(shape) * _HLO_BITS[dt] // 8
        groups = re.search(
            r"replica_groups=(mesh\[[^\]]*\]"
            # XLA's partitioner names the devices too: device_ids=([2,4]T(1,0)).
            r"(?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^}]*\}"
            r"|\{[^ ]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\[[^ ]*\][^ ,]*)",
            line,
        )
        ops.append(
            Collective(
                kind,
                tuple(dtypes),
                tuple(shapes),
                nbytes,
                groups[1] if groups else "",
                bucket_indices(line),
            )
        )
    return ops


def bucket_indices(line: str) -> tuple[int, ...]:
    """The fdp bucket indices an op's metadata names (``fdp_bucket_N`` scopes), in order."""
    meta = re.search(r'op_name="([^"]*)"', line)
    if meta is None:
        return ()
    return tuple(dict.fromkeys(int(i) for i in re.findall(r"fdp_bucket_(\d+)", meta[1])))


def _mlir_types(signature: str) -> list[tuple[str, tuple[int, ...]]]:
    results = signature.split("->", 1)[1] if "->" in signature else signature
    out = []
    for body in re.findall(r"tensor<([^>]*(?:<[^>]*>)?)>", results):
        *dims, dt = body.split("x") if "x" in body and body[0].isdigit() else ["", body]
        dt = dt.split(",")[0]
        out.append((dt, tuple(int(d) for d in dims if d)))
    return out


_MLIR_TO_HLO = {
    "i1": "pred",
    "i8": "s8",
    "ui8": "u8",
    "i16": "s16",
    "ui16": "u16",
    "i32": "s32",
    "ui32": "u32",
    "i64": "s64",
    "ui64": "u64",
    "complex<f32>": "c64",
    "complex<f64>": "c128",
}


def _stablehlo_ops(text: str, meshes: dict[str, str] | None = None) -> list[Collective]:
    """The collectives of StableHLO ``text``; ``meshes``: the module's (default: ``text``'s)."""
    meshes = _sdy_meshes(text) if meshes is None else meshes
    ops = []
    lines = text.splitlines()
    op_re = re.compile(r'"?stablehlo\.(' + "|".join(_MLIR_OPS) + r')"?[\s(]')
    for i, line in enumerate(lines):
        if f"stablehlo.custom_call @{_SHM_TARGET}(" in line:
            types = _mlir_types(line.rsplit("->", 1)[-1])
            nbytes = sum(math.prod(shape) * _MLIR_BITS.get(dt, 32) // 8 for dt, shape in types)
            dtypes = tuple(_MLIR_TO_HLO.get(dt, dt) for dt, _ in types)
            ops.append(Collective("shm-sum", dtypes, tuple(s for _, s in types), nbytes, ""))
            continue
        m = op_re.search(line)
        if not m:
            continue
        signature = line
        if line.rstrip().endswith("({"):  # the op has a region; its types close it
            depth = 0
            for j in range(i, len(lines)):
                depth += lines[j].count("({") - lines[j].count("})")
                if depth == 0:
                    signature = lines[j]
                    break
        dtypes, shapes, nbytes = [], [], 0
        for dt, shape in _mlir_types(signature):
            dtypes.append(_MLIR_TO_HLO.get(dt, dt))
            shapes.append(shape)
            nbytes += math.prod(shape) * _MLIR_BITS.get(dt, 32) // 8
        groups = _stablehlo_groups(line, meshes)
        ops.append(Collective(_MLIR_OPS[m[1]], tuple(dtypes), tuple(shapes), nbytes, groups))
    return ops


def collective_stats(program: Any) -> CollectiveStats:
    """Lists the collectives of a program with their per-device bytes.

    Args:
      program: a ``jax.stages.Lowered`` (its StableHLO: what was emitted), a
        ``jax.stages.Compiled`` (its optimised HLO: what runs), or the text of
        either.

    Returns:
      A :class:`CollectiveStats`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> x = jax.device_put(jnp.ones(16), jax.NamedSharding(mesh, P("data")))
      >>> stats = collective_stats(f.lower(x))
      >>> stats.count("all-reduce"), stats.nbytes("all-reduce")
      (1, 8)
    """
    if not isinstance(program, str):
        text = program.as_text()
        if text is None:
            raise ValueError("the program has no text to read collectives from.")
        program = text
    if "stablehlo." in program or "func.func" in program:
        return CollectiveStats("stablehlo", tuple(_stablehlo_ops(program)))
    return CollectiveStats("hlo", tuple(_hlo_ops(program)))


def _functions(text: str) -> dict[str, str]:
    """StableHLO function bodies by name (top-level ``func.func``)."""
    out: dict[str, str] = {}
    name, body, depth = None, [], 0
    for line in text.splitlines():
        m = re.match(r"\s*func\.func (?:public |private )?@([\w.$-]+)\(", line)
        if name is None and m:
            name, body, depth = m[1], [], 0
        if name is not None:
            body.append(line)
            depth += line.count("{") - line.count("}")
            if depth <= 0 and "}" in line:
                out[name] = "\n".join(body)
                name = None
    return out


def _loop_regions(text: str) -> list[str]:
    regions, inside, depth, body = [], False, 0, []
    for line in text.splitlines():
        if not inside and "stablehlo.while" in line and _compat.XLA_KEEP_ONE_TRIP_LOOP not in line:
            inside, depth, body = True, 0, []
        if inside:
            body.append(line)
            depth += line.count("{") - line.count("}")
            if depth <= 0 and "}" in line:
                regions.append("\n".join(body))
                inside = False
    return regions


def _hlo_computations(text: str) -> dict[str, str]:
    """Compiled-HLO computations by name."""
    out: dict[str, str] = {}
    name, body = None, []
    for line in text.splitlines():
        m = re.match(r"(?:ENTRY )?%([\w.-]+) \(.*\{\s*$", line)
        if name is None and m:
            name, body = m[1], []
            continue
        if name is not None:
            if line.startswith("}"):
                out[name] = "\n".join(body)
                name = None
            else:
                body.append(line)
    return out


def _hlo_loop_collectives(text: str) -> CollectiveStats:
    comps = _hlo_computations(text)
    # A loop of one trip (fdp's last micro-batch, _compat.run_once) repeats nothing.
    once = _compat.XLA_KEEP_ONE_TRIP_LOOP
    todo = [m[1] for m in re.finditer(r" while\(.*?body=%([\w.-]+).*", text) if once not in m[0]]
    seen: set[str] = set()
    ops: list[Collective] = []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        ops.extend(_hlo_ops(comps[name]))
        todo.extend(
            re.findall(
                r"(?:to_apply|body|condition|calls|branch_computations)=\{?%([\w.-]+)", comps[name]
            )
        )
    return CollectiveStats("hlo", tuple(ops))


def loop_collectives(lowered: Any) -> CollectiveStats:
    """The collectives a program runs inside loops (``while``/``scan``).

    Loop bodies often call other functions or computations; those are
    followed, transitively. A loop of one trip (the last micro-batch of a GPU
    step with accumulation, which runs with the bucket reductions in one) is not
    counted: nothing in it repeats.

    Args:
      lowered: a ``jax.stages.Lowered`` (its StableHLO), a
        ``jax.stages.Compiled`` (its HLO), or the text of either.

    Returns:
      The :class:`CollectiveStats` of the collectives inside loop bodies (counted
      once per appearance in the program, not per iteration).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> f = jax.shard_map(
      ...     lambda x: jax.lax.scan(lambda c, y: (c + jax.lax.psum(y, "data"), None), 0.0, x)[0],
      ...     mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> x = jax.device_put(jnp.ones(24), jax.NamedSharding(mesh, P("data")))
      >>> loop_collectives(jax.jit(f).lower(x)).count("all-reduce")
      1
    """
    text = lowered if isinstance(lowered, str) else lowered.as_text()
    if "stablehlo." not in text and "func.func" not in text:
        return _hlo_loop_collectives(text)
    functions = _functions(text)
    seen: set[str] = set()
    pieces = _loop_regions(text)
    todo = [name for piece in pieces for name in re.findall(r"func\.call @([\w.$-]+)", piece)]
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        pieces.append(functions[name])
        todo.extend(re.findall(r"func\.call @([\w.$-]+)", functions[name]))
    meshes = _sdy_meshes(text)
    return CollectiveStats(
        "stablehlo", tuple(op for piece in pieces for op in _stablehlo_ops(piece, meshes))
    )
