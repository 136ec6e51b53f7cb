"""Saving and restoring the whole train state with Orbax, from one process or many."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, NamedTuple

import jax

from fdp.runtime import _ckpt_files, _ckpt_legacy, _ckpt_tree
from fdp.runtime._heartbeat import busy
from fdp.runtime._host import barrier, broadcast_object

_log = logging.getLogger("fdp.checkpoint")


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.restore` returns.

    Attributes:
      state: the train state, placed like the template's leaves (for NNX
        objects: the same objects, updated in place).
      data_position: the JSON value saved with it (``{}`` if none was).
      step: the step it was saved at.
    """

    state: Any
    data_position: Any
    step: int


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's files do not match the checksums written when it was saved."""


def _abstract(leaf: Any) -> Any:
    # Orbax restores each array onto the sharding of the template's leaf: a
    # replicated state comes back replicated, a sharded one sharded.
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints of a train state in ``directory``.

    A layer over ``orbax.checkpoint.CheckpointManager``. A checkpoint holds
    the whole state pytree (parameters, optimizer state, step, and any other
    fields such as a comm hook's state) and a JSON ``data_position`` (where the
    data loader was, e.g. ``{"epoch": 2, "batch": 5}``), so that a resumed run
    continues exactly where the saved one was. For Flax NNX pass the objects
    themselves, ``save(step, (model, optimizer))`` and
    ``restore((model, optimizer))``: both are saved whole (parameters,
    buffers, RNG state, optimizer state) and restored in place; with a
    stateful comm hook, its :class:`fdp.NNXCommState` too, ``(model,
    optimizer, comm_state)``.
    With a grain data pipeline (see docs/data.md), pass its
    iterator as ``save(..., data_iterator=it)`` and ``restore(...,
    data_iterator=it)``: each process's iterator state is saved in the same
    checkpoint (with grain's own Orbax handler) and set back on restore, so the
    resumed run reads the rest of the epoch, each example once.

    A save is never dropped: saving a step at or below the newest one in the
    directory raises unless ``overwrite=True`` (then that step and every newer
    one are deleted first: a run restarted from scratch replaces the old run's
    future). Orbax writes each checkpoint to a temporary directory and renames it
    when every process has written its part, so a writer killed half-way
    leaves nothing that is listed; fdp then records every file's SHA-256, and
    :meth:`restore` checks them. A checkpoint is complete once its checksums
    are written, and the oldest one is deleted only after that, so a writer
    killed at any moment leaves ``max_to_keep`` complete checkpoints or the
    step it was saving whole. A damaged checkpoint (a flipped bit, a cut file,
    a deleted file) is never loaded: the newest intact one is, with a warning
    naming the bad one, which is moved aside to ``<step>.fdp-corrupt``.

    With several processes every process must call :meth:`save` and
    :meth:`restore` with its view of the same global state; Orbax writes each
    array's shards from the processes that hold them. Process 0 writes and
    checks the checksums, so the directory must be one every process sees.

    Args:
      directory: where checkpoints go (one subdirectory per step).
      max_to_keep: how many of the newest checkpoints to keep (``None``: all).
      async_save: write in a background thread (the default): :meth:`save`
        returns once the arrays are copied to host memory, and training goes on
        while they are written. The next save, :meth:`restore`,
        :meth:`all_steps` and :meth:`close` wait for it.

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
      >>> ckpt.close()
    """

    def __init__(
        self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = True
    ):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(
                f"max_to_keep must be a positive int or None, got max_to_keep={max_to_keep!r}."
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.async_save = bool(async_save)
        self._max_to_keep = max_to_keep
        import orbax.checkpoint as ocp  # here, not at the top: `import fdp` stays cheap

        options = ocp.CheckpointManagerOptions(
            # fdp deletes old steps itself (_complete): Orbax would delete them as
            # soon as it has published the new step, before fdp has checksummed it,
            # and a writer killed in between would leave no complete step at all.
            # Checksumming before Orbax publishes is not possible from outside:
            # Orbax writes into the step while renaming it into place (a commit
            # file, the commit time), and a synchronous save offers no hook
            # between its finalisation and that rename.
            max_to_keep=None,
            enable_async_checkpointing=self.async_save,
            # Half-written checkpoints of a killed run are removed on the next start.
            cleanup_tmp_directories=True,
        )
        # Handlers named up front, so that the saved tree's metadata can be read
        # before a restore (to name the leaves a template gets wrong).
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data_position": ocp.JsonCheckpointHandler(),
        }
        from fdp.data import _grain  # (the module imports grain only when it is used)

        if _grain.available():  # grain is optional; its handler saves data_iterator=
            handlers[_grain.ITEM] = _grain.handler()
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        # Steps that process 0 deletes once the newest one is complete. Every
        # process drops them from its listing, without reading the directory
        # while process 0 may be deleting in it.
        self._retiring: list[int] = []
        self._retired: set[int] = set()

    def _steps(self) -> list[int]:
        return sorted(s for s in self._manager.all_steps() if s not in self._retired)

    def step_dir(self, step: int) -> str:
        """The directory of checkpoint ``step``."""
        return os.path.join(self.directory, str(step))

    @busy()  # for fdp launch: a checkpoint is a pause between steps, not a hang
    def save(
        self,
        step: int,
        state: Any,
        *,
        data_position: Any = None,
        overwrite: bool = False,
        data_iterator: Any = None,
    ) -> None:
        """Saves ``state`` (and ``data_position``, ``data_iterator``) as checkpoint ``step``.

        Args:
          step: the step number; must be above every step in the directory
            (unless ``overwrite``).
          state: the train state pytree (``jax.Array`` s, numpy arrays,
            scalars), or Flax NNX objects such as ``(model, optimizer)``.
          data_position: a JSON-serialisable value saying where the data was
            (e.g. :meth:`fdp.DistributedSampler.position`).
          overwrite: delete checkpoint ``step`` and every newer one first.
          data_iterator: a grain iterator (``iter(grain.DataLoader(...))`` or
            a grain dataset's iterator); its state now, after the batches
            already taken from it, is saved by every process for itself.

        Raises:
          ImportError: ``data_iterator`` is given and grain is not installed.
          TypeError: ``data_position`` is not JSON-serialisable;
            ``data_iterator`` is not a grain iterator.
          ValueError: ``step`` is not a non-negative int; ``step`` is not above
            the newest saved step and ``overwrite`` is False; ``state`` is an
            NNX optimizer's state without its model.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got step={step!r}.")
        position = {} if data_position is None else data_position
        try:
            json.dumps(position)
        except TypeError as e:
            raise TypeError(f"data_position must be JSON-serialisable: {e}.") from None
        import orbax.checkpoint as ocp  # imported by __init__ already

        from fdp.data import _grain

        _ckpt_tree.refuse_optimizer_alone(state)
        tree = _ckpt_tree.to_tree(state) if _ckpt_tree.has_nnx(state) else state
        items = {
            "state": ocp.args.StandardSave(tree),
            "data_position": ocp.args.JsonSave(position),
        }
        if data_iterator is not None:
            items[_grain.ITEM] = _grain.save_args(data_iterator)
        self._finish_writes()
        steps = self._steps()
        in_the_way = [s for s in steps if s >= step]
        if in_the_way and not overwrite:
            raise ValueError(
                f"cannot save step={step}: the newest checkpoint in {self.directory} is step "
                f"{max(in_the_way)}, and a save at or below it would be lost or replace it. "
                "Resume from it (ckpt.restore(...)) and save later steps, save to a new "
                f"directory, or pass overwrite=True to delete steps {sorted(in_the_way)} first."
            )
        if step in self._retired:
            # Orbax still lists it (process 0 deleted it behind Orbax's back): read
            # the directory again once process 0 is past its deletions.
            barrier(purpose="CheckpointManager.save, after process 0 deleted old steps")
            self._manager.reload()
            self._retired.clear()
        for s in sorted(in_the_way):
            self._manager.delete(s)
        kept = [s for s in steps if s < step] + [step]
        self._retiring = kept[: -self._max_to_keep] if self._max_to_keep else []
        if jax.process_index() == 0:
            # Before Orbax writes anything: a step it publishes without checksums
            # is then known to be this one, cut off before fdp checksummed it.
            _ckpt_files.mark_pending(self.directory, step)
        try:
            # grain's handler writes the iterator's state in this call, not in
            # the background: the batches taken after it are not in the checkpoint.
            saved = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
            if not saved:  # never expected with force=True; a dropped save must not be silent
                raise RuntimeError(f"orbax did not save step={step} in {self.directory}.")
            if self.async_save:
                self._writer = threading.Thread(
                    target=self._complete_when_written, args=(step, self._retiring), daemon=True
                )
                self._writer.start()
            else:
                self._complete(step, self._retiring)
        except BaseException:
            # Nothing was deleted: the older steps stay listed (and restorable).
            self._retiring = []
            self._forget_unwritten()
            raise

    def _complete(self, step: int, retiring: list[int]) -> None:
        """Checksums ``step`` once Orbax has published it, then deletes the old steps.

        In this order, so that a process killed at any point leaves either the old
        complete steps or the new one whole (restore finishes it, see _choose). It
        runs after Orbax's own finalisation, which on every process waits until
        all processes have written their parts, so process 0 alone does it.
        """
        if jax.process_index() != 0:
            return
        _ckpt_files.write_manifest(self.step_dir(step))
        _ckpt_files.clear_pending(self.directory, step)
        for s in retiring:
            _ckpt_files.remove(self.step_dir(s))
        _ckpt_files.remove_leftovers(self.directory)

    @busy()
    def _complete_when_written(self, step: int, retiring: list[int]) -> None:
        try:
            self._manager.wait_until_finished()
            self._complete(step, retiring)
        except BaseException as e:  # raised in the caller's thread by _finish_writes
            self._writer_error = e

    @busy()
    def _finish_writes(self) -> None:
        """Waits for a background save and its checksums; raises what went wrong in it.

        A failure is raised once: the writer's error is taken before Orbax is
        waited for again (which may raise the same failure a second time).
        """
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._writer_error = self._writer_error, None
        try:
            self._manager.wait_until_finished()
        except BaseException as e:
            error = error or e
        if error is not None:
            self._retiring = []  # not deleted: the new step is not complete
            self._forget_unwritten()
            raise RuntimeError(f"a background checkpoint save failed: {error}") from error
        self._retired.update(self._retiring)
        self._retiring = []

    def _forget_unwritten(self, steps: list[int] | None = None) -> None:
        """Clears the pending mark if it names a step Orbax never published (process 0).

        A save that failed (a full disk) or was killed before Orbax published its
        step leaves nothing to finish: the mark would name a step that does not
        exist. A published step keeps its mark, so that a restore checksums it
        (:meth:`_finish_cut_off`).

        Args:
          steps: the listed steps, if the caller has them.
        """
        if jax.process_index() != 0:
            return
        pending = _ckpt_files.pending_step(self.directory)
        if pending is not None and pending not in (self._steps() if steps is None else steps):
            _ckpt_files.clear_pending(self.directory, pending)

    def _finish_cut_off(self, step: int, older: list[int]) -> bool:
        """Checksums ``step`` now if its save was cut off between Orbax and fdp.

        Orbax lists a step only once every process has written it (it publishes
        a step by renaming it into place), so a listed step without checksums
        is whole unless someone removed its checksums file. It is taken as
        whole, checksummed and restored, when the pending mark names it (the
        writer was killed after Orbax published it, before fdp checksummed it)
        or when no older step is left (what an fdp without the pending mark
        left: it let Orbax delete the step before). Otherwise, with no mark
        and an older complete step to fall back on, it is treated as damaged.
        """
        step_dir = self.step_dir(step)
        if _ckpt_files.has_manifest(step_dir):
            return False
        if step != _ckpt_files.pending_step(self.directory) and older:
            return False
        _ckpt_files.write_manifest(step_dir)
        _ckpt_files.clear_pending(self.directory, step)
        return True

    def _choose(self, step: int | None) -> dict[str, Any]:
        """Process 0's verdict: the step to restore, the damaged newer ones, or an error."""
        steps = sorted(self._steps(), reverse=True)
        self._forget_unwritten(steps)
        if step is not None:
            if step not in steps:
                return {"error": "missing", "step": step, "steps": sorted(steps)}
            finished = self._finish_cut_off(step, [s for s in steps if s < step])
            why = _ckpt_files.check(self.step_dir(step))
            if why is None:
                return {"step": step, "bad": [], "finished": finished}
            return {"error": "corrupt", "step": step, "bad": [[step, why]], "steps": sorted(steps)}
        bad = []
        for i, s in enumerate(steps):
            finished = self._finish_cut_off(s, steps[i + 1 :])
            why = _ckpt_files.check(self.step_dir(s))
            if why is None:
                return {"step": s, "bad": bad, "finished": finished}
            bad.append([s, why])
        return {"error": "corrupt" if bad else "missing", "step": None, "bad": bad, "steps": []}

    def _raise(self, verdict: dict[str, Any]) -> None:
        step, steps = verdict["step"], verdict["steps"]
        if verdict["error"] == "missing":
            which = "no checkpoint" if step is None else f"no checkpoint for step={step}"
            raise FileNotFoundError(f"{which} in {self.directory} (steps there: {steps}).")
        damaged = "; ".join(f"{self.step_dir(s)}: {why}" for s, why in verdict["bad"])
        others = [s for s in steps if s != step]
        if step is None:
            # Moved aside, so that a restarted run (--max-restarts) starts afresh
            # instead of failing here again on every attempt.
            fix = (
                f"They were moved to <step>{_ckpt_files.CORRUPT_SUFFIX}, so the next start "
                "finds no checkpoint and trains from the beginning; to keep them out of "
                "the way of this run, start it in a new directory"
            )
        elif others:
            fix = f"Restore an older step (step=... of {others})"
        else:
            fix = "Start afresh in a new directory (or delete this step)"
        raise CorruptCheckpointError(
            f"cannot restore {'any checkpoint' if step is None else f'step={step}'} from "
            f"{self.directory}: {damaged}. Nothing was loaded. {fix}."
        )

    @busy()
    def restore(
        self, template: Any, *, step: int | None = None, data_iterator: Any = None
    ) -> Restored:
        """Restores checkpoint ``step`` (default: the newest intact one) into ``template``.

        Without ``step``, a newer checkpoint whose files fail their checksums
        is skipped with a warning naming it, and moved aside to
        ``<step>.fdp-corrupt`` so that the resumed run can save that step
        again. A step that Orbax published whole but whose writer was killed
        before fdp recorded its checksums is checksummed then and restored.

        Args:
          template: a state with the saved structure, shapes and dtypes, for
            example the freshly initialised and replicated one; each restored
            ``jax.Array`` gets the sharding of the template's leaf (so a state
            saved on 8 devices restores onto a mesh of 4). For NNX, the objects
            saved, e.g. ``(model, optimizer)``: they are updated in place.
            ``(model, optimizer, comm_state)`` (``comm_state =
            step.init(model, optimizer)``) also restores a checkpoint of fdp
            0.1, which kept a comm hook's state on the optimizer: it is moved
            into ``comm_state``.
          step: the checkpoint to restore.
          data_iterator: a grain iterator of the same pipeline as the one
            saved (data source, sampler and its shard options,
            ``worker_count``), on the same number of processes: its state is
            set to the saved one, before the train state is loaded.

        Returns:
          ``Restored(state, data_position, step)``.

        Raises:
          FileNotFoundError: there is no checkpoint (or none at ``step``).
          CorruptCheckpointError: ``step``'s files, or every checkpoint's,
            fail their checksums (in the latter case they are moved aside too,
            so that a restarted run starts afresh rather than failing again).
          ValueError: ``template`` differs from the checkpoint in a leaf's path,
            shape or dtype (every such leaf is named); ``data_iterator`` is
            given and the checkpoint holds no iterator state, or one saved by
            another number of processes; grain refuses the saved state (another
            pipeline).
          ImportError: ``data_iterator`` is given and grain is not installed.
          TypeError: ``data_iterator`` is not a grain iterator.
        """
        from fdp.data import _grain

        if data_iterator is not None:
            _grain.check_iterator(data_iterator)
        self._finish_writes()
        verdict = self._choose(step) if jax.process_index() == 0 else None
        verdict = broadcast_object(verdict, purpose="CheckpointManager.restore's choice of step")
        if "error" in verdict:
            if verdict["error"] == "corrupt" and step is None:
                self._move_aside([s for s, _ in verdict["bad"]])
            self._raise(verdict)
        if verdict["finished"]:
            _log.warning(
                "fdp.CheckpointManager: checkpoint step=%d in %s was saved whole, but the "
                "process writing it stopped before fdp recorded its checksums; recorded them "
                "now and restoring it.",
                verdict["step"],
                self.directory,
            )
        if verdict["bad"]:
            self._move_aside([s for s, _ in verdict["bad"]])
            for s, why in verdict["bad"]:
                _log.warning(
                    "fdp.CheckpointManager: checkpoint step=%d in %s is damaged (%s); moved it "
                    "to %s and restoring step=%d instead.",
                    s,
                    self.directory,
                    why,
                    self.step_dir(s) + _ckpt_files.CORRUPT_SUFFIX,
                    verdict["step"],
                )
        return self._restore(template, verdict["step"], data_iterator)

    def _move_aside(self, steps: list[int]) -> None:
        if jax.process_index() == 0:
            for s in steps:
                _ckpt_files.move_aside(self.step_dir(s))
        barrier(purpose="CheckpointManager.restore, after moving damaged steps aside")
        self._manager.reload()
        self._retired.clear()

    def _check_iterator_state(self, step: int) -> None:
        """Raises unless ``step`` holds a grain iterator state for each of this run's processes."""
        from fdp.data import _grain

        saved = _grain.saved_states(self.step_dir(step))
        if not saved:
            raise ValueError(
                f"checkpoint step={step} in {self.directory} holds no data iterator state: it "
                "was saved without data_iterator=. Restore it without data_iterator= and "
                "position the data yourself (data_position), or restore a step saved with it."
            )
        if len(saved) != jax.process_count():
            # grain keeps one state per process (its DataLoader's holds the shard
            # options too), so a state is only ever set on the process that saved it.
            raise ValueError(
                f"checkpoint step={step} in {self.directory} holds the data iterator states "
                f"of {len(saved)} process(es) ({', '.join(saved)}), and this run has "
                f"{jax.process_count()}: grain restores an iterator's state only on the "
                "process, and into the shard, that saved it. Resume with "
                f"{len(saved)} process(es), or restore without data_iterator= and start the "
                "data afresh (grain.experimental.ElasticIterator's state is the same on "
                "every process: save it as data_position=it.get_state() to resume it on "
                "another number of processes)."
            )

    def _restore_iterator(self, iterator: Any, step: int) -> None:
        """Sets ``iterator`` to the state this process saved in ``step`` (grain's handler)."""
        import orbax.checkpoint as ocp  # imported by __init__ already

        from fdp.data import _grain

        try:
            self._manager.restore(
                step, args=ocp.args.Composite(**{_grain.ITEM: _grain.restore_args(iterator)})
            )
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = os.path.join(self.step_dir(step), _grain.ITEM)
            raise ValueError(
                f"could not set data_iterator to its state in checkpoint step={step} "
                f"({where}): {first}. grain sets a state only on an iterator of the same "
                "pipeline: the same data source, sampler (with its shard options) and "
                "worker_count as the one saved. Nothing was loaded."
            ) from e

    def _restore(self, template: Any, step: int, data_iterator: Any) -> Restored:
        import orbax.checkpoint as ocp  # imported by __init__ already

        # fdp's checks come before anything is set or loaded; grain's own (the same
        # pipeline?) when it sets the iterator, before the arrays are loaded.
        if data_iterator is not None:
            self._check_iterator_state(step)
        is_nnx = _ckpt_tree.has_nnx(template)
        tree = _ckpt_tree.to_tree(template) if is_nnx else template
        saved = self._manager.item_metadata(step)["state"]
        # fdp 0.1 saved an NNX comm hook's state on the optimizer: read it in that layout.
        legacy = _ckpt_legacy.legacy_layout(template, saved) if is_nnx else None
        if legacy is not None:
            tree = _ckpt_legacy.legacy_tree(legacy)
        problems = _ckpt_tree.differences(tree, saved)
        if problems:
            raise ValueError(_ckpt_tree.mismatch_message(problems, step, self.step_dir(step)))
        if data_iterator is not None:  # first, as grain advises: it then prefetches
            self._restore_iterator(data_iterator, step)
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    # Optimizer-state leaves padded for another device count (ZeRO):
                    # orbax pads or cuts their ends; every other shape matched above.
                    state=ocp.args.StandardRestore(
                        jax.tree.map(_abstract, tree),
                        strict=not _ckpt_tree.padded_leaves(tree, saved),
                    ),
                    data_position=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(
                f"restoring checkpoint step={step} from {self.step_dir(step)} failed although "
                f"its files match their checksums: {first}. Restore an older step "
                f"(steps there: {self.all_steps()}) or report this."
            ) from e
        state = out["state"]
        if legacy is not None:
            _ckpt_tree.update_nnx(legacy.template, _ckpt_legacy.move_restored(legacy, state))
            state = template
        elif is_nnx:
            _ckpt_tree.update_nnx(template, state)
            state = template
        return Restored(state, out["data_position"], step)

    def latest_step(self) -> int | None:
        """The newest saved step, or ``None`` if there is none (waits for a background save)."""
        self._finish_writes()
        steps = self._steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Every saved step, oldest first (waits for a background save)."""
        self._finish_writes()
        return self._steps()

    def wait_until_finished(self) -> None:
        """Blocks until a background save is written and its checksums recorded."""
        self._finish_writes()

    def close(self) -> None:
        """Finishes pending saves and releases Orbax's resources."""
        try:
            self._finish_writes()
        finally:
            self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
