"""How much of fdp's gradient communication hides behind compute, 2 processes on CPU.

DDP reduces buckets in reverse parameter order so that each all-reduce can run while the
backward pass of earlier layers still computes. This measures how much of that happens
in fdp's compiled step, per model, from four runs of the same step under ``fdp launch``
(2 processes x 1 CPU device, gloo), interleaved:

- ``full``: the step (all-reduce hook);
- ``noop``: the same step without communication (DDP's ``noop_hook``);
- ``comm``: the all-reduce hook with a loss that computes (almost) nothing, so the step is
  the bucketed reduction and the update;
- ``base``: that trivial step without communication (the update alone).

communication = comm - base; exposed = full - noop; hidden = 1 - exposed / communication
(0: the all-reduces run after the backward pass; 1: entirely behind it).

    python benchmarks/overlap.py --json benchmarks/results/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import multiprocess

VARIANTS = {
    "full": ["--comm-hook", "allreduce"],
    "noop": ["--comm-hook", "noop"],
    "comm": ["--comm-hook", "allreduce", "--trivial-loss"],
    "base": ["--comm-hook", "noop", "--trivial-loss"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    multiprocess.add_batch_args(parser)
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.batch = multiprocess.batch_sizes(args)
    args.launch_args = []
    rows = []
    for model in args.models.split(","):
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        names = list(VARIANTS)
        for r in range(args.repeats):
            for v in names[r % len(names) :] + names[: r % len(names)]:
                args.fdp_args = [*VARIANTS[v], "--layout", args.layout]
                res = multiprocess.run_one("fdp", model, 2, args)
                times[v].append(res["step_s"])
                print(f"{model:<12} {v:<5} {1e3 * times[v][-1]:8.1f} ms/step", flush=True)
        med = {v: statistics.median(ts) for v, ts in times.items()}
        comm = med["comm"] - med["base"]
        exposed = med["full"] - med["noop"]
        rows.append(
            {
                "model": model,
                **{f"{v}_ms": 1e3 * t for v, t in med.items()},
                "communication_ms": 1e3 * comm,
                "exposed_ms": 1e3 * exposed,
                "hidden_fraction": 1 - exposed / comm if comm > 0 else float("nan"),
                "runs_ms": {v: [1e3 * t for t in ts] for v, ts in times.items()},
            }
        )
    print(
        f"\n{'model':<12}{'full':>9}{'noop':>9}{'comm':>9}{'base':>9}"
        f"{'comm. ms':>10}{'exposed':>9}{'hidden':>8}"
    )
    for row in rows:
        print(
            f"{row['model']:<12}{row['full_ms']:>9.1f}{row['noop_ms']:>9.1f}"
            f"{row['comm_ms']:>9.1f}{row['base_ms']:>9.1f}{row['communication_ms']:>10.1f}"
            f"{row['exposed_ms']:>9.1f}{row['hidden_fraction']:>8.2f}"
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"argv": sys.argv, "cores": os.cpu_count(), "load_average": os.getloadavg()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
