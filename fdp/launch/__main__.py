"""``python -m fdp.launch`` runs ``fdp launch``."""

import os
import sys

from fdp.launch._cli import main

if __name__ == "__main__":
    code = main()
    # Importing fdp.launch imports fdp, and so JAX, whose teardown at exit takes
    # seconds; the workers are gone by now, so end at once (a preempted node's
    # grace period is short).
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
