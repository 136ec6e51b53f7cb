"""Rank 0 broadcasts a 16 MiB value of empty lists; rank 1 reports its error and memory.

Run under `fdp launch --nproc-per-node 2`. The value is valid MessagePack (one array of
256 arrays of 65,535 empty lists, ~1 byte each) that a peer that skips fdp's encoder
could send: decoded, each byte costs Python ~130 bytes. Rank 1 prints one JSON line:
the error, and how much its peak resident memory grew while it received and decoded.
"""

import contextlib
import json
import time

import jax

jax.config.update("jax_num_cpu_devices", 1)

import fdp  # noqa: E402
from fdp import runtime  # noqa: E402
from fdp.runtime import _serialize  # noqa: E402


def peak_rss() -> int:
    """Bytes: the process's peak resident set so far (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


fdp.init(initialization_timeout=60)
me = fdp.process_index()
per, chunks = 65535, 256
value = (
    b"\xdc"
    + chunks.to_bytes(2, "big")
    + (b"\xdc" + per.to_bytes(2, "big") + b"\x90" * per) * chunks
)
runtime.barrier(timeout=60)
if me == 0:
    _serialize.dumps = lambda obj: value  # a peer that does not use fdp's encoder
    # Rank 0 decodes its own value too, as every process does, and is refused as well.
    with contextlib.suppress(_serialize.SerializationError):
        runtime.broadcast_object(None, src=0, timeout=120)
else:
    before, start = peak_rss(), time.monotonic()
    try:
        runtime.broadcast_object(None, src=0, timeout=120)
        error = None
    except _serialize.SerializationError as e:
        error = str(e)
    out = {
        "bytes": len(value),
        "error": error,
        "peak_growth": peak_rss() - before,
        "seconds": time.monotonic() - start,
    }
    print("RESULT " + json.dumps(out), flush=True)
runtime.barrier(timeout=120)
