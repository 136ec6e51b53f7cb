"""grain data pipelines: each process's shard, and the iterator state in fdp's checkpoints.

grain (``pip install 'fdp[grain]'``) is optional: nothing here imports it until
it is used, so fdp works without it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import jax

INSTALL_HINT = "pip install grain (or pip install 'fdp[grain]')"
# Where a checkpoint step keeps the grain iterator's state (an Orbax item name).
ITEM = "data_iterator"
# The launcher variables that say how many processes the run has, before fdp.init().
_WORLD_SIZE_VARIABLES = ("FDP_NUM_PROCESSES", "WORLD_SIZE")


def available() -> bool:
    """Whether grain can be imported (without importing it)."""
    return importlib.util.find_spec("grain") is not None


def _grain() -> Any:
    try:
        import grain
    except ImportError as e:
        raise ImportError(f"fdp's grain support needs grain: {INSTALL_HINT}. ({e})") from e
    return grain


def _expected_processes() -> int | None:
    for name in _WORLD_SIZE_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def grain_shard_options(*, drop_remainder: bool = False) -> Any:
    """Grain's shard options for this process: shard ``process_index()`` of ``process_count()``.

    It returns grain's own ``grain.sharding.ShardByJaxProcess``, for
    ``grain.samplers.IndexSampler(shard_options=...)`` or
    ``grain.DataLoader(shard_options=...)``: each process reads its own part
    of every epoch and feeds its local batch to :func:`fdp.shard_batch`. Call it
    after :func:`fdp.init`; under a launcher that asked for several processes
    (``fdp launch``, torchrun) it raises before then, since JAX would answer
    "process 0 of 1" on every process and each would read the whole dataset.

    Args:
      drop_remainder: grain's option: drop the examples that do not divide
        evenly among the processes (every process then reads as many).

    Returns:
      A ``grain.sharding.ShardOptions``.

    Raises:
      ImportError: grain is not installed.
      RuntimeError: the launcher's ``WORLD_SIZE`` (or ``FDP_NUM_PROCESSES``)
        says several processes, and JAX is not yet joined to them.

    Example:
      >>> import fdp
      >>> options = fdp.grain_shard_options()
      >>> options.shard_index, options.shard_count, options.drop_remainder
      (0, 1, False)
    """
    grain = _grain()
    expected = _expected_processes()
    if expected is not None and expected > 1 and not jax.distributed.is_initialized():
        raise RuntimeError(
            f"fdp.grain_shard_options() was called before fdp.init(): this run has "
            f"{expected} processes (WORLD_SIZE/FDP_NUM_PROCESSES), but JAX is not yet "
            "joined to them and would call every process shard 0 of 1, so each would read "
            "the whole dataset. Call fdp.init() first."
        )
    return grain.sharding.ShardByJaxProcess(drop_remainder=drop_remainder)


def check_iterator(iterator: Any) -> None:
    """Raises ``TypeError`` unless ``iterator`` is a grain iterator that can be checkpointed."""
    grain = _grain()
    kinds = (grain.DataLoaderIterator, grain.DatasetIterator)
    if not isinstance(iterator, kinds):
        raise TypeError(
            "data_iterator must be a grain iterator, iter(grain.DataLoader(...)) or "
            "iter(<a grain.MapDataset or IterDataset>), whose state grain's "
            f"CheckpointHandler saves; got {type(iterator).__module__}."
            f"{type(iterator).__qualname__}."
        )


def handler() -> Any:
    """Grain's Orbax handler: each process writes and reads its own iterator's state."""
    return _grain().checkpoint.CheckpointHandler()


def save_args(iterator: Any) -> Any:
    """The Orbax argument that saves ``iterator``'s state (read now, at the save)."""
    check_iterator(iterator)
    return _grain().checkpoint.CheckpointSave(iterator)


def restore_args(iterator: Any) -> Any:
    """The Orbax argument that sets ``iterator``'s state from a checkpoint."""
    check_iterator(iterator)
    return _grain().checkpoint.CheckpointRestore(iterator)


def saved_states(step_dir: str) -> list[str]:
    """The files of grain iterator state in checkpoint ``step_dir`` (one per process)."""
    item_dir = os.path.join(step_dir, ITEM)
    if not os.path.isdir(item_dir):
        return []
    return sorted(n for n in os.listdir(item_dir) if n.endswith(".json"))
