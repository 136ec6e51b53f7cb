"""Comm hooks: what happens to each gradient bucket (DDP's ``ddp_comm_hooks``).

A hook is ``CommHook(name, init, reduce)``: ``init(params, plan)`` builds its state,
``reduce(state, bucket)`` returns the reduced bucket and the new state. See
docs/comm-hooks.md.
"""

from fdp.hooks._basic import allreduce as allreduce
from fdp.hooks._basic import bf16_compress as bf16_compress
from fdp.hooks._basic import bf16_compress_wrapper as bf16_compress_wrapper
from fdp.hooks._basic import fp16_compress as fp16_compress
from fdp.hooks._basic import fp16_compress_wrapper as fp16_compress_wrapper
from fdp.hooks._basic import noop as noop
from fdp.hooks._bucketed import reduce_with_hook as reduce_with_hook
from fdp.hooks._compressed import compressed_allreduce as compressed_allreduce
from fdp.hooks._contract import CommHook as CommHook
from fdp.hooks._contract import GradBucket as GradBucket
from fdp.hooks._contract import with_reduce_scatter as with_reduce_scatter
from fdp.hooks._diloco import DiLoCo as DiLoCo
from fdp.hooks._diloco import diloco as diloco
from fdp.hooks._hierarchical import HierarchicalModelAverager as HierarchicalModelAverager
from fdp.hooks._local_sgd import ModelAverager as ModelAverager
from fdp.hooks._local_sgd import PeriodicModelAverager as PeriodicModelAverager
from fdp.hooks._local_sgd import post_local_sgd as post_local_sgd
from fdp.hooks._powersgd import PowerSGDConfig as PowerSGDConfig
from fdp.hooks._powersgd import batched_powersgd as batched_powersgd
from fdp.hooks._powersgd import powersgd as powersgd
from fdp.hooks._powersgd_stats import PowerSGDCompressionStats as PowerSGDCompressionStats
from fdp.hooks._powersgd_stats import powersgd_compression_stats as powersgd_compression_stats
from fdp.hooks._quantize import quantize_per_channel as quantize_per_channel
from fdp.hooks._quantize import quantize_per_tensor as quantize_per_tensor
from fdp.hooks._registry import HOOKS as HOOKS
from fdp.hooks._registry import resolve as resolve
from fdp.hooks._two_level import hierarchical as hierarchical

__all__ = [
    "HOOKS",
    "CommHook",
    "DiLoCo",
    "GradBucket",
    "HierarchicalModelAverager",
    "ModelAverager",
    "PeriodicModelAverager",
    "PowerSGDCompressionStats",
    "PowerSGDConfig",
    "allreduce",
    "batched_powersgd",
    "bf16_compress",
    "bf16_compress_wrapper",
    "compressed_allreduce",
    "diloco",
    "fp16_compress",
    "fp16_compress_wrapper",
    "hierarchical",
    "noop",
    "post_local_sgd",
    "powersgd",
    "powersgd_compression_stats",
    "quantize_per_channel",
    "quantize_per_tensor",
    "reduce_with_hook",
    "resolve",
    "with_reduce_scatter",
]
