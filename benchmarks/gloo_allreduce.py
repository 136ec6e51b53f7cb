"""A raw all-reduce over gloo: JAX's (``psum`` in ``shard_map``) against torch.distributed's.

No model and no fdp step: 2 processes x 1 CPU device sum a float32 vector of each size,
under ``fdp launch`` (JAX, collectives through XLA's gloo integration) and under
``torchrun`` (``dist.all_reduce`` on a gloo process group), alternating, several times.
It shows the part of a multi-process step that neither fdp's buckets nor its launcher
decide: how fast the collective library moves bytes.

It also measures how much of an all-reduce XLA:CPU hides behind independent computation
in the same program: six 1024x1024 matmuls alone, the largest all-reduce alone, and
both in one jitted program (hidden = alone + alone - together).

Needs ``pip install torch==2.13.0`` (the CPU build; a benchmark-only dependency).

    python benchmarks/gloo_allreduce.py --json benchmarks/results/gloo_allreduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

OVERLAP = ("matmuls", "all-reduce", "together")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _progress import progress  # noqa: E402
from multiprocess import clean_env, free_port  # noqa: E402

_LAST_FAULTS = [0.0]  # page faults per call of the last _time, after its warm-up


def _time(fn, reps: int) -> list[float]:
    for _ in range(3):
        fn()
    before = _faults()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    _LAST_FAULTS[0] = (_faults() - before) / reps
    return out


def _faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(framework: str, sizes_mb: list[float], reps: int, out: str) -> None:
    """Runs in each process: times one all-reduce of every size; rank 0 writes JSON."""
    import numpy as np

    times: dict = {}
    faults: dict = {}
    if framework in ("jax", "jax-shm"):
        import jax
        from jax.sharding import PartitionSpec as P

        import fdp
        from fdp.backends.cpu._shm import shm_sum

        def shm_total(v, axis):
            return shm_sum(v, axis)

        jax.config.update("jax_num_cpu_devices", 1)
        fdp.init(initialization_timeout=120)
        rank, mesh = fdp.process_index(), fdp.data_mesh()
        total = shm_total if framework == "jax-shm" else jax.lax.psum
        body = jax.shard_map(
            lambda v: total(v, "data"),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
            check_vma=framework == "jax",
        )
        psum = jax.jit(body)
        for mb in sizes_mb:
            x = fdp.shard_batch(np.ones((1, int(mb * 2**20) // 4), np.float32), mesh)
            times[mb] = _time(lambda x=x: jax.block_until_ready(psum(x)), reps)
            faults[mb] = _LAST_FAULTS[0]
        if framework == "jax":  # fdp's own sum (jax-shm) has no donation or overlap rows
            # The largest all-reduce with its input donated: XLA may then give the
            # all-reduce one buffer for input and output (in place, as torch's).
            donated = jax.jit(body, donate_argnums=0)
            fresh = [x.copy() for _ in range(reps + 3)]
            jax.block_until_ready(fresh)
            times["donated"] = _time(lambda: jax.block_until_ready(donated(fresh.pop())), reps)
            faults["donated"] = _LAST_FAULTS[0]
            times["donated_hlo_aliases"] = [
                float("may-alias" in donated.lower(x.copy()).compile().as_text().split("\n", 1)[0])
            ]
            a = np.random.default_rng(0).normal(size=(1, 1024, 1024)).astype(np.float32) / 32
            a = fdp.shard_batch(a, mesh)
            for name, fn in _overlap_programs(mesh).items():
                times[name] = _time(lambda fn=fn: jax.block_until_ready(fn(a, x)), reps)
    else:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        for mb in sizes_mb:
            t = torch.ones(int(mb * 2**20) // 4)
            times[mb] = _time(lambda t=t: dist.all_reduce(t), reps)
            faults[mb] = _LAST_FAULTS[0]
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({**{str(mb): ts for mb, ts in times.items()}, "faults": faults}, f)


def _overlap_programs(mesh):
    """Matmuls, an all-reduce, and both in one program (independent of each other)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def matmuls(a):
        for _ in range(6):
            a = jnp.tanh(a @ a)
        return a

    bodies = {
        "matmuls": lambda a, g: (matmuls(a[0]), g),
        "all-reduce": lambda a, g: (a[0], jax.lax.psum(g, "data")),
        "together": lambda a, g: (matmuls(a[0]), jax.lax.psum(g, "data")),
    }
    specs = {"in_specs": (P("data"), P("data")), "out_specs": (P(), P("data"))}
    return {
        k: jax.jit(jax.shard_map(f, mesh=mesh, check_vma=False, **specs)) for k, f in bodies.items()
    }


