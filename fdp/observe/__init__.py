"""Observability: debug levels, logging data, runtime stats, DETAIL checks, reports.

The GPU compile tier lives here too: :func:`gpu_mesh` compiles a step for GPUs on a
machine without one, and :func:`read_schedule` reads the overlap of its program.
"""

from fdp.observe._gpu import GPU_TARGETS as GPU_TARGETS
from fdp.observe._gpu import GpuTarget as GpuTarget
from fdp.observe._gpu import gpu_compiler_status as gpu_compiler_status
from fdp.observe._gpu import gpu_mesh as gpu_mesh
from fdp.observe._gpu import install_compiler as install_compiler
from fdp.observe._gpu_report import gpu_program_report as gpu_program_report
from fdp.observe._schedule import Schedule as Schedule
from fdp.observe._schedule import ScheduledCollective as ScheduledCollective
from fdp.observe._schedule import read_schedule as read_schedule

__all__ = [
    "GPU_TARGETS",
    "GpuTarget",
    "Schedule",
    "ScheduledCollective",
    "gpu_compiler_status",
    "gpu_mesh",
    "gpu_program_report",
    "install_compiler",
    "read_schedule",
]
