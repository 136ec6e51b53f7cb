"""How close fdp's shared-memory sum runs to the memory traffic it cannot avoid.

An exact all-reduce into each process's private gradient buffers, where every
element's sum is formed once (so every process gets the same bits), must move, per
process and per bucket of ``n`` bytes over ``P`` processes: its peers' shares into
shared memory (read and write ``(P-1)/P x n``), its own share's sum (read ``n``: its
own share and ``P-1`` published ones; write ``2n/P``: into its output and for its
peers), and its peers' summed shares back (read and write ``(P-1)/P x n``):
``n x (1 + 2/P + 4(P-1)/P)`` bytes, ``4n`` with two processes. This script measures
how fast one process moves bytes while its peers do the same (each pinned to its own
core, copying a buffer of the bucket's size with numpy, all at once), turns that
into the time those bytes take, and sets it beside what the sum of each bucket takes
inside the training step (XLA:CPU's profile of ``_mp_fdp.py --comm-hook
shm_allreduce``, rank 0), and beside the step without communication (``noop``).

The last column answers the question the scaling table raises: how high the
communication factor (step without communication / step with it) could go if every
sum ran at that bound.

    python benchmarks/shm_bound.py --model mlp --json benchmarks/results/shm_bound_mlp.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multiprocess import add_run_args, batch_sizes, run_one

SHM = "fdp_shm_sum"  # the FFI target of fdp's shared-memory sum, as _overlap_trace names it


def traffic_bytes(nbytes: int, world: int) -> float:
    """Bytes one process reads and writes to sum an ``nbytes`` bucket over ``world``.

    >>> traffic_bytes(1000, 2)
    4000.0
    >>> round(traffic_bytes(900, 3))  # copy in 1200, sum 900 + 600, copy out 1200
    3900
    """
    return nbytes * (1 + 2 / world + 4 * (world - 1) / world)


def _copy_worker(rank: int, nbytes: int, reps: int, barrier, out) -> None:
    import numpy as np

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    src = np.full(nbytes // 4, 1.0, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps + 2):  # two unmeasured copies fault the pages in
        barrier.wait()
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    out.put((rank, statistics.median(times[2:])))


def copy_seconds(nbytes: int, world: int, reps: int = 30) -> float:
    """Median seconds one of ``world`` pinned processes takes to copy ``nbytes`` while
    the others copy too (the slowest rank's median)."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    procs = [
        ctx.Process(target=_copy_worker, args=(r, nbytes, reps, barrier, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        medians = [out.get(timeout=120)[1] for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return max(medians)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--trace-steps", type=int, default=6)
    add_run_args(parser, steps=20, rounds=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.batch = batch_sizes(args)
    args.launch_args = []
    runs: dict[str, list[dict]] = {"shm_allreduce": [], "noop": []}
    copies: dict[int, list[float]] = {}
    for _ in range(args.repeats):  # interleaved: every configuration once per repeat
        for hook in runs:
            args.fdp_args = ["--comm-hook", hook, "--trace-steps", str(args.trace_steps)]
            record = run_one("fdp", args.model, args.nproc, args)
            runs[hook].append(record)
            print(f"{hook:<14} step {record['step_s'] * 1e3:7.2f} ms", flush=True)
        for bucket in runs["shm_allreduce"][-1]["trace"]["buckets"]:
            if bucket["kind"] == SHM:  # not the loss's all-reduce (XLA's)
                nbytes = round(bucket["mib"] * 2**20)
                copies.setdefault(nbytes, []).append(copy_seconds(nbytes, args.nproc))
    med = statistics.median
    step = {hook: med(r["step_s"] for r in recs) for hook, recs in runs.items()}
    rows = []
    for nbytes, secs in copies.items():
        measured = [
            b["ms"]
            for r in runs["shm_allreduce"]
            for b in r["trace"]["buckets"]
            if b["kind"] == SHM and round(b["mib"] * 2**20) == nbytes
        ]
        copy_s = med(secs)
        bandwidth = 2 * nbytes / copy_s  # bytes read and written per second
        bound_ms = 1e3 * traffic_bytes(nbytes, args.nproc) / bandwidth
        rows.append(
            {
                "bytes": nbytes,
                "copy_ms": 1e3 * copy_s,
                "gb_per_s": bandwidth / 1e9,
                "bound_ms": bound_ms,
                "measured_ms": med(measured),
                "measured_over_bound": med(measured) / bound_ms,
            }
        )
    noop_ms, shm_ms = 1e3 * step["noop"], 1e3 * step["shm_allreduce"]
    bound_total = sum(r["bound_ms"] for r in rows)
    others = med(
        sum(b["ms"] for b in r["trace"]["buckets"] if b["kind"] != SHM)
        for r in runs["shm_allreduce"]
    )
    summary = {
        "other_collectives_ms": others,
        "step_noop_ms": noop_ms,
        "step_shm_ms": shm_ms,
        "sums_measured_ms": sum(r["measured_ms"] for r in rows),
        "sums_bound_ms": bound_total,
        "communication_factor": noop_ms / shm_ms,
        "communication_factor_at_bound": noop_ms / (noop_ms + bound_total),
    }
    print(
        f"\n{platform.machine()} {os.cpu_count()} cores; {args.model}, {args.nproc} processes, "
        f"medians of {args.repeats} runs"
    )
    head = (
        f"{'bucket bytes':>13}{'copy ms':>9}{'GB/s':>7}{'bound ms':>10}{'in step ms':>12}"
        f"{'in step / bound':>17}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['bytes']:>13,}{r['copy_ms']:>9.2f}{r['gb_per_s']:>7.1f}"
            f"{r['bound_ms']:>10.2f}{r['measured_ms']:>12.2f}{r['measured_over_bound']:>17.2f}"
        )
    print(
        f"step: no communication {noop_ms:.1f} ms, shared-memory sum {shm_ms:.1f} ms; "
        f"sums {summary['sums_measured_ms']:.2f} ms (bound {bound_total:.2f}), XLA's "
        f"all-reduces (the loss) {others:.2f} ms; "
        f"communication factor {summary['communication_factor']:.3f}, "
        f"at the bound {summary['communication_factor_at_bound']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            meta = {"argv": sys.argv, "machine": platform.machine(), "cores": os.cpu_count()}
            json.dump({"meta": meta, "buckets": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