def run(framework: str, args: argparse.Namespace) -> dict[float, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        env = clean_env()
        if framework == "jax-untuned":
            env["FDP_MALLOC_TUNING"] = "0"  # glibc as it comes: fdp before issue 18
        worker = {"torch": "torch", "jax-shm": "jax-shm"}.get(framework, "jax")
        me = [os.path.abspath(__file__), "--worker", worker, "--sizes", args.sizes]
        me += ["--reps", str(args.reps), "--out", out]
        if worker != "torch":
            cmd = [sys.executable, "-m", "fdp.launch", "--nproc-per-node", "2"]
            cmd += [*args.launch_args, *me]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            cmd += ["--master-port", str(free_port()), *me]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        with open(out) as f:
            return {_key(k): v for k, v in json.load(f).items()}


def _key(k: str) -> float | str:
    try:
        return float(k)
    except ValueError:
        return k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,34", help="MiB per all-reduce, comma-separated")
    parser.add_argument("--reps", type=int, default=15, help="timed all-reduces per size")
    parser.add_argument("--repeats", type=int, default=3, help="runs per framework")
    parser.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        dest="launch_args",
        help="extra argument for fdp launch (repeatable), e.g. --launch-arg=--no-cpu-binding",
    )
    parser.add_argument("--json")
    parser.add_argument(
        "--frameworks",
        default="jax,jax-untuned,jax-shm,torch",
        help="jax (XLA's gloo all-reduce), jax-untuned (FDP_MALLOC_TUNING=0), jax-shm "
        "(fdp's shared-memory sum, comm_hook='shm_allreduce'), torch (needs jax first)",
    )
    parser.add_argument("--worker", choices=("jax", "jax-shm", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, sizes, args.reps, args.out)
        return 0

    frameworks = tuple(args.frameworks.split(","))
    if frameworks[0] != "jax" or "torch" not in frameworks:
        parser.error(f"--frameworks must start with jax and include torch, got {args.frameworks}")
    runs: dict[str, dict] = {fw: {} for fw in frameworks}
    faults: dict[str, dict] = {fw: {} for fw in frameworks}
    nfw = len(frameworks)
    for r in progress(range(args.repeats), "repeats"):
        for fw in frameworks[r % nfw :] + frameworks[: r % nfw]:
            for key, ts in run(fw, args).items():
                if key == "faults":
                    for k, v in ts.items():
                        faults[fw].setdefault(_key(k), []).append(v)
                else:
                    runs[fw].setdefault(key, []).append(statistics.median(ts))
    rows = []
    for mb in [*sizes, "donated"]:
        row: dict = {"mib": mb}
        for fw in frameworks:
            if mb in runs[fw]:
                row[f"{fw}_ms"] = 1e3 * statistics.median(runs[fw][mb])
                row[f"{fw}_faults"] = statistics.median(faults[fw][mb])
        rows.append(row)
    print(
        f"\n2 processes x 1 CPU device, gloo, {platform.machine()} {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}; median of {args.repeats} runs, each the median of "
        f"{args.reps} all-reduces; faults per all-reduce on rank 0 (donated: the largest "
        "size with its input donated)"
    )
    others = [fw for fw in frameworks if fw != "torch"]
    header = f"{'MiB':>8}" + "".join(f"{fw + ' ms':>15}" for fw in [*others, "torch"])
    header += "".join(f"{fw + '/torch':>18}" for fw in others)
    header += "".join(f"{fw + ' flt':>16}" for fw in [*others, "torch"])
    print(header)
    print("-" * len(header))
    largest = rows[len(sizes) - 1]
    nan = float("nan")
    for row in rows:
        torch_ms = row.get("torch_ms", largest["torch_ms"])
        line = f"{row['mib']!s:>8}"
        line += "".join(f"{row.get(f'{fw}_ms', nan):>15.2f}" for fw in others)
        line += f"{torch_ms:>15.2f}"
        line += "".join(f"{row.get(f'{fw}_ms', nan) / torch_ms:>18.2f}" for fw in others)
        line += "".join(f"{row.get(f'{fw}_faults', nan):>16.0f}" for fw in [*others, "torch"])
        print(line)
    print(f"donated program aliases its output to its input: {runs['jax']['donated_hlo_aliases']}")
    overlap = {k: 1e3 * statistics.median(runs["jax"][k]) for k in OVERLAP}
    overlap["hidden"] = overlap["matmuls"] + overlap["all-reduce"] - overlap["together"]
    print(
        f"\nJAX, one program, {sizes[-1]:g} MiB all-reduce: matmuls {overlap['matmuls']:.1f} ms, "
        f"all-reduce {overlap['all-reduce']:.1f} ms, together {overlap['together']:.1f} ms "
        f"(hidden: {overlap['hidden']:.1f} ms)"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "meta": {"argv": sys.argv, "load_average": os.getloadavg()},
                    "rows": rows,
                    "overlap_ms": overlap,
                    "runs": runs,
                    "faults": faults,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
