"""Where scaling efficiency goes: each framework's 2-process efficiency, in three factors.

Scaling efficiency (``multiprocess.py``) is ``throughput(2 processes) / (2 x
throughput(1 process))``, with the 1-process run using every core. On a machine with as
many cores as processes that mixes three things, which this script measures apart, for
fdp and PyTorch DDP, from runs of the same model (same weights, data and arithmetic):

- ``one process, all cores / one core``: how much one process gains from the other
  cores (its intra-op threads); the 1-process run pinned to one core
  (``taskset -c 0``, thread counts 1) against the same run on all cores;
- ``side by side``: two 1-core processes without communication (fdp
  ``comm_hook="noop"``, DDP's ``noop_hook``) against twice one 1-core process: what
  running next to each other costs (shared caches and memory bandwidth);
- ``communication``: the 2-process step with its all-reduce against the same without.

Then ``efficiency = side_by_side x communication / (all_cores / one_core)`` exactly
(up to the medians). Runs rotate between the configurations; each is the median of
``--rounds`` rounds, the table the median of ``--repeats`` runs.

    python benchmarks/scaling_parts.py --models mlp --json benchmarks/results/scaling_parts_mlp.json
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

from multiprocess import add_run_args, batch_sizes, run_one

ONE_CORE = {"prefix": ["taskset", "-c", "0"], "env": {"OMP_NUM_THREADS": "1"}}
# name -> (framework of run_one, processes, extra settings)
CONFIGS = {
    "fdp 1 proc": ("fdp", 1, {}),
    "fdp 1 proc 1 core": ("fdp", 1, ONE_CORE),
    "fdp 2 proc noop": ("fdp", 2, {"fdp_args": ["--comm-hook", "noop"]}),
    "fdp 2 proc": ("fdp", 2, {}),
    "fdp-gloo 2 proc": ("fdp-gloo", 2, {}),
    "torch 1 proc": ("torch", 1, {}),
    "torch 1 proc 1 core": ("torch", 1, ONE_CORE),
    "torch 2 proc noop": ("torch", 2, {"torch_args": ["--comm-hook", "noop"]}),
    "torch 2 proc": ("torch", 2, {}),
}
# The rows: a framework's 2-process configuration and the runs its factors come from.
ROWS = {
    "fdp": ("fdp", "fdp 2 proc"),  # its default: summed through shared memory on one host
    "fdp (gloo)": ("fdp", "fdp-gloo 2 proc"),  # comm_hook="allreduce": XLA's gloo all-reduce
    "DDP": ("torch", "torch 2 proc"),
}


def measure(args: argparse.Namespace, model: str) -> dict[str, list[dict]]:
    names = list(CONFIGS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        k = (r * 3) % len(names)
        for name in names[k:] + names[:k]:
            fw, nproc, extra = CONFIGS[name]
            run_args = copy.copy(args)
            run_args.fdp_args = extra.get("fdp_args", [])
            run_args.torch_args = extra.get("torch_args", [])
            run_args.prefix = extra.get("prefix", [])
            run_args.env = extra.get("env", {})
            res = run_one(fw, model, nproc, run_args)
            runs[name].append(res)
            print(f"{model:<12} {name:<20} {res['examples_per_s']:9.1f} ex/s", flush=True)
    return runs


def summarise(runs: dict[str, list[dict]], model: str) -> list[dict]:
    def eps(name: str) -> float:
        return statistics.median(r["examples_per_s"] for r in runs[name])

    rows = []
    for label, (fw, two) in ROWS.items():
        all_cores, one_core = eps(f"{fw} 1 proc"), eps(f"{fw} 1 proc 1 core")
        noop = eps(f"{fw} 2 proc noop")
        rows.append(
            {
                "model": model,
                "variant": label,
                "ex_per_s_1proc": all_cores,
                "ex_per_s_1proc_1core": one_core,
                "ex_per_s_2proc_noop": noop,
                "ex_per_s_2proc": eps(two),
                "all_cores_over_one": all_cores / one_core,
                "side_by_side": noop / (2 * one_core),
                "communication": eps(two) / noop,
                "efficiency": eps(two) / (2 * all_cores),
            }
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    head = (
        f"{'model':<12}{'variant':<12}{'1p ex/s':>9}{'1p 1c':>9}{'2p noop':>9}{'2p':>9}"
        f"{'cores':>8}{'side':>8}{'comm':>8}{'eff':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<12}{r['variant']:<12}{r['ex_per_s_1proc']:>9.1f}"
            f"{r['ex_per_s_1proc_1core']:>9.1f}{r['ex_per_s_2proc_noop']:>9.1f}"
            f"{r['ex_per_s_2proc']:>9.1f}{r['all_cores_over_one']:>8.3f}{r['side_by_side']:>8.3f}"
            f"{r['communication']:>8.3f}{r['efficiency']:>8.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp")
    parser.add_argument("--repeats", type=int, default=3)
    add_run_args(parser)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.batch = batch_sizes(args)
    args.launch_args = []

    rows, raw = [], {}
    for model in args.models.split(","):
        runs = measure(args, model)
        raw[model] = runs
        rows += summarise(runs, model)
    print(f"\n{platform.machine()} {os.cpu_count()} cores; median of {args.repeats} runs")
    print_rows(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": {"argv": sys.argv}, "rows": rows, "runs": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
