"""fdp: PyTorch DDP's behaviour for JAX, as a functional pipeline.

grad -> bucket -> all-reduce -> update, on a ``jax`` device mesh.
"""

from fdp import backends as backends
from fdp import bucketing as bucketing
from fdp import collectives as collectives
from fdp import hooks as hooks
from fdp import runtime as runtime
from fdp._version import __version__ as __version__
from fdp.bucketing import plan_buckets as plan_buckets
from fdp.data._data_parallel import data_parallel as data_parallel
from fdp.data._grain import grain_shard_options as grain_shard_options
from fdp.data._join import join as join
from fdp.data._join import pad_batch as pad_batch
from fdp.data._placement import DATA_AXIS as DATA_AXIS
from fdp.data._placement import HOST_AXES as HOST_AXES
from fdp.data._placement import data_mesh as data_mesh
from fdp.data._placement import replicate as replicate
from fdp.data._placement import shard_batch as shard_batch
from fdp.data._sampler import DistributedSampler as DistributedSampler
from fdp.hooks._reduce_gradients import reduce_gradients as reduce_gradients
from fdp.nn._nnx_sync_batchnorm import NNXSyncBatchNorm as NNXSyncBatchNorm
from fdp.nn._nnx_sync_batchnorm import convert_sync_batchnorm as convert_sync_batchnorm
from fdp.nn._sync_batchnorm import SyncBatchNorm as SyncBatchNorm
from fdp.nn._sync_batchnorm import sync_batchnorm as sync_batchnorm
from fdp.observe._debug import DebugLevel as DebugLevel
from fdp.observe._debug import debug_level as debug_level
from fdp.observe._debug import set_debug_level as set_debug_level
from fdp.observe._describe import BucketReport as BucketReport
from fdp.observe._describe import BucketRow as BucketRow
from fdp.observe._describe import bucket_report as bucket_report
from fdp.observe._describe import describe as describe
from fdp.observe._hlo import CollectiveStats as CollectiveStats
from fdp.observe._hlo import collective_stats as collective_stats
from fdp.observe._hlo import loop_collectives as loop_collectives
from fdp.observe._info import format_info as format_info
from fdp.observe._info import info as info
from fdp.observe._stats import StatsSchedule as StatsSchedule
from fdp.runtime import check_consistent as check_consistent
from fdp.runtime import init as init
from fdp.runtime import local_rank as local_rank
from fdp.runtime import local_world_size as local_world_size
from fdp.runtime import process_count as process_count
from fdp.runtime import process_index as process_index
from fdp.runtime._checkpoint import CheckpointManager as CheckpointManager
from fdp.runtime._checkpoint import CorruptCheckpointError as CorruptCheckpointError
from fdp.runtime._checkpoint import Restored as Restored
from fdp.runtime._preemption import reached_preemption as reached_preemption
from fdp.step._build import nnx_train_step as nnx_train_step
from fdp.step._build import train_step as train_step
from fdp.step._build import tune as tune
from fdp.step.core._comm_state import NNXCommState as NNXCommState
from fdp.step.core._state import PerDevice as PerDevice
from fdp.step.core._state import TrainState as TrainState
from fdp.step.front._accumulate import Accumulated as Accumulated
from fdp.step.front._accumulate import GradAccumulator as GradAccumulator
from fdp.step.front._accumulate import grad_accumulator as grad_accumulator
from fdp.step.front._ddp import DDPFunction as DDPFunction
from fdp.step.front._ddp import ddp as ddp
from fdp.step.front._linen import DataParallelStep as DataParallelStep
from fdp.step.front._nnx import NNXDataParallelStep as NNXDataParallelStep
from fdp.step.grads._usage import ParamUsage as ParamUsage
from fdp.step.grads._usage import find_unused_parameters as find_unused_parameters
from fdp.step.options._policies import Accumulation as Accumulation
from fdp.step.options._policies import Loss as Loss
from fdp.step.options._policies import Reduction as Reduction
from fdp.step.options._policies import Sharding as Sharding
from fdp.step.tune._tune import TuneResult as TuneResult

__all__ = [
    "Accumulated",
    "Accumulation",
    "BucketReport",
    "BucketRow",
    "CheckpointManager",
    "CollectiveStats",
    "CorruptCheckpointError",
    "DATA_AXIS",
    "HOST_AXES",
    "Loss",
    "DDPFunction",
    "DataParallelStep",
    "DebugLevel",
    "DistributedSampler",
    "GradAccumulator",
    "NNXCommState",
    "NNXDataParallelStep",
    "NNXSyncBatchNorm",
    "ParamUsage",
    "PerDevice",
    "Reduction",
    "Restored",
    "Sharding",
    "StatsSchedule",
    "SyncBatchNorm",
    "TrainState",
    "TuneResult",
    "__version__",
    "bucket_report",
    "backends",
    "bucketing",
    "check_consistent",
    "collective_stats",
    "collectives",
    "convert_sync_batchnorm",
    "data_mesh",
    "data_parallel",
    "ddp",
    "debug_level",
    "describe",
    "find_unused_parameters",
    "format_info",
    "grad_accumulator",
    "grain_shard_options",
    "hooks",
    "info",
    "init",
    "join",
    "local_rank",
    "local_world_size",
    "loop_collectives",
    "nnx_train_step",
    "pad_batch",
    "plan_buckets",
    "process_count",
    "process_index",
    "reached_preemption",
    "reduce_gradients",
    "replicate",
    "runtime",
    "set_debug_level",
    "shard_batch",
    "sync_batchnorm",
    "train_step",
    "tune",
]
