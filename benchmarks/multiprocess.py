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


BATCH = {"mlp": 64, "transformer": 16, "cnn": 32}  # examples per process per step


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """``--mlp-batch``, ``--transformer-batch``, ``--cnn-batch``: examples per process."""
    for model, size in BATCH.items():
        parser.add_argument(f"--{model}-batch", type=int, default=size)


def add_run_args(parser: argparse.ArgumentParser, *, steps: int = 20, rounds: int = 3) -> None:
    """The options :func:`run_one` reads: timing, bucket cap, batch sizes, timeout."""
    parser.add_argument("--steps", type=int, default=steps, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    add_batch_args(parser)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")


def batch_sizes(args: argparse.Namespace) -> dict[str, int]:
    """``{model: examples per process}`` from :func:`add_batch_args`' options."""
    return {model: getattr(args, f"{model}_batch") for model in BATCH}


def run_one(framework: str, model: str, nproc: int, args: argparse.Namespace) -> dict:
    """Runs one configuration in fresh processes; returns rank 0's record.

    Besides the timing options, ``args`` carries ``fdp_args``, ``launch_args`` and,
    optionally, ``torch_args`` (extra arguments of the fdp worker, of ``fdp launch``
    and of the torch worker), ``env`` (extra environment variables) and ``prefix``
    (a command to run it under, e.g. ``["taskset", "-c", "0"]``).
    """
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
        env.update(getattr(args, "env", {}))
        if framework == "fdp-untuned":
            # fdp before issue 18: glibc's allocator as it comes (no mallopt in fdp.init).
            env["FDP_MALLOC_TUNING"] = "0"
        if framework.startswith("fdp"):
            script = [os.path.join(HERE, "_mp_fdp.py"), *common, *args.fdp_args]
            if framework == "fdp-unfolded":
                # fdp before fold_dots: dense products of 3-D activations as written.
                script += ["--fold-dots", "off"]
            if framework == "fdp-shm":
                # The sum through shared memory, asked for by name.
                script += ["--comm-hook", "shm_allreduce"]
            if framework == "fdp-gloo":
                # XLA's gloo all-reduce (fdp's default before it summed through shared
                # memory on one host).
                script += ["--comm-hook", "allreduce"]
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
                *getattr(args, "torch_args", []),
            ]
            if framework == "torch-default":
                # DDP constructed without bucket_cap_mb: its plan keeps the 1 MiB first bucket.
                cmd.append("--ddp-default-cap")
        cmd = [*getattr(args, "prefix", []), *cmd]  # e.g. taskset, to pin a 1-process run
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
    add_run_args(parser)
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
    parser.add_argument(
        "--frameworks",
        default="fdp,torch",
        help=(
            "variants run in alternating order: fdp (its defaults), fdp-gloo "
            "(comm_hook='allreduce': XLA's gloo all-reduce), fdp-untuned "
            "(FDP_MALLOC_TUNING=0), fdp-unfolded (fold_dots=False), fdp-shm "
            "(comm_hook='shm_allreduce'), torch, "
            "torch-default (DDP without bucket_cap_mb, so with DDP's 1 MiB first bucket, "
            "as fdp's plan has; a variant row, its ratio to torch in the fdp columns)"
        ),
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.batch = batch_sizes(args)
    frameworks = args.frameworks.split(",")
    variants = [fw for fw in frameworks if fw != "torch"]

    results: dict = {}
    for model in args.models.split(","):
        for nproc in (int(n) for n in args.nprocs.split(",")):
            for r in range(args.repeats):
                # Rotate the order so no variant always runs first (or after the same one).
                order = frameworks[r % len(frameworks) :] + frameworks[: r % len(frameworks)]
                for fw in order:
                    res = run_one(fw, model, nproc, args)
                    results.setdefault((model, nproc, fw), []).append(res)
                    print(
                        f"{model:<12} {nproc} proc {fw:<11} {res['examples_per_s']:9.1f} ex/s "
                        f"{res.get('faults_per_step', float('nan')):9.0f} faults/step "
                        f"rss {res.get('rss_mib', float('nan')):7.1f} MiB",
                        flush=True,
                    )

    rows = []

    def median(model: str, nproc: int, fw: str, key: str) -> float:
        return statistics.median(r.get(key, float("nan")) for r in results[(model, nproc, fw)])

    for model in args.models.split(","):
        for nproc in (int(n) for n in args.nprocs.split(",")):
            for fw in variants:
                eps = {f: median(model, nproc, f, "examples_per_s") for f in (fw, "torch")}
                # Per-repeat ratios of runs made next to each other: less noisy than medians.
                pairs = zip(
                    results[(model, nproc, fw)], results[(model, nproc, "torch")], strict=True
                )
                paired = [a["examples_per_s"] / b["examples_per_s"] for a, b in pairs]
                row = {
                    "model": model,
                    "nproc": nproc,
                    "variant": fw,
                    "params": results[(model, nproc, fw)][0]["params"],
                    "fdp_examples_per_s": eps[fw],
                    "torch_examples_per_s": eps["torch"],
                    "ratio": eps[fw] / eps["torch"],
                    "paired_ratio_median": statistics.median(paired),
                    "fdp_faults_per_step": median(model, nproc, fw, "faults_per_step"),
                    "torch_faults_per_step": median(model, nproc, "torch", "faults_per_step"),
                    "fdp_cpu_sys_ms": median(model, nproc, fw, "cpu_sys_ms_per_step"),
                    "torch_cpu_sys_ms": median(model, nproc, "torch", "cpu_sys_ms_per_step"),
                    "fdp_cpu_user_ms": median(model, nproc, fw, "cpu_user_ms_per_step"),
                    "torch_cpu_user_ms": median(model, nproc, "torch", "cpu_user_ms_per_step"),
                    "fdp_rss_mib": median(model, nproc, fw, "rss_mib"),
                    "torch_rss_mib": median(model, nproc, "torch", "rss_mib"),
                    "fdp_runs": [r["examples_per_s"] for r in results[(model, nproc, fw)]],
                    "torch_runs": [r["examples_per_s"] for r in results[(model, nproc, "torch")]],
                    "first_losses": {
                        f: results[(model, nproc, f)][0]["first_losses"] for f in (fw, "torch")
                    },
                }
                if (model, 1, fw) in results:
                    for f, key in ((fw, "fdp"), ("torch", "torch")):
                        one = median(model, 1, f, "examples_per_s")
                        row[f"{key}_scaling"] = eps[f] / (nproc * one)
                rows.append(row)

    print(
        f"\n{platform.machine()}, {os.cpu_count()} cores; median of {args.repeats} runs, "
        f"each the median of {args.rounds} rounds x {args.steps} steps"
    )
    header = (
        f"{'model':<12}{'procs':>6}{'variant':>13}{'fdp ex/s':>10}{'DDP ex/s':>10}"
        f"{'fdp/DDP':>9}{'paired':>8}{'fdp scal.':>10}{'DDP scal.':>10}"
        f"{'fdp flt/st':>11}{'DDP flt/st':>11}{'fdp sys ms':>11}{'DDP sys ms':>11}"
        f"{'fdp RSS':>9}{'DDP RSS':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['model']:<12}{row['nproc']:>6}{row['variant']:>13}"
            f"{row['fdp_examples_per_s']:>10.1f}{row['torch_examples_per_s']:>10.1f}"
            f"{row['ratio']:>9.3f}{row['paired_ratio_median']:>8.3f}"
            f"{row.get('fdp_scaling', float('nan')):>10.3f}"
            f"{row.get('torch_scaling', float('nan')):>10.3f}"
            f"{row['fdp_faults_per_step']:>11.0f}{row['torch_faults_per_step']:>11.0f}"
            f"{row['fdp_cpu_sys_ms']:>11.1f}{row['torch_cpu_sys_ms']:>11.1f}"
            f"{row['fdp_rss_mib']:>9.1f}{row['torch_rss_mib']:>9.1f}"
        )
    for row in rows:
        print(
            f"first losses {row['model']} x{row['nproc']} {row['variant']}: "
            f"fdp {row['first_losses'][row['variant']]} DDP {row['first_losses']['torch']}"
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
                        "load_average": os.getloadavg(),
                    },
                    "results": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
