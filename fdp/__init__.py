"""fdp: PyTorch DDP's behaviour for JAX, as a functional pipeline.

grad -> bucket -> all-reduce -> update, on a ``jax`` device mesh.
"""

from fdp import bucketing as bucketing
from fdp import collectives as collectives
from fdp import hooks as hooks
from fdp._accumulate import Accumulated as Accumulated
from fdp._accumulate import GradAccumulator as GradAccumulator
from fdp._accumulate import grad_accumulator as grad_accumulator
from fdp._data_parallel import data_parallel as data_parallel
from fdp._hlo import CollectiveStats as CollectiveStats
from fdp._hlo import collective_stats as collective_stats
from fdp._hlo import loop_collectives as loop_collectives
from fdp._nnx_step import NNXDataParallelStep as NNXDataParallelStep
from fdp._nnx_step import nnx_train_step as nnx_train_step
from fdp._placement import DATA_AXIS as DATA_AXIS
from fdp._placement import data_mesh as data_mesh
from fdp._placement import replicate as replicate
from fdp._placement import shard_batch as shard_batch
from fdp._reduction import reduce_gradients as reduce_gradients
from fdp._step import DataParallelStep as DataParallelStep
from fdp._step import train_step as train_step
from fdp._step_common import PerDevice as PerDevice
from fdp._train_state import TrainState as TrainState
from fdp._uneven import join as join
from fdp._uneven import pad_batch as pad_batch
from fdp._unused import ParamUsage as ParamUsage
from fdp._unused import find_unused_parameters as find_unused_parameters
from fdp._version import __version__ as __version__
from fdp.bucketing import plan_buckets as plan_buckets

__all__ = [
    "Accumulated",
    "GradAccumulator",
    "ParamUsage",
    "PerDevice",
    "CollectiveStats",
    "DATA_AXIS",
    "DataParallelStep",
    "NNXDataParallelStep",
    "TrainState",
    "__version__",
    "bucketing",
    "collective_stats",
    "collectives",
    "data_mesh",
    "data_parallel",
    "find_unused_parameters",
    "grad_accumulator",
    "join",
    "loop_collectives",
    "hooks",
    "nnx_train_step",
    "pad_batch",
    "plan_buckets",
    "reduce_gradients",
    "replicate",
    "shard_batch",
    "train_step",
]
