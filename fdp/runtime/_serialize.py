"""A serialization for small Python values that never runs code from a peer.

``torch.distributed`` moves objects between ranks with ``pickle``, so a rank
that unpickles a peer's bytes runs whatever that peer put in them. fdp encodes
plain data with MessagePack instead: decoding builds only the types listed in
:func:`dumps`, whatever the bytes say.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

# MessagePack extension codes for the types msgpack has no native form for.
_TUPLE = 1
_NDARRAY = 2
_NPSCALAR = 3

SUPPORTED = "None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays and numpy scalars"


def _encode(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    for base in (dict, list, str, bytes, float, int):
        # Subclasses (OrderedDict, IntEnum, ...) travel as their base type.
        if isinstance(obj, base):
            return base(obj)  # pyright: ignore[reportCallIssue, reportArgumentType]
    if isinstance(obj, np.generic):
        return msgpack.ExtType(_NPSCALAR, _pack([obj.dtype.str, obj.tobytes()]))
    if isinstance(obj, np.ndarray) or (hasattr(obj, "__array__") and hasattr(obj, "dtype")):
        arr = np.asarray(obj)
        if arr.dtype.hasobject:
            raise TypeError(f"cannot send an array of dtype {arr.dtype}; use a numeric dtype.")
        arr = np.ascontiguousarray(arr)
        return msgpack.ExtType(_NDARRAY, _pack([arr.dtype.str, list(arr.shape), arr.tobytes()]))
    raise TypeError(
        f"cannot send a value of type {type(obj).__name__}; supported: {SUPPORTED}. "
        "(fdp does not pickle, so that no process runs code sent by another.)"
    )


def _decode(code: int, data: bytes) -> Any:
    if code == _TUPLE:
        return tuple(_unpack(data))
    if code == _NPSCALAR:
        dtype, raw = _unpack(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype))[0]
    if code == _NDARRAY:
        dtype, shape, raw = _unpack(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise ValueError(f"received a value with unknown extension code {code}.")


def _pack(obj: Any) -> bytes:
    # strict_types sends tuples (and int/str subclasses) to _encode instead of
    # silently turning them into lists.
    packed = msgpack.packb(obj, default=_encode, strict_types=True, use_bin_type=True)
    assert packed is not None  # packb returns bytes unless given a stream
    return packed


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_decode, raw=False, strict_map_key=False)


def dumps(obj: Any) -> bytes:
    """Encodes ``obj`` for a peer, which decodes it with :func:`loads`.

    ``obj`` may nest None, bool, int, float, str, bytes, list, tuple, dict,
    numpy arrays and numpy scalars freely; ``jax.Array`` s travel as numpy arrays.

    Raises:
      TypeError: ``obj`` holds a value of another type.

    Example:
      >>> import numpy as np
      >>> loads(dumps({"step": 3, "shape": (2, 3), "w": np.arange(3)}))
      {'step': 3, 'shape': (2, 3), 'w': array([0, 1, 2])}
    """
    return _pack(obj)


def loads(data: bytes) -> Any:
    """Decodes bytes made by :func:`dumps`; builds only the supported types."""
    return _unpack(data)
