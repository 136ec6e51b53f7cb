"""A worker without JAX, to test fdp launch itself (fast to start).

    probe.py MODE OUTDIR

Every worker writes OUTDIR/ready_RANK.json (its environment, CPU affinity and
pid) and prints a line to stdout and one to stderr. Then, by MODE:
  ok          exit 0
  raise       rank 1 raises RuntimeError; the others sleep
  signal:SIG  rank 1 kills itself with signal SIG (e.g. signal:SIGSEGV); the others sleep
  flaky       rank 1 exits 3 on the first attempt; every worker exits 0 after a restart
  fail        rank 1 exits 4 on every attempt
  sleep       everyone sleeps (the test signals the agent)
  trap        everyone sleeps; SIGTERM writes OUTDIR/term_RANK and exits 143
  stubborn    everyone ignores SIGTERM; rank 1 then exits 5
  grandchild  everyone starts a `sleep 600` child; rank 1 then exits 6
"""

import json
import os
import signal
import subprocess
import sys
import time

mode, outdir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
restarts = int(os.environ["FDP_RESTART_COUNT"])


def stamp(name):
    with open(os.path.join(outdir, f"{name}_{rank}"), "w") as f:
        f.write(repr(time.time()))


if mode == "trap":
    signal.signal(signal.SIGTERM, lambda *_: (stamp("term"), os._exit(143)))
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "grandchild":
    child = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(outdir, f"grandchild_{rank}"), "w") as f:
        f.write(str(child.pid))
record = {
    "env": dict(os.environ),
    "affinity": sorted(os.sched_getaffinity(0)),
    "pid": os.getpid(),
    "argv": sys.argv,
}
# Written aside and renamed: the test polls for ready_*.json while we run, and
# must never read a half-written file.
path = os.path.join(outdir, f"ready_{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
print(f"out from rank {rank}, attempt {restarts}")
print(f"err from rank {rank}", file=sys.stderr)
sys.stdout.flush()

if rank == 1:
    if mode == "raise":
        time.sleep(0.5)
        stamp("failed")
        raise RuntimeError("rank 1 failed on purpose")
    if mode.startswith("signal:"):
        time.sleep(0.5)
        stamp("failed")
        os.kill(os.getpid(), getattr(signal, mode.split(":")[1]))
    if mode == "flaky" and restarts == 0:
        sys.exit(3)
    if mode == "fail":
        sys.exit(4)
    if mode in ("stubborn", "grandchild"):
        time.sleep(0.5)
        stamp("failed")
        sys.exit(5 if mode == "stubborn" else 6)
if mode in ("ok", "flaky"):
    sys.exit(0)
time.sleep(600)
