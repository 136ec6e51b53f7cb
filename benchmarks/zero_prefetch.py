"""How far ahead of its use each stage-3 gather starts, in the 8 x H100 GPU program.

ZeRO stage 3 gathered per use (``fdp.Sharding(zero_stage=3)``) all-gathers each
parameter just before the equation that uses it, and again in the backward pass.
A gather hides behind computation only if the compute stream issues matrix
products between its ``all-gather-start`` and its ``all-gather-done``. This
compiles the step of issue 31's GPT (8 layers, width 512, vocabulary 8192,
sequence 256, 2 sequences per device, Adam) with XLA's GPU compiler for 8 x H100,
deviceless (no GPU needed), and counts, for every forward and backward gather,
the gemm fusions scheduled between its start and its done
(``ScheduledCollective.products_in_flight``), under four settings:

- ``PREFETCH_USES`` (fdp.step._config): a forward gather is tied to the
  activation this many uses back (0: to its own equation's inputs, as before
  prefetch);
- ``PER_USE_IN_FLIGHT`` (fdp.step._config): async collectives XLA:GPU may keep in
  flight at once (``xla_gpu_experimental_parallel_collective_overlap_limit``; 1
  is XLA's default).

The defaults are 16 and 4. The two-stream estimate of fdp.observe._schedule
(hidden share of the communication) is printed beside; it is not a timing.

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

SETTINGS = ((0, 1), (16, 1), (0, 4), (16, 4))  # (PREFETCH_USES, PER_USE_IN_FLIGHT)


def compile_per_use(dim: int, ahead: int, in_flight: int):
    import zero

    from fdp.step import _config

    family = {"depth": 8, "vocab": 8192, "seq": 256, "per_device": 2}
    from fdp.observe import gpu_mesh

    mesh = gpu_mesh("h100_sxm", 8)
    before = _config.PREFETCH_USES, _config.PER_USE_IN_FLIGHT
    _config.PREFETCH_USES, _config.PER_USE_IN_FLIGHT = ahead, in_flight
    try:
        compiled, params = zero.compile_mode(dim, "stage 3, gathered per use", family, mesh)
    finally:
        _config.PREFETCH_USES, _config.PER_USE_IN_FLIGHT = before
    return compiled, params


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
    parser.add_argument("--json")
    args = parser.parse_args()

    import fdp
    from fdp.observe._schedule import read_schedule

    results: dict = {"jax": jax.__version__, "fdp": fdp.__version__, "dim": args.dim, "runs": []}
    print(
        f"GPT d{args.dim} x8 v8192 s256, stage 3 gathered per use, 8 x H100 (deviceless "
        "compile): gemm fusions between each all-gather's start and done"
    )
    head = ("ahead", "in flight", "pass", "gathers", ">=1 gemm", "median", "max", "hidden")
    print("".join(f"{h:>10}" for h in head))
    for ahead, in_flight in SETTINGS:
        start = time.perf_counter()
        compiled, params = compile_per_use(args.dim, ahead, in_flight)
        schedule = read_schedule(compiled, "h100_sxm")
        memory = compiled.memory_analysis()
        assert memory is not None
        run = {
            "prefetch_uses": ahead,
            "in_flight": in_flight,
            "params": params,
            "compile_s": time.perf_counter() - start,
            "temp_bytes": int(memory.temp_size_in_bytes),
            "hidden_fraction": schedule.hidden_fraction,
            "comm_s": schedule.comm_seconds,
            "exposed_s": schedule.exposed_seconds,
            "compute_s": schedule.compute_seconds,
            "gathers": {},
        }
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
                f"{ahead:>10}{in_flight:>10}{side:>10}{g['count']:>10}{g['with_a_gemm']:>10}"
                f"{g['median']:>10}{g['max']:>10}{schedule.hidden_fraction:>10.2f}",
                flush=True,
            )
        results["runs"].append(run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
