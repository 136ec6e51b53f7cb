"""Uneven inputs: padding with masks, and DDP's ``Join`` for data that runs out.

DDP's ``Join`` lets ranks that run out of batches shadow the collectives of the
others. In JAX every participant runs the same compiled step, so a participant
that is out of data keeps stepping with a zero-weight batch until every
participant is done; with per-example losses (``per_example=True``) the average
then counts only real examples.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from fdp.data._rows import leading_size, pad_rows


def pad_batch(batch: Any, size: int) -> tuple[Any, np.ndarray]:
    """Pads a batch along its leading axis to ``size`` rows, with a mask of real rows.

    Padding repeats the last row (an empty batch is padded with zeros), so a
    loss of the padding stays finite; the mask gives it zero weight.

    Args:
      batch: a pytree of arrays with a common leading size ``<= size``.
      size: the padded size.

    Returns:
      ``(padded_batch, mask)``, ``mask`` float32 ``[size]``.

    Example:
      >>> b, m = pad_batch({"x": np.arange(3.0)}, 5)
      >>> b["x"].tolist(), m.tolist()
      ([0.0, 1.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 0.0, 0.0])
    """
    n = leading_size(batch) or 0
    if n > size:
        raise ValueError(f"the batch has {n} rows, more than size={size}.")
    mask = np.zeros(size, np.float32)
    mask[:n] = 1.0
    return pad_rows(batch, size, xp=np), mask


def _exchange(any_done: bool, all_done: bool) -> np.ndarray:
    """``[[any_done, all_done], ...]`` of every process (one all-gather per step)."""
    flags = np.array([any_done, all_done], np.int32)
    if jax.process_count() == 1:
        return flags[None].astype(bool)
    gathered = multihost_utils.process_allgather(flags)
    return np.asarray(gathered).reshape(-1, 2).astype(bool)


def join(
    *iterables: Iterable[Any],
    batch_size: int,
    like: Any = None,
    throw_on_early_termination: bool = False,
) -> Iterator[tuple[Any, np.ndarray]]:
    """Batches of participants that may run out at different times (DDP's ``Join``).

    Each positional argument is one participant's iterable of batches (for
    example one per local device, or one for the whole process). Every step
    yields their batches, each padded to ``batch_size`` rows, concatenated in
    order, with the mask of real rows. A participant that is out of data
    contributes a zero-weight batch, until every participant (of every
    process) is out. Feed the pair to a step built with ``per_example=True``::

        for batch, mask in fdp.join(*device_batches, batch_size=8):
            state, metrics = step(state, fdp.shard_batch(batch), mask=fdp.shard_batch(mask))

    Args:
      *iterables: one iterable of batches per participant.
      batch_size: rows per participant per step (each batch has at most this).
      like: a batch to shape the zero-weight batches after; default: the first
        batch seen (a participant empty from the start needs ``like``).
      throw_on_early_termination: raise on every process as soon as any
        participant is out of data while another is not (DDP's option),
        instead of padding.

    Yields:
      ``(batch, mask)`` for every step until all participants are done.

    Raises:
      RuntimeError: with ``throw_on_early_termination``, naming the participants
        (this process's) that ran out and the step.
    """
    if not iterables:
        raise ValueError("join needs at least one iterable of batches.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    iterators = [iter(it) for it in iterables]
    step = 0
    while True:
        batches = [next(it, None) for it in iterators]
        local_done = [b is None for b in batches]
        flags = _exchange(any(local_done), all(local_done))
        if flags[:, 1].all():
            return
        if throw_on_early_termination and flags[:, 0].any():
            out = [i for i, d in enumerate(local_done) if d]
            procs = [p for p, f in enumerate(flags) if f[0]]
            raise RuntimeError(
                f"join: at step {step} participants ran out of data while others had more "
                f"(processes {procs}; on this process, participants {out}); "
                "throw_on_early_termination=True stops every process here."
            )
        like = like if like is not None else next((b for b in batches if b is not None), None)
        if like is None:
            raise ValueError(
                "join: this process's participants are all out of data before any batch "
                "was seen; pass like= (one batch) to shape the zero-weight batches."
            )
        parts = [
            pad_batch(
                jax.tree.map(lambda x: np.asarray(x)[:0], like) if b is None else b, batch_size
            )
            for b in batches
        ]
        batch = jax.tree.map(lambda *xs: np.concatenate(xs), *[p[0] for p in parts])
        yield batch, np.concatenate([p[1] for p in parts])
        step += 1
