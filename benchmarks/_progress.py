"""Progress bars for the benchmarks' long loops (tqdm, in the `benchmarks` extra).

On stderr, so that the tables on stdout and the JSON files stay as they were; a bar
disappears when its loop ends (`leave=False`).
"""

import sys

from tqdm.auto import tqdm


def progress(iterable, desc, total=None):
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)
