"""Saving and restoring the whole train state with Orbax, from one process or many."""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.restore` returns.

    Attributes:
      state: the train state, placed like the template's leaves.
      data_position: the JSON value saved with it (``{}`` if none was).
      step: the step it was saved at.
    """

    state: Any
    data_position: Any
    step: int


def _abstract(leaf: Any) -> Any:
    # Orbax restores each array onto the sharding of the template's leaf: a
    # replicated state comes back replicated, a sharded one sharded.
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints of a train state in ``directory``.

    A thin layer over ``orbax.checkpoint.CheckpointManager``. A checkpoint holds
    the whole state pytree (parameters, optimizer state, step, and any other
    fields such as a comm hook's state) and a JSON ``data_position`` (where the
    data loader was, e.g. ``{"epoch": 2, "batch": 5}``), so that a resumed run
    continues exactly where the saved one was. With several processes every
    process must call :meth:`save` and :meth:`restore` with its view of the same
    global state; Orbax writes each array's shards from the processes that hold
    them and finalises the checkpoint once all have written, so a checkpoint
    that a killed run left half-written is never listed or restored.

    Args:
      directory: where checkpoints go (one subdirectory per step).
      max_to_keep: how many of the newest checkpoints to keep (``None``: all).
      async_save: write in a background thread (call
        :meth:`wait_until_finished` before relying on the files).

    Example:
      >>> import tempfile, jax.numpy as jnp, fdp
      >>> ckpt = fdp.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
      >>> state = fdp.replicate({"w": jnp.arange(3.0), "step": jnp.int32(0)})
      >>> for step in (1, 2, 3):
      ...     ckpt.save(step, state, data_position={"epoch": 0, "batch": step})
      >>> ckpt.all_steps()
      [2, 3]
      >>> restored = ckpt.restore(state)
      >>> restored.step, restored.data_position, restored.state["w"].sharding.is_fully_replicated
      (3, {'epoch': 0, 'batch': 3}, True)
    """

    def __init__(
        self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = False
    ):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(
                f"max_to_keep must be a positive int or None, got max_to_keep={max_to_keep!r}."
            )
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            # Half-written checkpoints of a killed run are removed on the next start.
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data_position")
        )

    def save(self, step: int, state: Any, *, data_position: Any = None) -> None:
        """Saves ``state`` (and ``data_position``) as checkpoint ``step``.

        Args:
          step: the step number; must be new in this directory.
          state: the train state pytree (``jax.Array`` s, numpy arrays, scalars).
          data_position: a JSON-serialisable value saying where the data was.

        Raises:
          TypeError: ``data_position`` is not JSON-serialisable.
          ValueError: ``step`` is not a non-negative int.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got step={step!r}.")
        position = {} if data_position is None else data_position
        try:
            json.dumps(position)
        except TypeError as e:
            raise TypeError(f"data_position must be JSON-serialisable: {e}.") from None
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data_position=ocp.args.JsonSave(position)
            ),
        )

    def restore(self, template: Any, *, step: int | None = None) -> Restored:
        """Restores checkpoint ``step`` (default: the latest) into ``template``'s structure.

        Args:
          template: a state with the saved structure, shapes and dtypes, for
            example the freshly initialised and replicated one. Each restored
            ``jax.Array`` gets the sharding of the template's leaf.
          step: the checkpoint to restore.

        Returns:
          ``Restored(state, data_position, step)``.

        Raises:
          FileNotFoundError: there is no checkpoint (or none at ``step``).
        """
        if step is None:
            step = self.latest_step()
        if step is None or step not in self.all_steps():
            which = "no checkpoint" if step is None else f"no checkpoint for step={step}"
            raise FileNotFoundError(
                f"{which} in {self.directory} (steps there: {self.all_steps()})."
            )
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.tree.map(_abstract, template)),
                data_position=ocp.args.JsonRestore(),
            ),
        )
        return Restored(out["state"], out["data_position"], step)

    def latest_step(self) -> int | None:
        """The newest saved step, or ``None`` if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every saved step, oldest first."""
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until a background save (``async_save=True``) is written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and releases Orbax's resources."""
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
