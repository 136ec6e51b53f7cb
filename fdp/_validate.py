"""Checks of user arguments shared across fdp, with errors that name the argument."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(value: Any, name: str, *, low: int = 0) -> int:
    """``value`` as an ``int`` if it is an integer ``>= low`` (bools are not integers).

    Raises:
      ValueError: naming ``name``, the bound and the value.

    Example:
      >>> check_int(np.int64(3), "period", low=1)
      3
      >>> check_int(0, "period", low=1)
      Traceback (most recent call last):
      ...
      ValueError: period must be an integer >= 1, got period=0.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {name}={value!r}.")
    return int(value)
