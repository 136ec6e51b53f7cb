"""Step time against bucket size, with real processes (gloo), like the DDP paper's figure.

For each ``bucket_cap_mb`` it runs the 2-process MLP of ``multiprocess.py`` (8 x 1024,
batch 64 per process, SGD) under ``fdp launch`` and, with ``--frameworks fdp,torch``,
PyTorch DDP under ``torchrun`` with the same cap, in alternating order, several times.
It prints the median step time per cap (and its ratio to the best cap), writes JSON,
and plots step time against cap to a PNG (log-scaled cap axis), as in Figure 7 of Li et
al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (2020).

Needs matplotlib (``pip install -e ".[benchmarks]"``) and, for the DDP line, PyTorch
(``pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu``).

    python benchmarks/bucket_sweep.py --json benchmarks/results/bucket_sweep.json \\
        --png docs/img/bucket_sweep.png

The plot shows each cap's median (line) and every run (dots).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multiprocess import run_one

CAPS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
LABELS = {"fdp": "fdp", "torch": "PyTorch DDP"}


def sweep(args: argparse.Namespace) -> dict:
    """(framework, cap) -> per-repeat results of one multiprocess run each."""
    frameworks = args.frameworks.split(",")
    caps = [float(c) for c in args.caps.split(",")]
    runs: dict[tuple[str, float], list[dict]] = {}
    for r in range(args.repeats):
        # Alternate the order of caps and frameworks between repeats, so drifts in the
        # machine's speed spread over all of them.
        order = caps if r % 2 == 0 else caps[::-1]
        for cap in order:
            for fw in frameworks if r % 2 == 0 else frameworks[::-1]:
                run_args = copy.copy(args)
                run_args.bucket_cap_mb = cap
                res = run_one(fw, args.model, args.nproc, run_args)
                runs.setdefault((fw, cap), []).append(res)
                ms = 1e3 * res["step_s"]
                print(f"{fw:<6} cap {cap:>7.2f} MB  {ms:8.2f} ms/step", flush=True)
    return runs


def bucket_count(model: str, cap: float) -> int:
    """How many buckets fdp's plan (DDP's assignment) makes of the model at this cap."""
    from _mp_models import init_params

    import fdp

    return len(fdp.bucketing.plan_buckets(init_params(model), bucket_cap_mb=cap).buckets)


def summarise(runs: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    for (fw, cap), results in sorted(runs.items()):
        step_ms = [1e3 * r["step_s"] for r in results]
        rows.append(
            {
                "framework": fw,
                "bucket_cap_mb": cap,
                "median_step_ms": statistics.median(step_ms),
                "step_ms": step_ms,
                "buckets": bucket_count(args.model, cap),
            }
        )
    for fw in {row["framework"] for row in rows}:
        best = min(row["median_step_ms"] for row in rows if row["framework"] == fw)
        for row in rows:
            if row["framework"] == fw:
                row["ratio_to_best"] = row["median_step_ms"] / best
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'framework':<12}{'cap MB':>8}{'buckets':>9}{'step ms':>10}{'/ best':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{LABELS[row['framework']]:<12}{row['bucket_cap_mb']:>8.2f}{row['buckets']:>9}"
            f"{row['median_step_ms']:>10.2f}{row['ratio_to_best']:>8.3f}"
        )


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for fw in sorted({row["framework"] for row in rows}):
        mine = sorted((r for r in rows if r["framework"] == fw), key=lambda r: r["bucket_cap_mb"])
        caps = [r["bucket_cap_mb"] for r in mine]
        (line,) = ax.plot(caps, [r["median_step_ms"] for r in mine], marker="o", label=LABELS[fw])
        for r in mine:  # every repeat, to show the spread
            ax.scatter(
                [r["bucket_cap_mb"]] * len(r["step_ms"]),
                r["step_ms"],
                s=10,
                alpha=0.4,
                color=line.get_color(),
            )
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb (MB)")
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--caps", default=",".join(str(c) for c in CAPS))
    parser.add_argument("--frameworks", default="fdp,torch")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cap and framework")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mlp-batch", type=int, default=64)
    parser.add_argument("--transformer-batch", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json")
    parser.add_argument("--png")
    parser.add_argument("--replot", metavar="JSON", help="only plot a saved result to --png")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        plot(saved["rows"], args.png, saved["meta"]["title"])
        return 0
    args.batch = {"mlp": args.mlp_batch, "transformer": args.transformer_batch}
    args.fdp_args, args.launch_args = [], []

    rows = summarise(sweep(args), args)
    title = (
        f"{args.model}, {args.nproc} processes x 1 CPU device (gloo), "
        f"{platform.machine()} {os.cpu_count()} cores"
    )
    print(f"\n{title}; median of {args.repeats} runs, each the median of {args.rounds} rounds")
    print_table(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": {"argv": sys.argv, "title": title}, "rows": rows}, f, indent=1)
    if args.png:
        plot(rows, args.png, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
