"""``fdp.describe``: the bucket plan as a table a person can read.

DDP's INFO log gives bucket sizes as a list of numbers; the table says which
parameters travel together, so a bucket cap can be chosen by looking.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from fdp.bucketing import BucketPlan, MiB, plan_for


@dataclasses.dataclass(frozen=True)
class BucketRow:
    """One bucket of a :class:`BucketReport`.

    Attributes:
      index: the bucket's position in reduce order.
      dtype: its dtype name.
      leaves: number of gradients in it.
      nbytes: bytes in its flat buffer.
      first: key path of its first gradient (the earliest ready).
      last: key path of its last gradient.
      layout: how its gradients are split over the mesh's non-data axes (a
        ``PartitionSpec`` as text; ``""`` where they are whole there).
    """

    index: int
    dtype: str
    leaves: int
    nbytes: int
    first: str
    last: str
    layout: str = dataclasses.field(default="", kw_only=True)


@dataclasses.dataclass(frozen=True)
class BucketReport:
    """A bucket plan, summarised: one row per bucket, and totals.

    Build it with :func:`bucket_report`; ``str(report)`` is the table that
    :func:`describe` returns.

    Attributes:
      rows: the buckets, in reduce order.
      bucket_cap_bytes: the cap of every bucket after a dtype's first.
      first_bucket_cap_bytes: the cap of each dtype's first bucket.
      excluded: key paths of the leaves in no bucket (no gradient, or unused).
      excluded_nbytes: their bytes.
    """

    rows: tuple[BucketRow, ...]
    bucket_cap_bytes: int
    first_bucket_cap_bytes: int
    excluded: tuple[str, ...]
    excluded_nbytes: int

    @property
    def nbytes(self) -> int:
        """Bytes over all buckets: the gradient bytes reduced per step."""
        return sum(r.nbytes for r in self.rows)

    @property
    def leaves(self) -> int:
        """Gradients over all buckets."""
        return sum(r.leaves for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-ready)."""
        return {
            "bucket_cap_bytes": self.bucket_cap_bytes,
            "first_bucket_cap_bytes": self.first_bucket_cap_bytes,
            "buckets": [dataclasses.asdict(r) for r in self.rows],
            "total_buckets": len(self.rows),
            "total_leaves": self.leaves,
            "total_bytes": self.nbytes,
            "excluded": list(self.excluded),
            "excluded_bytes": self.excluded_nbytes,
        }

    def __str__(self) -> str:
        header = ("bucket", "dtype", "leaves", "bytes", "first key path", "last key path")
        body = [
            (str(r.index), r.dtype, str(r.leaves), f"{r.nbytes:,}", r.first, r.last)
            for r in self.rows
        ]
        count = f"{len(self.rows)} bucket(s)"
        total = ("total", "", str(self.leaves), f"{self.nbytes:,}", count, "")
        numeric = (False, False, True, True, False, False)
        if any(r.layout for r in self.rows):  # a mesh with model axes: each bucket's split
            header, total, numeric = (*header, "layout"), (*total, ""), (*numeric, False)
            body = [(*line, r.layout or "P()") for line, r in zip(body, self.rows, strict=True)]
        widths = [max(len(line[i]) for line in [header, *body, total]) for i in range(len(header))]

        def fmt(line: tuple[str, ...]) -> str:
            cells = [
                c.rjust(w) if right else c.ljust(w)
                for c, w, right in zip(line, widths, numeric, strict=True)
            ]
            return "  ".join(cells).rstrip()

        rule = "  ".join("-" * w for w in widths)
        caps = (
            f"caps: first bucket {_mib(self.first_bucket_cap_bytes)}, "
            f"then {_mib(self.bucket_cap_bytes)}"
        )
        lines = [caps, fmt(header), rule, *map(fmt, body), rule, fmt(total)]
        if self.excluded:
            lines.append(
                f"in no bucket: {len(self.excluded)} leaf(s), {self.excluded_nbytes:,} bytes "
                f"({', '.join(self.excluded)})"
            )
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    """A cap in MiB (as it was given) with its bytes; a cap under 0.01 MiB in bytes only.

    Example:
      >>> _mib(262144), _mib(26214400), _mib(104), _mib(int(0.3 * MiB))
      ('0.25 MiB (262,144 B)', '25 MiB (26,214,400 B)', '104 B', '0.3 MiB (314,572 B)')
    """
    if nbytes < 0.01 * MiB:
        return f"{nbytes:,} B"
    return f"{nbytes / MiB:.4g} MiB ({nbytes:,} B)"


