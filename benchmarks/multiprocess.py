"""fdp against PyTorch DDP with real processes on CPU (gloo), side by side.

For each model (the same weights, data and arithmetic in both frameworks; see
``_mp_models.py``) and each process count, it runs fdp under ``fdp launch`` and
PyTorch DDP under ``torchrun``, in alternating order, several times, and reports
examples per second, fdp's ratio to DDP, and each framework's scaling efficiency
against its own 1-process run (``throughput(N) / (N * throughput(1))``). The first
losses of both are printed too: equal losses show both compute the same thing.

Needs ``pip install torch==2.13.0`` (the CPU build; a benchmark-only dependency).

    python benchmarks/multiprocess.py --json benchmarks/results/multiprocess.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This environment without fdp or XLA settings, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FDP_", "XLA_FLAGS"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def run_one(framework: str, model: str, nproc: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        common = [
            "--model",
            model,
            "--batch",
            str(args.batch[model]),
            "--steps",
            str(args.steps),
            "--rounds",
            str(args.rounds),
            "--warmup",
            str(args.warmup),
            "--bucket-cap-mb",
            str(args.bucket_cap_mb),
            "--out",
            out,
        ]
        env = clean_env()
        if framework == "fdp":
            script = [os.path.join(HERE, "_mp_fdp.py"), *common, *args.fdp_args]
            if nproc == 1:
                cmd = [sys.executable, *script]
            else:
                cmd = [
                    sys.executable,
                    "-m",
                    "fdp.launch",
                    "--nproc-per-node",
                    str(nproc),
                    *args.launch_args,
                    *script,
                ]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(nproc),
                "--master-port",
                str(free_port()),
                os.path.join(HERE, "_mp_torch.py"),
                *common,
            ]
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--nprocs", default="1,2")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--mlp-batch", type=int, default=64)
    parser.add_argument("--transformer-batch", type=int, default=16)
    parser.add_argument(
        "--fdp-arg",
        action="append",
        default=[],
        dest="fdp_args",
        help="extra argument for the fdp worker (repeatable)",
    )
    parser.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        dest="launch_args",
        help="extra argument for fdp launch (repeatable)",
    )
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.batch = {"mlp": args.mlp_batch, "transformer": args.transformer_batch}

    results: dict = {}
    for model in args.models.split(","):
        for nproc in (int(n) for n in args.nprocs.split(",")):
            for r in range(args.repeats):
                order = ("fdp", "torch") if r % 2 == 0 else ("torch", "fdp")
                for fw in order:
                    res = run_one(fw, model, nproc, args)
                    results.setdefault((model, nproc, fw), []).append(res)
                    print(
                        f"{model:<12} {nproc} proc {fw:<5} {res['examples_per_s']:9.1f} ex/s",
                        flush=True,
                    )

    rows = []
    for model in args.models.split(","):
        one = (
            {
                fw: statistics.median(r["examples_per_s"] for r in results[(model, 1, fw)])
                for fw in ("fdp", "torch")
            }
            if (model, 1, "fdp") in results
            else None
        )
        for nproc in (int(n) for n in args.nprocs.split(",")):
            eps = {
                fw: statistics.median(r["examples_per_s"] for r in results[(model, nproc, fw)])
                for fw in ("fdp", "torch")
            }
            row = {
                "model": model,
                "nproc": nproc,
                "params": results[(model, nproc, "fdp")][0]["params"],
                "fdp_examples_per_s": eps["fdp"],
                "torch_examples_per_s": eps["torch"],
                "ratio": eps["fdp"] / eps["torch"],
                "fdp_runs": [r["examples_per_s"] for r in results[(model, nproc, "fdp")]],
                "torch_runs": [r["examples_per_s"] for r in results[(model, nproc, "torch")]],
                "first_losses": {
                    fw: results[(model, nproc, fw)][0]["first_losses"] for fw in ("fdp", "torch")
                },
            }
            if one:
                for fw in ("fdp", "torch"):
                    row[f"{fw}_scaling"] = eps[fw] / (nproc * one[fw])
            rows.append(row)

    print(
        f"\n{platform.machine()}, {os.cpu_count()} cores; median of {args.repeats} runs, "
        f"each the median of {args.rounds} rounds x {args.steps} steps"
    )
    header = (
        f"{'model':<12}{'procs':>6}{'params':>11}{'fdp ex/s':>10}{'DDP ex/s':>10}"
        f"{'fdp/DDP':>9}{'fdp scaling':>13}{'DDP scaling':>13}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['model']:<12}{row['nproc']:>6}{row['params']:>11,}"
            f"{row['fdp_examples_per_s']:>10.1f}{row['torch_examples_per_s']:>10.1f}"
            f"{row['ratio']:>9.3f}{row.get('fdp_scaling', float('nan')):>13.3f}"
            f"{row.get('torch_scaling', float('nan')):>13.3f}"
        )
    for row in rows:
        print(
            f"first losses {row['model']} x{row['nproc']}: fdp {row['first_losses']['fdp']} "
            f"DDP {row['first_losses']['torch']}"
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "meta": {
                        "argv": sys.argv,
                        "cores": os.cpu_count(),
                        "machine": platform.machine(),
                    },
                    "results": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
