"""``fdp launch``: start and supervise the worker processes of a run on one host.

``fdp launch --nproc-per-node 2 train.py ...`` (or ``python -m fdp.launch``) is
fdp's torchrun; see docs/multihost.md.
"""

from fdp.launch._agent import launch as launch
from fdp.launch._cli import main as main
from fdp.launch._config import LaunchConfig as LaunchConfig

__all__ = ["LaunchConfig", "launch", "main"]
