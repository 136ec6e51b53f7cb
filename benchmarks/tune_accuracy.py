"""Does ``bucket_cap_mb="auto"`` choose the best cap? Its choices, timed in one full sweep.

Separate runs of one compiled program differ by 10% on a small shared machine (which
core, which memory, what else runs), more than the caps differ from each other, so a
sweep of one run per cap cannot rank caps 3% apart. This script times the full sweep
(every cap of ``--caps`` in every layout: the candidates of ``fdp.tune``) inside one
2-process run, interleaved round by round, so the caps share that run's conditions;
and it runs ``bucket_cap_mb="auto"`` in separate runs, as a user would, and records
what each chose. Runs alternate between the two. Each choice is then looked up in the
sweeps: its step time over the best candidate's and over DDP's default (25 MB,
``layout="auto"``), per sweep, median over sweeps.

    python benchmarks/tune_accuracy.py --model transformer \\
        --json benchmarks/results/tune_accuracy_transformer.json \\
        --png docs/img/tune_accuracy_transformer.png

The sweep calls ``fdp.tune`` itself with a long screening (``--sweep-rounds``), no
race and no margin: the tuner's timing loop, run long, is the reference here; the
choices come from other processes with the tuner's defaults.
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

from bucket_sweep import finish_cap_plot, mark_choices
from multiprocess import add_batch_args, batch_sizes, run_one

DEFAULT = "25.0/auto"


def measure(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Sweeps (one run each) and auto runs, alternating."""
    sweeps, autos = [], []
    for r in range(args.repeats):
        for kind in ("sweep", "auto") if r % 2 == 0 else ("auto", "sweep"):
            run_args = copy.copy(args)
            if kind == "sweep":
                run_args.fdp_args = [
                    "--sweep-rounds",
                    str(args.sweep_rounds),
                    "--sweep-caps",
                    args.caps,
                ]
                run_args.bucket_cap_mb = 25.0
                res = run_one("fdp", args.model, args.nproc, run_args)
                sweeps.append(res)
                best = min(res["step_s"], key=res["step_s"].get)
                print(
                    f"sweep {len(sweeps)}: best {best} {1e3 * res['step_s'][best]:.2f} ms, "
                    f"default {1e3 * res['step_s'][DEFAULT]:.2f} ms",
                    flush=True,
                )
            else:
                # Only the choice matters here: one short round after tuning.
                run_args.bucket_cap_mb = "auto"
                run_args.steps, run_args.rounds, run_args.warmup = 1, 1, 1
                res = run_one("fdp", args.model, args.nproc, run_args)
                autos.append(res)
                print(
                    f"auto {len(autos)}: chose {chosen_key(res)} "
                    f"(tuning {res['first_call_s']:.0f} s)",
                    flush=True,
                )
    return sweeps, autos


def timed_as(sweep: dict, cand: str) -> float:
    """The candidate's step time in a sweep (a twin's, if its program was timed as one)."""
    return sweep["step_s"][sweep["same_program"].get(cand, cand)]


def chosen_key(auto: dict) -> str:
    """The candidate the tuner chose, as the sweep names it (layout as tuned, not resolved)."""
    return f"{float(auto['chosen_bucket_cap_mb'])}/{auto['chosen_layout']}"


def summarise(sweeps: list[dict], autos: list[dict]) -> dict:
    cands = sorted(
        {c for s in sweeps for c in (*s["step_s"], *s["same_program"])},
        key=lambda c: (c.split("/")[1], float(c.split("/")[0])),
    )
    table = []
    for cand in cands:
        ratios = [timed_as(s, cand) / min(s["step_s"].values()) for s in sweeps]
        table.append(
            {
                "candidate": cand,
                "step_ms": [1e3 * timed_as(s, cand) for s in sweeps],
                "ratio_to_best": ratios,
                "median_ratio_to_best": statistics.median(ratios),
            }
        )
    choices = []
    for auto in autos:
        cand = chosen_key(auto)
        if cand not in sweeps[0]["step_s"] and cand not in sweeps[0]["same_program"]:
            raise SystemExit(f"auto chose {cand}, which --caps did not sweep; sweep its caps too")
        to_best = [timed_as(s, cand) / min(s["step_s"].values()) for s in sweeps]
        to_default = [timed_as(s, cand) / timed_as(s, DEFAULT) for s in sweeps]
        choices.append(
            {
                "chosen": cand,
                "tuning_s": auto["first_call_s"],
                "ratio_to_best": to_best,
                "median_ratio_to_best": statistics.median(to_best),
                "median_ratio_to_default": statistics.median(to_default),
            }
        )
    return {"candidates": table, "choices": choices}


def print_summary(summary: dict, title: str) -> None:
    print(f"\n{title}")
    print(f"{'candidate':<14}{'step ms (each sweep)':<36}{'/ best (median)':>16}")
    for row in summary["candidates"]:
        each = ", ".join(f"{ms:.1f}" for ms in row["step_ms"])
        print(f"{row['candidate']:<14}{each:<36}{row['median_ratio_to_best']:>16.3f}")
    print(f"\n{'auto chose':<14}{'tuning s':>10}{'/ best':>10}{'/ default':>11}  (medians)")
    for c in summary["choices"]:
        print(
            f"{c['chosen']:<14}{c['tuning_s']:>10.0f}{c['median_ratio_to_best']:>10.3f}"
            f"{c['median_ratio_to_default']:>11.3f}"
        )


def plot(summary: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    layouts = sorted({r["candidate"].split("/")[1] for r in summary["candidates"]})
    for layout in layouts:
        rows = [r for r in summary["candidates"] if r["candidate"].endswith("/" + layout)]
        caps = [float(r["candidate"].split("/")[0]) for r in rows]
        ax.plot(
            caps,
            [r["median_ratio_to_best"] for r in rows],
            marker="o",
            label=f'layout="{layout}"',
        )
    caps = [float(c["chosen"].split("/")[0]) for c in summary["choices"]]
    mark_choices(ax, caps, [c["median_ratio_to_best"] for c in summary["choices"]])
    finish_cap_plot(fig, ax, "step time / best candidate's (median over sweeps)", title, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--caps", default="0.5,1,2.5,5,10,25,50", help="fdp.tune's by default")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps, and auto runs")
    parser.add_argument("--sweep-rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="steps per round of the sweep")
    parser.add_argument("--warmup", type=int, default=2)
    add_batch_args(parser)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--json")
    parser.add_argument("--png")
    parser.add_argument("--replot", metavar="JSON", help="only plot a saved result to --png")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        plot(saved, args.png, saved["meta"]["title"])
        return 0
    args.batch = batch_sizes(args)
    args.rounds = 1
    args.fdp_args, args.launch_args = [], []

    sweeps, autos = measure(args)
    summary = summarise(sweeps, autos)
    title = (
        f"{args.model}, {args.nproc} processes x 1 CPU device (gloo), "
        f"{platform.machine()} {os.cpu_count()} cores;\n{len(sweeps)} sweeps of "
        f"{args.sweep_rounds} rounds x {args.steps} steps"
    )
    print_summary(summary, title)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "meta": {"argv": sys.argv, "title": title},
                    "sweeps": sweeps,
                    "autos": autos,
                    **summary,
                },
                f,
                indent=1,
            )
    if args.png:
        plot(summary, args.png, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
