"""fdp: PyTorch DDP's behaviour for JAX, as a functional pipeline.

grad -> bucket -> all-reduce -> update, on a ``jax`` device mesh.
"""

from fdp import bucketing as bucketing
from fdp import collectives as collectives
from fdp import runtime as runtime
from fdp._checkpoint import CheckpointManager as CheckpointManager
from fdp._checkpoint import Restored as Restored
from fdp._hlo import CollectiveStats as CollectiveStats
from fdp._hlo import collective_stats as collective_stats
from fdp._nnx_step import NNXDataParallelStep as NNXDataParallelStep
from fdp._nnx_step import nnx_train_step as nnx_train_step
from fdp._placement import DATA_AXIS as DATA_AXIS
from fdp._placement import data_mesh as data_mesh
from fdp._placement import replicate as replicate
from fdp._placement import shard_batch as shard_batch
from fdp._reduction import reduce_gradients as reduce_gradients
from fdp._sampler import DistributedSampler as DistributedSampler
from fdp._step import DataParallelStep as DataParallelStep
from fdp._step import train_step as train_step
from fdp._version import __version__ as __version__
from fdp.bucketing import plan_buckets as plan_buckets
from fdp.runtime import check_consistent as check_consistent
from fdp.runtime import init as init
from fdp.runtime import local_rank as local_rank
from fdp.runtime import local_world_size as local_world_size
from fdp.runtime import process_count as process_count
from fdp.runtime import process_index as process_index

__all__ = [
    "CheckpointManager",
    "CollectiveStats",
    "DATA_AXIS",
    "DataParallelStep",
    "DistributedSampler",
    "NNXDataParallelStep",
    "Restored",
    "__version__",
    "bucketing",
    "check_consistent",
    "collective_stats",
    "collectives",
    "data_mesh",
    "init",
    "local_rank",
    "local_world_size",
    "nnx_train_step",
    "plan_buckets",
    "process_count",
    "process_index",
    "reduce_gradients",
    "replicate",
    "runtime",
    "shard_batch",
    "train_step",
]
