"""A compiled GPU program described as text: collectives, buckets in schedule order, memory.

``fdp describe --gpu h100_sxm`` prints it for a built-in model; any step compiled
for a GPU mesh (:func:`fdp.observe.gpu_mesh`) can be described with
:func:`gpu_program_report`.
"""

from __future__ import annotations

from typing import Any

from fdp.observe._gpu import gpu_target
from fdp.observe._hlo import collective_stats
from fdp.observe._schedule import read_schedule

MiB = 1024 * 1024


def gpu_program_report(compiled: Any, target: Any, plan: Any = None) -> str:
    """What XLA:GPU made of a step: its collectives, its buckets in schedule order, its memory.

    Args:
      compiled: a step compiled for a GPU mesh (``step.lower(...).compile()``).
      target: the GPU it was compiled for (a name of :data:`fdp.observe.GPU_TARGETS`).
      plan: the step's bucket plan (``step.plan``), to compare with the program.

    Returns:
      Lines of text: collectives by kind, each bucket's collectives in schedule
      order with the share of the step's products still to run at its start,
      the overlap estimate and the memory per GPU.
    """
    spec = gpu_target(target)
    stats = collective_stats(compiled)
    schedule = read_schedule(compiled, spec)
    memory = compiled.memory_analysis()
    lines = [f"compiled for {spec.description} (deviceless: structure and memory, no timing)"]
    for kind, row in sorted(stats.summary().items()):
        lines.append(f"  {kind:15} {row['count']:4} op(s) {row['bytes'] / MiB:10.2f} MiB per GPU")
    carried = [c for c in schedule.collectives if c.buckets]
    if plan is not None:
        single = sorted(c.buckets for c in carried if len(c.buckets) == 1)
        lines.append(
            f"  buckets: {len(plan.buckets)} in the plan; "
            f"{len(single)} collective(s) carry exactly one"
        )
    for c in carried:
        names = ",".join(str(b) for b in c.buckets)
        lines.append(
            f"    bucket {names:>5} {c.kind:15} {c.nbytes / MiB:9.2f} MiB, starts with "
            f"{c.flops_after_start:.0%} of the products to run, {c.exposed_seconds * 1e3:.3f} ms "
            "exposed"
        )
    lines.append(
        f"  estimate: products {schedule.compute_seconds * 1e3:.3f} ms, communication "
        f"{schedule.comm_seconds * 1e3:.3f} ms, exposed {schedule.exposed_seconds * 1e3:.3f} ms "
        f"({schedule.hidden_fraction:.0%} hidden)"
    )
    peak = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    temp = memory.temp_size_in_bytes / MiB
    lines.append(f"  memory per GPU: temp {temp:.1f} MiB, peak {peak / MiB:.1f} MiB")
    return "\n".join(lines)
