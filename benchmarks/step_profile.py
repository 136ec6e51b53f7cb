"""Where a 2-process step's time goes, per compiled instruction, from XLA:CPU's profile.

Runs fdp's 2-process worker (``_mp_fdp.py`` under ``fdp launch``) with
``--trace-steps``: after its timed rounds it profiles a few steps, and XLA:CPU's thunk
executor records a span per executed instruction. Rank 0's table lists the
instructions that take the most time per step (median over the traced steps), for
each comm hook and layout asked for, and for each fdp checkout asked for
(``--roots label=path``: a ``git worktree`` of an earlier commit profiles the code
before a change, in the same run).

    python benchmarks/step_profile.py --model mlp --variants shm_allreduce/flat,noop/flat \\
        --roots before=/tmp/before,after=. --json benchmarks/results/step_profile_shm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multiprocess import add_run_args, batch_sizes, run_one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument(
        "--variants", default="shm_allreduce/flat,noop/flat", help="comm_hook/layout, ..."
    )
    parser.add_argument(
        "--roots", default="current=.", help="label=path of an fdp checkout, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration")
    parser.add_argument("--trace-steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=12, help="instructions shown per run")
    parser.add_argument(
        "--group",
        action="append",
        default=[],
        help="name=regex (repeatable): also show the summed time of the instructions "
        "whose names match, e.g. 'collectives=ffi_call|psum'",
    )
    add_run_args(parser, steps=10, rounds=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.batch = batch_sizes(args)
    args.launch_args = []
    roots = dict(item.split("=", 1) for item in args.roots.split(","))
    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # interleaved: every configuration once per repeat
        for label, root in roots.items():
            for variant in variants:
                hook, layout = variant.split("/")
                args.fdp_args = ["--comm-hook", hook, "--layout", layout]
                args.fdp_args += ["--trace-steps", str(args.trace_steps)]
                args.env = {"PYTHONPATH": os.path.abspath(root)}
                record = run_one("fdp", args.model, 2, args)
                trace = record["trace"]
                runs.setdefault(f"{label} {variant}", []).append(
                    {"step_s": record["step_s"], "op_ms": trace["op_ms"], "step": trace["step"]}
                )
    print(f"{platform.machine()} {os.cpu_count()} cores; {args.model}, 2 processes, rank 0")
    for name, recs in runs.items():
        step_ms = statistics.median(r["step_s"] for r in recs) * 1e3
        print(f"\n{name}: timed step {step_ms:.1f} ms (median of {len(recs)} runs)")
        ops = {op for r in recs for op in r["op_ms"]}
        med = {op: statistics.median(r["op_ms"].get(op, 0.0) for r in recs) for op in ops}
        for op, ms in sorted(med.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {ms:8.2f} ms  {op}")
        for group in args.group:
            gname, pattern = group.split("=", 1)
            total = statistics.median(
                sum(ms for op, ms in r["op_ms"].items() if re.search(pattern, op)) for r in recs
            )
            print(f"  {total:8.2f} ms  [{gname}: {pattern}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"argv": sys.argv, "roots": roots}, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
