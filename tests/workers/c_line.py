"""A worker without JAX that leaves a line unfinished in C's stdout and exits with 3.

    c_line.py

fdp launch's bootstrap ends a failed worker with os._exit, which skips C's own
flush at exit: the line is in the console only if the bootstrap flushed it.
"""

import ctypes
import sys

libc = ctypes.CDLL(None)
libc.fputs(b"half a C line", ctypes.c_void_p.in_dll(libc, "stdout"))
sys.exit(3)
