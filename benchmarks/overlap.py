"""How much of fdp's gradient communication hides behind compute, 2 processes on CPU.

DDP reduces buckets in reverse parameter order so that each all-reduce can run while the
backward pass of earlier layers still computes. This measures how much of that happens
in fdp's compiled step, per model and per bucket, under ``fdp launch`` (2 processes x 1
CPU device, gloo).

``--method trace`` (the default) profiles a few steps with ``jax.profiler`` and reads
XLA:CPU's own thunk events (``_overlap_trace.py``): for each bucket's collective, the part
of its time in flight during which a compute thunk of the step is in flight too (hidden),
and per step the communication time during which nothing else runs (exposed). Bucket 0 is
the first collective launched in a step (a scalar metric's, when tiny).

``--method differencing`` (the first attempt, kept for its recorded results) times four
variants of the step, interleaved: ``full`` (all-reduce hook), ``noop`` (DDP's
``noop_hook``), ``comm`` (all-reduce, with a loss that computes almost nothing) and
``base`` (that loss, no communication); communication = comm - base, exposed = full -
noop, hidden = 1 - exposed / communication.

    python benchmarks/overlap.py --caps 25,5 --json benchmarks/results/overlap_trace.json
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


def differencing(args: argparse.Namespace) -> list[dict]:
    """The four timed variants per model; overlap by differences of medians."""
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
    return rows


def traced(args: argparse.Namespace) -> list[dict]:
    """Each (model, cap, variant) profiled in its own 2-process run, rotating, --repeats
    times; variants are ``multiprocess.run_one``'s frameworks (fdp, fdp-shm, torch)."""
    configs = [
        (model, float(cap), variant)
        for model in args.models.split(",")
        for cap in args.caps.split(",")
        for variant in args.variants.split(",")
    ]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    trace = ["--trace-steps", str(args.trace_steps)]
    for r in range(args.repeats):
        for model, cap, variant in configs[r % len(configs) :] + configs[: r % len(configs)]:
            args.bucket_cap_mb = cap
            args.fdp_args = ["--layout", args.layout, *trace]
            args.torch_args = trace
            # fdp-unpinned: each worker on both cores (2 XLA threads), not 1 core each.
            args.launch_args = ["--no-cpu-binding"] if variant == "fdp-unpinned" else []
            framework = "fdp" if variant == "fdp-unpinned" else variant
            rec = multiprocess.run_one(framework, model, 2, args)
            runs[model, cap, variant].append({"step_s": rec["step_s"], **rec["trace"]})
            t = rec["trace"]["step"]
            print(
                f"{model:<12} {cap:>5g} MB {variant:<8} {1e3 * rec['step_s']:7.1f} ms/step, "
                f"communication {t['communication_ms']:6.1f} ms, "
                f"hidden {t['hidden_fraction']:.2f}",
                flush=True,
            )
    rows = []
    med, mean = statistics.median, statistics.fmean  # means keep exposed = comm. - hidden
    for (model, cap, variant), recs in runs.items():
        by_op: dict[str, list[dict]] = {}
        for r in recs:
            for b in r["buckets"]:
                by_op.setdefault(b["op"], []).append(b)
        buckets = []
        for same in sorted(by_op.values(), key=lambda bs: mean(b["start_ms"] for b in bs)):
            b = {
                **same[0],
                **{k: mean(x[k] for x in same) for k in ("start_ms", "ms", "hidden_ms")},
            }
            b.update(
                bucket=len(buckets),
                hidden_fraction=b["hidden_ms"] / b["ms"],
                hidden_fraction_runs=[x["hidden_fraction"] for x in same],
            )
            buckets.append(b)
        step = {k: mean(r["step"][k] for r in recs) for k in recs[0]["step"]}
        step["hidden_fraction"] = step["hidden_ms"] / step["communication_ms"]
        rows.append(
            {
                "model": model,
                "bucket_cap_mb": cap,
                "variant": variant,
                "step_ms_untraced": 1e3 * med(r["step_s"] for r in recs),
                "step": step,
                "hidden_fraction_runs": [r["step"]["hidden_fraction"] for r in recs],
                "buckets": buckets,
                "runs": recs,
            }
        )
    print(
        f"\n{'model':<12}{'cap MB':>7}  {'variant':<13}{'step ms':>8}{'traced':>8}{'comm.':>7}"
        f"{'exposed':>8}{'hidden':>7}  per bucket: MiB / ms / hidden"
    )
    for row in rows:
        s = row["step"]
        per = ", ".join(
            f"{b['mib']:.3g}/{b['ms']:.1f}/{b['hidden_fraction']:.2f}" for b in row["buckets"]
        )
        print(
            f"{row['model']:<12}{row['bucket_cap_mb']:>7g}  {row['variant']:<13}"
            f"{row['step_ms_untraced']:>8.1f}{s['step_ms']:>8.1f}{s['communication_ms']:>7.1f}"
            f"{s['exposed_ms']:>8.1f}"
            f"{s['hidden_fraction']:>7.2f}  {per}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("trace", "differencing"), default="trace")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--repeats", type=int, default=3)
    multiprocess.add_run_args(parser, steps=10)  # --bucket-cap-mb: differencing's cap
    parser.add_argument("--caps", default="25,5", help="trace: bucket caps (MB) to profile")
    parser.add_argument(
        "--variants",
        default="fdp,fdp-shm,fdp-unpinned,torch",
        help="trace: fdp (XLA's gloo all-reduce), fdp-shm (comm_hook='shm_allreduce'), "
        "fdp-unpinned (fdp launch --no-cpu-binding), torch (PyTorch DDP)",
    )
    parser.add_argument("--trace-steps", type=int, default=5, help="trace: steps profiled")
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.batch = multiprocess.batch_sizes(args)
    args.launch_args = []
    rows = traced(args) if args.method == "trace" else differencing(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"argv": sys.argv, "cores": os.cpu_count(), "load_average": os.getloadavg()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
