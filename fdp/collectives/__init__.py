"""Pytree-aware functional collectives for use inside ``jax.shard_map``.

Each takes the mesh axis as ``axis_name`` (default ``'data'``) and mirrors a
``torch.distributed`` collective; see docs/collectives.md.
"""

from fdp.collectives._all_reduce import ReduceOp as ReduceOp
from fdp.collectives._all_reduce import all_reduce as all_reduce
from fdp.collectives._axis import axis_size as axis_size
from fdp.collectives._axis import is_varying as is_varying
from fdp.collectives._axis import mean_over as mean_over
from fdp.collectives._axis import sum_over as sum_over
from fdp.collectives._axis import vary as vary
from fdp.collectives._ops import all_gather as all_gather
from fdp.collectives._ops import all_to_all as all_to_all
from fdp.collectives._ops import barrier as barrier
from fdp.collectives._ops import broadcast as broadcast
from fdp.collectives._ops import gather as gather
from fdp.collectives._ops import permute as permute
from fdp.collectives._ops import reduce as reduce
from fdp.collectives._ops import reduce_scatter as reduce_scatter
from fdp.collectives._ops import scatter as scatter
from fdp.collectives._ops import shift as shift

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_size",
    "barrier",
    "broadcast",
    "gather",
    "is_varying",
    "mean_over",
    "permute",
    "reduce",
    "reduce_scatter",
    "scatter",
    "shift",
    "sum_over",
    "vary",
]
