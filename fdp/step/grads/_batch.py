"""The step's batch: checked on the host before the step runs, padded and sharded inside it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fdp.data._placement import constrain_to
from fdp.data._rows import leading_size, pad_rows
from fdp.step.options._config import StepConfig

# The weight of the rows the step itself pads a per-example batch with, in the mask
# it places: like a zero weight they are no example, and unlike one they tell the
# devices that hold only such rows (no part of the caller's batch) from devices whose
# rows the caller weighed zero (out of data under fdp.join), which torch's Join counts.
STEP_PADDING = -1.0


def split_mask(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A placed mask as ``(weights, holds_rows)``.

    ``weights`` is the mask with the step's padding at zero; ``holds_rows`` is
    whether any row is part of the caller's batch.
    """
    return jnp.maximum(mask, 0.0), jnp.any(mask != STEP_PADDING)


def batch_rows(batch: Any, mask: Any, cfg: StepConfig) -> int:
    """The rows the step runs on: the batch's size, padded up to a whole split if allowed.

    A batch splits into one share per device and ``accumulate_steps``
    micro-batches per share. With ``per_example=True`` a batch that does not
    split evenly is zero-weighted padding away from one that does
    (DataParallel's uneven scatter); otherwise it is an error. Only shapes are
    read, so this runs before anything is traced.

    Raises:
      ValueError: a leaf is a scalar, leading sizes differ, the batch has no
        rows or does not split, or ``mask`` is given wrongly.
    """
    split = cfg.num_replicas * cfg.accumulate_steps
    size = leading_size(batch, "batch")
    if size is None:
        raise ValueError("batch must hold at least one array, got an empty pytree.")
    if size == 0:
        # The mean loss of no examples is NaN, and the step would silently not learn.
        path, leaf = jax.tree_util.tree_flatten_with_path(batch)[0][0]
        raise ValueError(
            f"batch has no rows: leaf {jax.tree_util.keystr(path) or 'batch'} has shape "
            f"{tuple(jnp.shape(leaf))}; a step needs at least one example (skip empty batches)."
        )
    if mask is not None and not cfg.per_example:
        raise ValueError(
            "mask= weighs examples and needs per_example=True (a loss_fn returning one "
            "loss per example)."
        )
    if cfg.per_example:
        if mask is not None and jnp.shape(mask) != (size,):
            raise ValueError(
                f"mask must have shape ({size},) like the batch, got {jnp.shape(mask)}."
            )
        return size + (-size % split)
    if size % split:
        path, leaf = jax.tree_util.tree_flatten_with_path(batch)[0][0]
        what = f"the {cfg.num_replicas} devices of axis {cfg.axis_name!r}" + (
            f" times {cfg.accumulate_steps} micro-batches" if cfg.accumulate_steps > 1 else ""
        )
        raise ValueError(
            f"batch leaf {jax.tree_util.keystr(path) or 'batch'} has shape "
            f"{tuple(jnp.shape(leaf))}; its leading (batch) size must be divisible by {what} "
            f"({split}). Use a multiple of {split}, or per_example=True to pad and mask an "
            "uneven batch."
        )
    return size


def local_batch_struct(batch: Any, rows: int, cfg: StepConfig) -> Any:
    """One micro-batch of one device, as ``jax.ShapeDtypeStruct`` s."""
    local = rows // (cfg.num_replicas * cfg.accumulate_steps)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((local, *jnp.shape(x)[1:]), jnp.result_type(x)), batch
    )


def _place(tree: Any, cfg: StepConfig) -> Any:
    return constrain_to(tree, NamedSharding(cfg.bound_mesh, P(cfg.axis_name)))


def place_batch(batch: Any, mask: Any, rows: int, cfg: StepConfig) -> tuple[Any, Any]:
    """Inside the step: the batch (and mask) padded to ``rows`` and sharded over the data axis.

    Returns:
      ``(batch, mask)``; ``mask`` is float32 ``[rows]`` in per-example mode
      (``STEP_PADDING`` for the rows padded here: see :func:`split_mask`), else
      None.
    """
    if not cfg.per_example:
        return _place(batch, cfg), None
    size = leading_size(batch) or 0
    mask = jnp.ones((size,), jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
    mask = jnp.pad(mask, (0, rows - size), constant_values=STEP_PADDING)
    return _place(pad_rows(batch, rows), cfg), _place(mask, cfg)
