"""Step time against bucket size, with real processes (gloo), like the DDP paper's figure.

For each ``bucket_cap_mb`` it runs a 2-process model of ``multiprocess.py`` (``--model``:
the MLP by default, 8 x 1024, batch 64 per process, SGD; or ``cnn``, ``transformer``)
under ``fdp launch`` and, with ``--frameworks fdp,torch``,
PyTorch DDP under ``torchrun`` with the same cap, in alternating order, several times.
It prints the median step time per cap (and its ratio to the best cap), writes JSON,
and plots step time against cap to a PNG (log-scaled cap axis), as in Figure 7 of Li et
al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (2020).

Needs matplotlib (``pip install -e ".[benchmarks]"``) and, for the DDP line, PyTorch
(``pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu``).

    python benchmarks/bucket_sweep.py --json benchmarks/results/bucket_sweep.json \\
        --png docs/img/bucket_sweep.png

The plot shows each cap's median (line) and every run (dots). With ``--auto`` fdp also
runs with ``bucket_cap_mb="auto"`` (``fdp.tune`` at the first step), interleaved with
the fixed caps; the table compares its step time with the best and the default cap, and
the plot marks, for each run, the cap it chose at that run's step time (stars).
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

from multiprocess import add_batch_args, batch_sizes, run_one

CAPS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
LABELS = {"fdp": "fdp", "torch": "PyTorch DDP"}


def sweep(args: argparse.Namespace) -> dict:
    """(framework, cap) -> per-repeat results of one multiprocess run each."""
    frameworks = args.frameworks.split(",")
    caps: list = [float(c) for c in args.caps.split(",")]
    if args.auto:
        caps.append("auto")
    runs: dict[tuple[str, float | str], list[dict]] = {}
    for r in range(args.repeats):
        # Alternate the order of caps and frameworks between repeats, so drifts in the
        # machine's speed spread over all of them.
        order = caps if r % 2 == 0 else caps[::-1]
        for cap in order:
            for fw in frameworks if r % 2 == 0 else frameworks[::-1]:
                if cap == "auto" and fw != "fdp":
                    continue
                run_args = copy.copy(args)
                run_args.bucket_cap_mb = cap
                res = run_one(fw, args.model, args.nproc, run_args)
                runs.setdefault((fw, cap), []).append(res)
                ms = 1e3 * res["step_s"]
                chosen = res.get("chosen_bucket_cap_mb", cap)
                print(f"{fw:<6} cap {cap!s:>7} MB  {ms:8.2f} ms/step (cap {chosen})", flush=True)
    return runs


def bucket_count(model: str, cap: float) -> int:
    """How many buckets fdp's plan (DDP's assignment) makes of the model at this cap."""
    from _mp_models import init_params

    import fdp

    return len(fdp.bucketing.plan_buckets(init_params(model), bucket_cap_mb=cap).buckets)


def summarise(runs: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    for (fw, cap), results in sorted(runs.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        step_ms = [1e3 * r["step_s"] for r in results]
        chosen = [r.get("chosen_bucket_cap_mb", cap) for r in results]
        rows.append(
            {
                "framework": fw,
                "bucket_cap_mb": cap,
                "chosen_caps": chosen,
                "chosen_layouts": [r.get("resolved_layout") for r in results],
                "first_call_s": [r.get("first_call_s") for r in results],
                "median_step_ms": statistics.median(step_ms),
                "step_ms": step_ms,
                "buckets": bucket_count(args.model, statistics.median(chosen)),
            }
        )
    for fw in {row["framework"] for row in rows}:
        fixed = [r for r in rows if r["framework"] == fw and r["bucket_cap_mb"] != "auto"]
        best = min(row["median_step_ms"] for row in fixed)
        default = [r["median_step_ms"] for r in fixed if r["bucket_cap_mb"] == 25.0]
        for row in rows:
            if row["framework"] == fw:
                row["ratio_to_best"] = row["median_step_ms"] / best
                if default:
                    row["ratio_to_default"] = row["median_step_ms"] / default[0]
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'framework':<12}{'cap MB':>8}{'buckets':>9}{'step ms':>10}{'/ best':>8}"
        f"{'/ default':>11}  chosen"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        auto = row["bucket_cap_mb"] == "auto"
        chosen = (
            ", ".join(
                f"{c:g}/{lay}"
                for c, lay in zip(row["chosen_caps"], row["chosen_layouts"], strict=True)
            )
            if auto
            else ""
        )
        print(
            f"{LABELS[row['framework']]:<12}{row['bucket_cap_mb']!s:>8}{row['buckets']:>9}"
            f"{row['median_step_ms']:>10.2f}{row['ratio_to_best']:>8.3f}"
            f"{row.get('ratio_to_default', float('nan')):>11.3f}  {chosen}"
        )


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for fw in sorted({row["framework"] for row in rows}):
        mine = sorted(
            (r for r in rows if r["framework"] == fw and r["bucket_cap_mb"] != "auto"),
            key=lambda r: r["bucket_cap_mb"],
        )
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
    for r in rows:
        if r["bucket_cap_mb"] == "auto":
            # fdp.tune's choice in each run: at the cap it chose, at that run's step time.
            mark_choices(ax, r["chosen_caps"], r["step_ms"])
    finish_cap_plot(fig, ax, "step time (ms, median)", title, path)


def mark_choices(ax, caps: list[float], ys: list[float]) -> None:
    """Stars where ``bucket_cap_mb="auto"`` chose ``caps``, at heights ``ys``."""
    ax.scatter(
        caps, ys, marker="*", s=220, color="black", zorder=5, label='bucket_cap_mb="auto" chose'
    )


def finish_cap_plot(fig, ax, ylabel: str, title: str, path: str) -> None:
    """Log-scaled cap axis, labels, legend; saves the figure to ``path`` (PNG)."""
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb (MB)")
    ax.set_ylabel(ylabel)
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
    add_batch_args(parser)
    parser.add_argument("--auto", action="store_true", help='also run fdp with "auto"')
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
    args.batch = batch_sizes(args)
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
