"""A worker without JAX whose output is what real ones print (for test_output.py).

    chatty.py

Every rank prints gloo's connection line, a progress bar redrawn with carriage
returns (as tqdm does) with gloo's line landing inside it (once whole, once cut in
two by the bar), a line written in pieces with pauses between them, and a line to
stderr; gloo's whole line with a line of the worker's written between its text and
its newline (as gloo's C++ writes race Python's, seen under fdp launch); gloo's
line written as gloo writes it, through C's stdout piece by piece (std::cout <<),
with a line of the worker's printed between two pieces; gloo's line written whole
(as line-buffered C writes it) between a print's text and its newline, which
Python writes apart when unbuffered; rank 0 waits for rank 1's
pieces, so that their writes overlap in time.
"""

import ctypes
import os
import sys
import time

rank = int(os.environ["RANK"])
out = sys.stdout


def write(text):
    out.write(text)
    out.flush()


write(f"[Gloo] Rank {rank} is connected to 1 peer ranks. Expected number of connected peer ...\n")
write(f"\rbar 0/3 of rank {rank}")
write(f"[Gloo] Rank {rank + 4} is connected to 7 peer ranks. Expected number is : 7\n")
# gloo's line cut in two by the bar's carriage return, written between its halves.
write(f"[Gloo] Rank {rank + 2} is connected to ")
write(f"\rbar 0/3 of rank {rank} ")
write("3 peer ranks. Expected number of connected peer ranks is : 3\n")
for i in (1, 2, 3):
    write(f"\rbar {i}/3 of rank {rank}")
    time.sleep(0.05)
write("\n")
for piece in ("pieces", " of", f" rank {rank}\n"):
    write(piece)
    time.sleep(0.1)
# gloo's text, then the worker's own line, then gloo's newline.
write(f"[Gloo] Rank {rank + 6} is connected to 1 peer ranks. ")
write("Expected number of connected peer ranks is : 1")
write(f"glued to gloo's line by rank {rank}\n")
write("\n")
# As gloo writes: C's stdout, piece by piece; the worker prints between two pieces.
libc = ctypes.CDLL(None)
c_stdout = ctypes.c_void_p.in_dll(libc, "stdout")
libc.fputs(f"[Gloo] Rank {rank + 8} is connected to ".encode(), c_stdout)
write(f"between gloo's pieces by rank {rank}\n")
libc.fputs(b"1 peer ranks. Expected number of connected peer ranks is : 1\n", c_stdout)
libc.fflush(c_stdout)
# Line-buffered C: gloo's whole line in one write, between a print's two writes.
write(f"printed around gloo's line by rank {rank}")
libc.fputs(f"[Gloo] Rank {rank + 10} is connected to 1 peer ranks. ".encode(), c_stdout)
libc.fputs(b"Expected number of connected peer ranks is : 1\n", c_stdout)
libc.fflush(c_stdout)
write("\n")
print(f"err from rank {rank}", file=sys.stderr, flush=True)
