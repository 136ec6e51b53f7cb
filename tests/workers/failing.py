"""A two-process job in which one rank misbehaves after joining (for test_launch.py).

    failing.py MODE STAMP_FILE

MODE: `raise` (rank 1 raises), `sigkill` (rank 1 kills itself), `straggle`
(rank 1 never reaches the barrier; rank 0 waits with monitored_barrier(timeout=3)),
`raise0` or `exit0` (rank 0, the coordinator's process, raises or calls sys.exit(3)).
Rank 0 otherwise waits at a plain barrier with the default 30-minute timeout, so
only fdp launch can end it early. Just before misbehaving, rank 1 writes the time to
STAMP_FILE.
"""

import os
import signal
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 1)

import fdp  # noqa: E402
from fdp import runtime  # noqa: E402

mode, stamp = sys.argv[1], sys.argv[2]
fdp.init(initialization_timeout=60)
runtime.barrier(timeout=60)  # both processes are up
if fdp.process_index() == 0 and mode == "raise0":
    raise RuntimeError("rank 0 failed on purpose")
if fdp.process_index() == 0 and mode == "exit0":
    sys.exit(3)
if fdp.process_index() == 1:
    with open(stamp, "w") as f:
        f.write(repr(time.time()))
    if mode == "raise":
        raise RuntimeError("rank 1 failed on purpose")
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "straggle":
        time.sleep(3600)
elif mode == "straggle":
    runtime.monitored_barrier(timeout=3)
else:
    runtime.barrier()
