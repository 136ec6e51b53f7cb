"""How far ahead of its use each stage-3 gather starts, in the 8 x H100 GPU program.

ZeRO stage 3 gathered per use (``fdp.Sharding(zero_stage=3)``) all-gathers each
parameter just before the equation that uses it, and again in the backward pass.
A gather hides behind computation only if the compute stream issues matrix
products between its ``all-gather-start`` and its ``all-gather-done``. This
compiles the step of issue 31's GPT (8 layers, vocabulary 8192, sequence 256, 2
sequences per device, Adam; width 512 by default) with XLA's GPU compiler for
8 x H100, deviceless (no GPU needed), and counts the collectives, and for every
forward and backward gather the gemm fusions scheduled between its start and its
done (``ScheduledCollective.products_in_flight``), under these settings:

- ``PREFETCH_GROUPS`` (fdp.step.options._config): how many gather groups ahead a gather
  may start, in both passes (0: tied to its own use);
- the group size, ``bucket_cap_mb`` (0.001 MiB: each use its own group);
- ``PER_USE_IN_FLIGHT`` (fdp.step.options._config): async collectives XLA:GPU may keep in
  flight at once (``xla_gpu_experimental_parallel_collective_overlap_limit``; 1
  is XLA's default).

The defaults are 1 group ahead, 25 MiB and 4. The two-stream estimate of
fdp.observe._schedule (exposed communication) is printed beside; it is not a
timing. Temp memory is the compiled program's.

    python benchmarks/zero_prefetch.py --json benchmarks/results/zero_prefetch.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))

# (PREFETCH_GROUPS, bucket_cap_mb, PER_USE_IN_FLIGHT)
SETTINGS = ((0, 0.001, 1), (1, 0.001, 4), (1, 25.0, 4))  # 0.001 MiB: a group per use


def compile_per_use(dim: int, ahead: int, cap_mb: float, in_flight: int, scanned: bool):
    import zero

    from fdp.observe import gpu_mesh
    from fdp.step.options import _config

    family = {"depth": 8, "vocab": 8192, "seq": 256, "per_device": 2}
    mesh = gpu_mesh("h100_sxm", 8)
    before = _config.PREFETCH_GROUPS, _config.PER_USE_IN_FLIGHT
    _config.PREFETCH_GROUPS, _config.PER_USE_IN_FLIGHT = ahead, in_flight
    try:
        return zero.compile_mode(
            dim, "stage 3, gathered per use", family, mesh, scanned, bucket_cap_mb=cap_mb
        )
    finally:
        _config.PREFETCH_GROUPS, _config.PER_USE_IN_FLIGHT = before


def gathers(compiled) -> dict[str, list[int]]:
    """Gemm fusions between start and done of each all-gather, forward and backward."""
    from fdp.observe._schedule import read_schedule

    out: dict[str, list[int]] = {"forward": [], "backward": []}
    for c in read_schedule(compiled, "h100_sxm").collectives:
        if c.kind == "all-gather":
            # The backward pass's gathers are traced in the transpose of the custom VJP.
            out["backward" if c.backward else "forward"].append(c.products_in_flight)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--scan", action="store_true", help="blocks under nn.scan + nn.remat")
    parser.add_argument("--json")
    args = parser.parse_args()

    import fdp
    from fdp.observe._schedule import read_schedule

    results: dict = {
        "jax": jax.__version__,
        "fdp": fdp.__version__,
        "dim": args.dim,
        "layers": "scan+remat" if args.scan else "plain",
        "runs": [],
    }
    print(
        f"GPT d{args.dim} x8 v8192 s256 ({results['layers']}), stage 3 gathered per use, "
        "8 x H100 (deviceless compile)"
    )
    head = ("ahead", "cap MiB", "in flight", "pass", "gathers", ">=1 gemm", "max", "RS")
    print("".join(f"{h:>10}" for h in head) + f"{'exposed ms':>12}{'temp MiB':>10}")
    for ahead, cap_mb, in_flight in SETTINGS:
        start = time.perf_counter()
        compiled, params = compile_per_use(args.dim, ahead, cap_mb, in_flight, args.scan)
        schedule = read_schedule(compiled, "h100_sxm")
        memory = compiled.memory_analysis()
        assert memory is not None
        kinds = collections.Counter(c.kind for c in schedule.collectives)
        run = {
            "prefetch_groups": ahead,
            "bucket_cap_mb": cap_mb,
            "in_flight": in_flight,
            "params": params,
            "compile_s": time.perf_counter() - start,
            "temp_bytes": int(memory.temp_size_in_bytes),
            "collectives": dict(kinds),
            "hidden_fraction": schedule.hidden_fraction,
            "comm_s": schedule.comm_seconds,
            "exposed_s": schedule.exposed_seconds,
            "compute_s": schedule.compute_seconds,
            "gathers": {},
        }
        temp_mib = memory.temp_size_in_bytes / 2**20
        for side, counts in gathers(compiled).items():
            run["gathers"][side] = {
                "count": len(counts),
                "with_a_gemm": sum(n > 0 for n in counts),
                "median": statistics.median(counts),
                "max": max(counts),
                "histogram": dict(sorted(collections.Counter(counts).items())),
            }
            g = run["gathers"][side]
            print(
                f"{ahead:>10}{cap_mb:>10g}{in_flight:>10}{side:>10}{g['count']:>10}"
                f"{g['with_a_gemm']:>10}{g['max']:>10}{kinds['reduce-scatter']:>10}"
                f"{schedule.exposed_seconds * 1e3:>12.2f}{temp_mib:>10.1f}",
                flush=True,
            )
        results["runs"].append(run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
