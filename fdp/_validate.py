"""Checks of user arguments shared across fdp, with errors that name the argument."""

from __future__ import annotations

import math
import numbers
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


def check_number(value: Any, name: str, *, positive: bool = True, allow_inf: bool = False) -> float:
    """``value`` as a ``float`` if it is a real number (Python's or NumPy's), not NaN.

    Args:
      value: the argument.
      name: its name, for the message.
      positive: require ``value > 0``.
      allow_inf: accept ``inf`` (for timeouts: wait without end).

    Raises:
      TypeError: ``value`` is not a real number (bools are not numbers).
      ValueError: ``value`` is NaN, infinite (unless allowed) or not positive;
        the message names ``name`` and the value.

    Example:
      >>> check_number(np.float32(25), "bucket_cap_mb")
      25.0
      >>> check_number(float("nan"), "timeout", allow_inf=True)
      Traceback (most recent call last):
      ...
      ValueError: timeout must be a positive number (inf allowed), got timeout=nan.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {name}={value!r} ({type(value).__name__}).")
    number = float(value)
    finite_ok = math.isfinite(number) or (allow_inf and number == math.inf)
    if not finite_ok or (positive and not number > 0):
        what = "a positive number" if positive else "a number"
        what += " (inf allowed)" if allow_inf else ", finite"
        raise ValueError(f"{name} must be {what}, got {name}={value!r}.")
    return number


MAX_TIMEOUT_MS = 2**31 - 1
"""The longest wait JAX's coordination service takes, in milliseconds (~24.8 days)."""


def timeout_ms(value: Any, name: str = "timeout") -> int:
    """A timeout in seconds (``inf``: as long as possible) as whole milliseconds for JAX.

    Example:
      >>> timeout_ms(1.5), timeout_ms(float("inf")) == MAX_TIMEOUT_MS
      (1500, True)
    """
    seconds = check_number(value, name, allow_inf=True)
    return int(min(MAX_TIMEOUT_MS, max(1, round(min(seconds, MAX_TIMEOUT_MS) * 1000))))
