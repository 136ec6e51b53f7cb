"""fdp's CPU backend: the accelerations measured on CPU hosts, each named where it shows.

Generic code (the step, the hooks, the bucketing, ``fdp.init``) never imports this
package: it asks :func:`fdp.backends.for_platform` with the platform its devices (or
its host) run on, and gets :data:`BACKEND` on CPUs.

=====================  ==========================================  =============================
acceleration           on by default when                          named as
=====================  ==========================================  =============================
shared-memory sum      a step with the default hook binds to CPU   comm hook ``shm_where_possible``
                       processes, one device each, the data axis   (``describe``, INFO, DETAIL);
                       over all of them                            logger ``fdp.backends.cpu._shm``
``fold_dots``          a step binds to a CPU mesh                  ``fold_dots``,
                                                                   ``fold_dots_products`` (INFO,
                                                                   ``describe``, DETAIL);
                                                                   ``fdp fold_dots: ...`` (DEBUG)
malloc tuning          ``fdp.init`` on a host whose JAX runs on    ``fdp: host malloc tuned``
                       CPUs                                        (DEBUG)
=====================  ==========================================  =============================

Each can be asked for explicitly too (``comm_hook="shm_allreduce"``,
``fold_dots=True``, ``fdp.init(tune_malloc=True)``) and turned off
(``FDP_SHM_ALLREDUCE=0``, ``fold_dots=False``, ``FDP_MALLOC_TUNING=0``).
docs/performance.md has the measurements.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from fdp import _compat
from fdp.backends._backend import Backend
from fdp.backends.cpu._fold import FoldCount as FoldCount
from fdp.backends.cpu._fold import count_folds as count_folds
from fdp.backends.cpu._fold import count_in_jaxpr as count_in_jaxpr
from fdp.backends.cpu._fold import fold_leading_dims as fold_leading_dims
from fdp.backends.cpu._memory import prepare_malloc as prepare_malloc
from fdp.backends.cpu._memory import release_free_memory as release_free_memory
from fdp.backends.cpu._shm import remove_stale as remove_stale
from fdp.backends.cpu._shm_hooks import shm_allreduce as shm_allreduce
from fdp.backends.cpu._shm_hooks import shm_where_possible as shm_where_possible
from fdp.hooks._contract import CommHook


def default_mean_hook(mesh: Mesh, data_size: int) -> CommHook | None:
    """:func:`shm_where_possible` for one CPU device per process, the data axis over all.

    The processes still agree at the first step (one host, a compiler, room in
    ``/dev/shm``, ``FDP_SHM_ALLREDUCE``) or keep XLA's all-reduce; the log says which.
    """
    processes = jax.process_count()
    if (
        processes > 1
        and jax.local_device_count() == 1
        and data_size == mesh.devices.size == processes
    ):
        return shm_where_possible()
    return None


def steps_in_flight(mesh: Mesh) -> int | None:
    """The queue bound jax 0.10's XLA:CPU needs where a step spans devices of this process.

    Several devices of one process meet in XLA:CPU's in-process rendezvous, which
    jaxlib 0.10.2 aborts under a long queue (:data:`fdp._compat.CPU_STEPS_IN_FLIGHT`).
    One device per process, or a JAX without the abort, leaves the queue alone.
    """
    local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    return _compat.cpu_steps_in_flight() if local > 1 else None


BACKEND = Backend(
    "cpu",
    default_mean_hook=default_mean_hook,
    fold_dots=True,
    tune_malloc=True,
    steps_in_flight=steps_in_flight,
)
"""The CPU backend: the shared-memory sum, ``fold_dots`` and malloc tuning, each on by
default where it was measured (docs/performance.md), and the bound on queued steps that
jax 0.10 needs on a multi-device CPU mesh."""

# What users call; the rest is for fdp.backends, the dispatch.
__all__ = [
    "BACKEND",
    "FoldCount",
    "count_folds",
    "fold_leading_dims",
    "shm_allreduce",
    "shm_where_possible",
]
