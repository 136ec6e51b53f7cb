"""Each process's share of a dataset: ``torch.utils.data.DistributedSampler``'s rules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import jax
import numpy as np

from fdp._validate import check_int
from fdp.data._randperm import torch_randperm

Permutation = Literal["torch", "numpy"]
PERMUTATIONS = ("torch", "numpy")


class DistributedSampler:
    """The indices of a dataset that one process reads, as DDP's sampler gives them.

    The rules are ``torch.utils.data.DistributedSampler``'s: every epoch the
    indices ``0..dataset_size-1`` are shuffled with ``seed + epoch`` (so all
    processes agree on the order without talking), then either padded by
    repeating indices from the start (``drop_last=False``) or cut
    (``drop_last=True``) to a multiple of ``num_replicas``; process ``rank``
    takes every ``num_replicas``-th index from position ``rank``. Every process
    therefore gets the same number of indices, and so the same number of
    batches. By default the permutation is torch's too (``torch.randperm`` with
    a generator seeded ``seed + epoch``, reproduced in NumPy), so a run moved
    from torch reads the same examples in the same order.

    Args:
      dataset_size: the number of examples.
      num_replicas: the number of readers (default: ``jax.process_count()``,
        each process feeding its local batch to :func:`fdp.shard_batch`).
      rank: this reader's index (default: ``jax.process_index()``).
      shuffle: shuffle every epoch.
      seed: the shuffling seed; must be the same on every process.
      drop_last: drop the tail that does not divide evenly instead of padding.
      permutation: ``'torch'`` (default): torch's shuffled order;
        ``'numpy'``: ``np.random.default_rng(seed + epoch).permutation``, the
        order of fdp before it matched torch.

    Example:
      >>> s = DistributedSampler(10, num_replicas=3, rank=1, shuffle=False)
      >>> list(s), len(s)
      ([1, 4, 7, 0], 4)
      >>> s.set_epoch(1)
      >>> [b.tolist() for b in s.batches(2)]
      [[1, 4], [7, 0]]
      >>> list(DistributedSampler(10, num_replicas=2, rank=0, seed=0))  # as torch's
      [4, 7, 3, 0, 6]
    """

    def __init__(
        self,
        dataset_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        permutation: Permutation = "torch",
    ):
        self.dataset_size = check_int(dataset_size, "dataset_size", low=0)
        replicas = jax.process_count() if num_replicas is None else num_replicas
        self.num_replicas = check_int(replicas, "num_replicas", low=1)
        self.rank = check_int(jax.process_index() if rank is None else rank, "rank", low=0)
        if self.rank >= self.num_replicas:
            raise ValueError(
                f"rank must be in 0..num_replicas-1, got rank={self.rank}, "
                f"num_replicas={self.num_replicas}."
            )
        self.shuffle = bool(shuffle)
        self.seed = check_int(seed, "seed", low=0)
        self.drop_last = bool(drop_last)
        if permutation not in PERMUTATIONS:
            raise ValueError(
                f"permutation must be one of {PERMUTATIONS}, got permutation={permutation!r}."
            )
        self.permutation = permutation
        self.epoch = 0
        self._start = 0  # examples of this epoch's order already read (set_position)

    @property
    def num_samples(self) -> int:
        """Indices this reader gets in the current epoch (what is left of it, after a resume)."""
        return self.total_size // self.num_replicas

    @property
    def total_size(self) -> int:
        """Indices all readers get together in the current epoch, padding included."""
        # torch's sizes: floor(n / r) * r with drop_last, else ceil(n / r) * r.
        n, r = max(self.dataset_size - self._start, 0), self.num_replicas
        return (n // r) * r if self.drop_last else -(-n // r) * r

    def set_epoch(self, epoch: int) -> None:
        """Chooses the epoch, and so the shuffled order (call it before each epoch)."""
        self.epoch = check_int(epoch, "epoch", low=0)
        self._start = 0

    def position(self, batches: int, batch_size: int) -> dict[str, int]:
        """Where the epoch stands after every reader read ``batches`` batches of ``batch_size``.

        A JSON-serialisable value to save with a checkpoint
        (``ckpt.save(step, state, data_position=sampler.position(b, bs))``) and
        to give back to :meth:`set_position` when resuming, with any number of
        readers: it counts the examples of the epoch's order that all readers
        read together, so a run resumed on another world size reads each
        remaining example exactly once.

        Args:
          batches: batches each reader has read since :meth:`set_epoch` (or
            :meth:`set_position`).
          batch_size: indices per batch on each reader.

        Returns:
          ``{"epoch", "consumed", "dataset_size", "seed"}``.

        Example:
          >>> s = DistributedSampler(12, num_replicas=2, rank=0, shuffle=False)
          >>> s.position(2, 2)  # both readers read 2 batches of 2
          {'epoch': 0, 'consumed': 8, 'dataset_size': 12, 'seed': 0}
          >>> one = DistributedSampler(12, num_replicas=1, rank=0, shuffle=False)
          >>> one.set_position(s.position(2, 2))
          >>> list(one)  # the rest of the epoch, on one reader
          [8, 9, 10, 11]
        """
        batches = check_int(batches, "batches", low=0)
        batch_size = check_int(batch_size, "batch_size", low=1)
        consumed = self._start + batches * batch_size * self.num_replicas
        return {
            "epoch": self.epoch,
            "consumed": min(consumed, self.dataset_size),
            "dataset_size": self.dataset_size,
            "seed": self.seed,
        }

    def set_position(self, position: dict[str, int]) -> None:
        """Resumes inside an epoch at a :meth:`position` (saved with any number of readers).

        The rest of that epoch's order is shared among this sampler's readers
        by torch's rules (every ``num_replicas``-th index, padded or cut to an
        equal share); the next :meth:`set_epoch` starts a whole epoch again.

        Raises:
          ValueError: ``position`` is not a :meth:`position` value, or was
            saved for another dataset size or seed (the order would differ).
        """
        keys = {"epoch", "consumed", "dataset_size", "seed"}
        if not isinstance(position, dict) or not keys <= position.keys():
            raise ValueError(
                f"position must be a value of DistributedSampler.position() with keys "
                f"{sorted(keys)}, got position={position!r}."
            )
        for key in ("dataset_size", "seed"):
            if position[key] != getattr(self, key):
                raise ValueError(
                    f"position was saved with {key}={position[key]}, but this sampler has "
                    f"{key}={getattr(self, key)}: the epoch's order would differ, so examples "
                    f"would be skipped or repeated. Build the sampler with {key}={position[key]}."
                )
        self.epoch = check_int(position["epoch"], "position['epoch']", low=0)
        self._start = check_int(position["consumed"], "position['consumed']", low=0)

    def indices(self) -> np.ndarray:
        """This reader's indices for the current epoch, as an ``int64`` array."""
        n = self.dataset_size
        if self.shuffle and self.permutation == "torch":
            order = torch_randperm(n, self.seed + self.epoch)
        elif self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(n)
        else:
            order = np.arange(n)
        order, total = order[self._start :], self.total_size
        if self.drop_last:
            order = order[:total]
        elif total > len(order) and len(order):
            # Pad by repeating from the start, as many times as needed (torch).
            order = np.resize(order, total)
        return order[self.rank : total : self.num_replicas].astype(np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def num_batches(self, batch_size: int, *, drop_last: bool = True) -> int:
        """Batches of ``batch_size`` in an epoch (the same on every process)."""
        batch_size = check_int(batch_size, "batch_size", low=1)
        return self.num_samples // batch_size if drop_last else -(-self.num_samples // batch_size)

    def batches(
        self, batch_size: int, *, drop_last: bool = True, start: int = 0
    ) -> Iterator[np.ndarray]:
        """This reader's index batches for the current epoch.

        Args:
          batch_size: indices per batch (the local batch size).
          drop_last: drop a last, smaller batch (default, so that every batch
            splits over the local devices).
          start: the first batch to yield, to resume inside an epoch.

        Yields:
          ``int64`` arrays of indices; index your arrays with them.
        """
        count = self.num_batches(batch_size, drop_last=drop_last)
        start = check_int(start, "start", low=0)
        indices = self.indices()
        for b in range(start, count):
            yield indices[b * batch_size : (b + 1) * batch_size]