def _plan_of(obj: Any, bucket_cap_mb: float, first_bucket_cap_mb: float) -> BucketPlan:
    if isinstance(obj, BucketPlan):
        return obj
    if hasattr(obj, "plan") and hasattr(obj, "config"):  # a train step
        if obj.plan is None:
            raise RuntimeError(
                f"{type(obj).__name__} has no bucket plan until it has been traced: call "
                "the step (or its .lower(...)) once, or describe the parameters instead: "
                "fdp.describe(params, bucket_cap_mb=..., first_bucket_cap_mb=...)."
            )
        return obj.plan
    for path, leaf in jax.tree_util.tree_leaves_with_path(obj):
        if not _array_like(leaf, nested=bool(path)):
            what = f"{type(leaf).__name__} {leaf!r:.60}"
            if path:
                what = f"a {type(obj).__name__} whose leaf {jax.tree_util.keystr(path)} is {what}"
            raise TypeError(
                "describe takes a BucketPlan, a train step that has run, or a pytree of "
                f"parameters (arrays or jax.ShapeDtypeStruct); got {what}."
            )
    return plan_for(obj, bucket_cap_mb, first_bucket_cap_mb)


def _array_like(leaf: Any, *, nested: bool) -> bool:
    """Whether a leaf reads as a parameter: an array or shape struct, or a number in a tree.

    A bare number is not a tree of parameters (``describe(123)``); strings and other
    objects never are.
    """
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return True
    return nested and isinstance(leaf, bool | int | float | complex)


def bucket_report(
    obj: Any, *, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
) -> BucketReport:
    """The buckets of a plan, a step or a parameter tree, as rows and totals.

    Args:
      obj: a :class:`fdp.bucketing.BucketPlan`; a train step that has run (its
        ``plan``); or a pytree of parameters (arrays or
        ``jax.ShapeDtypeStruct``), planned with the caps below.
      bucket_cap_mb: cap after each dtype's first bucket (MiB); only for a tree.
      first_bucket_cap_mb: cap of each dtype's first bucket (MiB); only for a tree.

    Returns:
      A :class:`BucketReport`.

    Raises:
      RuntimeError: ``obj`` is a step that has not been traced yet.

    Example:
      >>> import jax.numpy as jnp
      >>> import fdp
      >>> report = fdp.bucket_report({"b": jnp.zeros(4), "w": jnp.zeros((4, 4))})
      >>> report.nbytes, [(r.index, r.first, r.last) for r in report.rows]
      (80, [(0, "['w']", "['b']")])
    """
    plan = _plan_of(obj, bucket_cap_mb, first_bucket_cap_mb)
    rows = tuple(
        BucketRow(
            b.index,
            str(b.dtype),
            len(b.leaf_indices),
            b.nbytes,
            b.key_paths[0],
            b.key_paths[-1],
            layout=str(b.layout) if len(b.layout) else "",
        )
        for b in plan.buckets
    )
    excluded_nbytes = sum(
        math.prod(plan.leaf_shapes[i]) * plan.leaf_dtypes[i].itemsize for i in plan.excluded
    )
    return BucketReport(
        rows,
        plan.bucket_cap_bytes,
        plan.first_bucket_cap_bytes,
        plan.excluded_key_paths,
        excluded_nbytes,
    )


def describe(obj: Any, *, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0) -> str:
    """A table of the buckets of a plan, a step or a parameter tree, with totals.

    One row per bucket in reduce order: index, dtype, number of gradients,
    bytes, and the key paths of its first and last gradient (gradients sit in
    a bucket in ready order, the reverse of the parameter order). For a step
    with ``zero_stage`` >= 1, a table of the bytes each device holds follows
    (parameters, reduced gradients, optimizer state, and the leaves kept whole).

    Args:
      obj: a :class:`fdp.bucketing.BucketPlan`, a train step that has run, or
        a pytree of parameters (see :func:`bucket_report`).
      bucket_cap_mb: cap after each dtype's first bucket (MiB); only for a tree.
      first_bucket_cap_mb: cap of each dtype's first bucket (MiB); only for a tree.

    Returns:
      The table, as text.

    Raises:
      RuntimeError: ``obj`` is a step that has not been traced yet.
      TypeError: ``obj`` is none of those (a leaf that is not an array).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import fdp
      >>> params = {"dense1": {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32),
      ...                      "b": jax.ShapeDtypeStruct((512,), jnp.float32)},
      ...           "dense2": {"w": jax.ShapeDtypeStruct((512, 10), jnp.float32),
      ...                      "b": jax.ShapeDtypeStruct((10,), jnp.float32)}}
      >>> print(fdp.describe(params, bucket_cap_mb=1.0, first_bucket_cap_mb=0.25))
      caps: first bucket 0.25 MiB (262,144 B), then 1 MiB (1,048,576 B)
      bucket  dtype    leaves      bytes  first key path   last key path
      ------  -------  ------  ---------  ---------------  ---------------
      0       float32       3  1,069,096  ['dense2']['w']  ['dense1']['w']
      1       float32       1      2,048  ['dense1']['b']  ['dense1']['b']
      ------  -------  ------  ---------  ---------------  ---------------
      total                 4  1,071,144  2 bucket(s)
    """
    table = str(
        bucket_report(obj, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
    )
    held = getattr(obj, "memory_table", lambda: None)()  # a ZeRO step: what devices hold
    return table if held is None else f"{table}\n{held}"
