"""The shared-memory all-reduce: DDP's mean, summed through ``/dev/shm`` on CPU processes.

The CPU backend's hooks (:mod:`fdp.backends.cpu`): ``shm_allreduce`` when asked for by
name, ``shm_where_possible`` as the default hook of a step bound to CPU processes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from fdp.backends.cpu import _shm
from fdp.collectives._axis import axis_size
from fdp.hooks._basic import allreduce
from fdp.hooks._contract import CommHook, GradBucket, HookState, stateless_init


@functools.cache
def shm_allreduce(timeout: float = 300.0) -> CommHook:
    """DDP's ``allreduce_hook`` through shared memory, for CPU processes on one host.

    The same mean as :func:`fdp.hooks.allreduce` (each gradient divided by the
    number of processes, then summed), but the sum runs in fdp's own FFI call
    instead of XLA's gloo all-reduce: each process copies its bucket into
    ``/dev/shm`` once, sums its share of every peer's bucket, and copies the
    other shares back, in place and inside the compiled step. One call per
    bucket in either layout, on the gradients as they are: no flat buffer is
    packed (the copy that ``layout='flat'`` costs with XLA's all-reduce), and
    the division by the world size is done on the way in. With two processes
    the result has the bits of XLA's gloo all-reduce of the same gradients
    (``layout='leaves'``; XLA's ``'flat'`` program rounds some gradients
    differently, ~1e-7).

    Needs one CPU device per process, every process of the run on one host, and
    a C++ compiler at the first step (the FFI file is compiled once and cached
    under ``~/.cache/fdp``). float32 and float64 buckets are summed as they are;
    narrower float buckets (bfloat16, float16) are divided and summed in float32,
    then cast back. Not for ZeRO stages 2 and 3 (no reduce-scatter form).

    Args:
      timeout: seconds a process waits for a peer at a bucket; past it the
        step fails with an error that names the missing rank(s).

    Example:
      >>> from fdp.backends.cpu import shm_allreduce
      >>> hook = shm_allreduce()
      >>> hook.name, hook is shm_allreduce()
      ('shm_allreduce', True)
    """

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        # The gradients go to the sum as they are, in either layout: no flat buffer is
        # packed, and the division by the world size happens inside the sum.
        grads = list(bucket.gradients)
        # Narrower floats (bfloat16, float16) are divided and summed in float32.
        wide_dtype = bucket.dtype if jnp.dtype(bucket.dtype) in _shm.DTYPES else np.float32
        wide = [g.astype(wide_dtype) for g in grads]
        # 1 / world, rounded in the dtype: what XLA makes of ``g / world``.
        scale = np.asarray(1, wide_dtype) / np.asarray(axis_size(bucket.axis_name), wide_dtype)
        totals = _shm.shm_sum_bucket(
            wide, bucket.axis_name, scale=float(scale), after=bucket.after, timeout=timeout
        )
        return [t.astype(g.dtype) for t, g in zip(totals, grads, strict=True)], state

    return CommHook("shm_allreduce", stateless_init, reduce, vma_safe=False)


@functools.cache
def shm_where_possible(timeout: float = 300.0) -> CommHook:
    """The default hook as a step binds it on CPU processes of one host.

    DDP's mean, named ``shm_where_possible`` (not ``allreduce``: logs, ``describe``
    and the DETAIL check show which transport a step was bound to): each float32
    or float64 bucket is summed as
    :func:`shm_allreduce` sums it, once the processes have agreed at the first
    step that they can (every process on one host, a C++ compiler, room in
    ``/dev/shm`` for the largest bucket, ``FDP_SHM_ALLREDUCE`` not ``0`` in any
    process). Otherwise, and for narrower buckets, XLA's all-reduce, as
    :func:`fdp.hooks.allreduce`; so too for a later program's bucket larger than
    what every process could reserve. The log says which, and why.

    Example:
      >>> from fdp.backends.cpu import shm_where_possible
      >>> hook = shm_where_possible()
      >>> hook.name, hook.vma_safe
      ('shm_where_possible', False)
    """
    shm, xla = shm_allreduce(timeout), allreduce()

    def reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
        dtype = jnp.dtype(bucket.dtype)
        nbytes = sum(g.size for g in bucket.gradients) * dtype.itemsize
        largest = bucket.largest_nbytes
        if dtype in _shm.DTYPES and _shm.usable(bucket.axis_name, timeout, nbytes, largest=largest):
            return shm.reduce(state, bucket)
        return xla.reduce(state, bucket)

    return CommHook("shm_where_possible", stateless_init, reduce, vma_safe=False)
