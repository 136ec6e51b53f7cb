"""Several processes: joining the run, host-level collectives and a shared store.

``fdp.init`` joins the processes (``jax.distributed`` underneath); the host
collectives and :class:`Store` coordinate them through JAX's coordination
service, as ``torch.distributed``'s object collectives and stores do. In a
single process everything here works too, and returns at once.
"""

from fdp.runtime._consistency import check_consistent as check_consistent
from fdp.runtime._heartbeat import busy as busy
from fdp.runtime._host import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from fdp.runtime._host import all_gather_object as all_gather_object
from fdp.runtime._host import barrier as barrier
from fdp.runtime._host import broadcast_object as broadcast_object
from fdp.runtime._host import monitored_barrier as monitored_barrier
from fdp.runtime._init import init as init
from fdp.runtime._init import local_rank as local_rank
from fdp.runtime._init import local_world_size as local_world_size
from fdp.runtime._init import process_count as process_count
from fdp.runtime._init import process_index as process_index
from fdp.runtime._preemption import reached_preemption as reached_preemption
from fdp.runtime._serialize import SerializationError as SerializationError
from fdp.runtime._store import Store as Store

__all__ = [
    "DEFAULT_TIMEOUT",
    "SerializationError",
    "Store",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "busy",
    "check_consistent",
    "init",
    "local_rank",
    "local_world_size",
    "monitored_barrier",
    "process_count",
    "process_index",
    "reached_preemption",
]
