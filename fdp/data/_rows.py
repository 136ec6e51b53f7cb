"""The rows of a batch: one leading size over every leaf, and padding to more rows."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def leading_size(batch: Any, what: str = "batch") -> int | None:
    """The leading (batch) size shared by every leaf of ``batch``; None if it has no leaf.

    Args:
      batch: a pytree of arrays.
      what: how errors name ``batch`` (e.g. ``"shard_batch: batch"``).

    Raises:
      ValueError: a leaf is a scalar, or the leaves' leading sizes differ.

    Example:
      >>> leading_size({"x": np.zeros((4, 2)), "y": np.zeros(4)})
      4
    """
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = np.shape(leaf)
        name = jax.tree_util.keystr(path) or "<root>"
        if not shape:
            raise ValueError(
                f"{what} leaf {name} is a scalar; every leaf needs a leading batch axis."
            )
        sizes[name] = int(shape[0])
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{what} leaves must share one leading batch size, got {sizes}.")
    return next(iter(sizes.values()), None)


def pad_rows(batch: Any, rows: int, *, xp: Any = jnp) -> Any:
    """Every leaf padded along its leading axis to ``rows`` rows.

    Padding repeats the last row, so that a loss computed on padding stays
    finite (a zero input can give NaN, and NaN times a zero weight is NaN); a leaf
    with no rows is padded with zeros.

    Args:
      batch: a pytree of arrays with one leading size ``<= rows``.
      rows: the padded size.
      xp: ``jax.numpy`` (inside a traced step) or ``numpy`` (on the host).

    Example:
      >>> pad_rows({"x": np.arange(3.0)}, 5, xp=np)["x"].tolist()
      [0.0, 1.0, 2.0, 2.0, 2.0]
    """

    def pad(x: Any) -> Any:
        x = xp.asarray(x)
        have = x.shape[0]
        if have == rows:
            return x
        widths = [(0, rows - have)] + [(0, 0)] * (x.ndim - 1)
        return xp.pad(x, widths, mode="edge" if have else "constant")

    return jax.tree.map(pad, batch)
