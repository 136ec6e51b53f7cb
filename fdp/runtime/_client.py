"""Reading the coordination service's errors (the client itself: :mod:`fdp._compat`)."""

from __future__ import annotations

from fdp._compat import coordination_client as coordination_client


def is_timeout(error: BaseException) -> bool:
    """Whether a coordination-service error is a deadline that passed."""
    return "DEADLINE_EXCEEDED" in str(error)


def is_not_found(error: BaseException) -> bool:
    """Whether a coordination-service error says that a key does not exist."""
    return "NOT_FOUND" in str(error)


def is_already_exists(error: BaseException) -> bool:
    """Whether a coordination-service error says that a key exists already."""
    return "ALREADY_EXISTS" in str(error)


def first_line(error: BaseException) -> str:
    """The first line of a coordination-service error (the rest is gRPC detail)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
