"""``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` in NumPy.

torch's CPU ``randperm`` (``aten/src/ATen/native/TensorFactories.cpp``) fills
``0..n-1`` and runs a Fisher-Yates pass from the front: for ``i`` in ``0..n-2``
it draws ``z = random() % (n - i)`` and swaps positions ``i`` and ``i + z``.
``random()`` is the next 32-bit output of the generator's MT19937, seeded with
the low 32 bits of the seed by the reference ``init_genrand``, the same stream
as NumPy's legacy ``np.random.RandomState(seed)``. For ``n`` of
``2**32 // 20`` or more torch draws 64 bits per swap (two outputs, the first
the high word) to keep the modulo unbiased.
"""

from __future__ import annotations

import numpy as np

# torch: "for small n, preserve old behavior" (one 32-bit draw per swap) below this.
_SMALL_N = (2**32 - 1) // 20


def _raw_uint32(seed: int, count: int) -> np.ndarray:
    """The first ``count`` outputs of MT19937 seeded as torch's ``manual_seed(seed)``."""
    stream = np.random.RandomState(seed % 2**32)
    # A bound of 2**32 returns the generator's 32-bit outputs unchanged.
    return stream.randint(0, 2**32, size=count, dtype=np.uint64)


def torch_randperm(n: int, seed: int) -> np.ndarray:
    """The permutation torch's CPU ``randperm`` gives for a generator seeded with ``seed``.

    Args:
      n: the length of the permutation.
      seed: the generator's seed (``torch.Generator().manual_seed(seed)``).

    Returns:
      An ``int64`` array, a permutation of ``0..n-1``.

    Example:
      >>> torch_randperm(10, 0).tolist()  # torch.randperm(10, generator=g.manual_seed(0))
      [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]
    """
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    swaps = n - 1
    if n < _SMALL_N:
        draws = _raw_uint32(seed, swaps)
    else:
        pairs = _raw_uint32(seed, 2 * swaps).reshape(swaps, 2)
        draws = (pairs[:, 0] << np.uint64(32)) | pairs[:, 1]
    remaining = np.arange(n, 1, -1, dtype=np.uint64)  # n - i for i = 0..n-2
    targets = ((draws % remaining).astype(np.int64) + np.arange(swaps)).tolist()
    # The swaps depend on each other: a plain loop over Python ints is the fastest
    # exact way in NumPy (about 0.6 s per million elements).
    order = list(range(n))
    for i, j in enumerate(targets):
        order[i], order[j] = order[j], order[i]
    return np.asarray(order, dtype=np.int64)
