"""A serialization for small Python values that never runs code from a peer.

``torch.distributed`` moves objects between ranks with ``pickle``, so a rank
that unpickles a peer's bytes runs whatever that peer put in them. fdp encodes
plain data with MessagePack instead: decoding builds only the types listed in
:func:`dumps`, whatever the bytes say.

Decoding is bounded too, so that no peer can crash a process with its bytes:
values nest at most :data:`MAX_DEPTH` containers deep (msgpack decodes each
nested tuple with a recursive call that takes ~40 KB of C stack; ~200 levels
overflowed it and killed the process with SIGSEGV), weigh at most
:data:`MAX_BYTES` encoded, and hold at most :data:`MAX_OBJECTS` objects once
decoded. The last bound is what keeps memory in proportion: one byte can
encode an empty list, which costs Python ~130 bytes once built (a 16 MiB value
of empty lists took 2.3 GiB and 86 s to decode before the bound; now it is
refused after at most :data:`MAX_OBJECTS` objects). Both sides check, and every
failure to decode is a :class:`SerializationError`.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from fdp._extended import from_raw, is_extended, key_impl, to_numpy

# MessagePack extension codes for the types msgpack has no native form for.
_TUPLE = 1
_NDARRAY = 2
_NPSCALAR = 3
_KEY = 4  # a typed PRNG key array: its implementation's name and raw data

SUPPORTED = (
    "None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays, numpy scalars "
    "and typed PRNG key arrays"
)

MAX_DEPTH = 64
"""Containers (list, tuple, dict) a value may nest, counting the outermost."""

MAX_BYTES = 256 * 1024 * 1024
"""The largest encoded value, in bytes (host collectives carry control data, not arrays)."""

MAX_OBJECTS = 2**20
"""The most objects a decoded value may hold: containers and their elements, counted
once each (an array counts as one). Strings, bytes and arrays take at most the bytes
they were sent in, so with MAX_BYTES this bounds the memory a decoded value takes."""


class SerializationError(ValueError):
    """A value that cannot be sent to, or was not decodable from, another process."""


class _Budget:
    """Objects one decoded value may still build; counted as msgpack builds containers.

    msgpack calls the hooks as each list or dict is complete, so a value over the
    budget is refused after at most :data:`MAX_OBJECTS` objects (and one list of at
    most that many elements, ``max_array_len``) were built, not after all of them.
    """

    def __init__(self) -> None:
        self.left = MAX_OBJECTS

    def spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise SerializationError(
                f"the value holds more than MAX_OBJECTS={MAX_OBJECTS} objects (containers "
                "and their elements); host collectives carry small control values."
            )

    def list_hook(self, items: list) -> list:
        self.spend(1 + len(items))
        return items

    def map_hook(self, items: dict) -> dict:
        self.spend(1 + 2 * len(items))
        return items


def _check_shape(obj: Any) -> None:
    """Raises if ``obj`` nests more than MAX_DEPTH containers or holds more than MAX_OBJECTS.

    Walked without recursion, so a cycle or a deep value cannot exhaust the stack.
    """
    stack: list[tuple[Any, int]] = [(obj, 0)]
    budget = _Budget()
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = [*value.keys(), *value.values()]
        elif isinstance(value, list | tuple):
            children = value
        else:
            continue
        budget.spend(1 + len(children))
        if depth + 1 > MAX_DEPTH:
            raise SerializationError(
                f"the value nests containers (list, tuple, dict) more than MAX_DEPTH="
                f"{MAX_DEPTH} deep (or contains itself); send a flatter value."
            )
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | tuple))


def _encode(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    for base in (dict, list, str, bytes, float, int):
        # Subclasses (OrderedDict, IntEnum, ...) travel as their base type.
        if isinstance(obj, base):
            return base(obj)  # pyright: ignore[reportCallIssue, reportArgumentType]
    if isinstance(obj, np.generic):
        return msgpack.ExtType(_NPSCALAR, _pack([obj.dtype.str, obj.tobytes()]))
    if is_extended(obj):
        impl = key_impl(obj)
        if not isinstance(impl, str):
            raise TypeError(
                f"cannot send a PRNG key of the custom implementation {impl!r}: a peer "
                "rebuilds keys from the name of one of JAX's built-in implementations. "
                "Send jax.random.key_data(key) instead."
            )
        return msgpack.ExtType(_KEY, _pack([impl, to_numpy(obj)]))
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


def _pack(obj: Any) -> bytes:
    # strict_types sends tuples (and int/str subclasses) to _encode instead of
    # silently turning them into lists.
    packed = msgpack.packb(obj, default=_encode, strict_types=True, use_bin_type=True)
    assert packed is not None  # packb returns bytes unless given a stream
    return packed


def _dtype(code: Any) -> np.dtype:
    if not isinstance(code, str):
        raise SerializationError(f"an array's dtype must be a string, got {code!r}.")
    dtype = np.dtype(code)
    if dtype.hasobject:
        raise SerializationError(f"arrays of dtype {dtype} are not accepted.")
    return dtype


def _fields(data: bytes, depth: int, budget: _Budget, count: int, what: str) -> list:
    fields = _unpack(data, depth, budget)
    if not isinstance(fields, list) or len(fields) != count:
        raise SerializationError(f"a {what} must be encoded as {count} fields, got {fields!r:.80}.")
    return fields


def _decode(code: int, data: bytes, depth: int, budget: _Budget) -> Any:
    if depth > MAX_DEPTH:
        # Checked before msgpack recurses, so the C stack stays bounded.
        raise SerializationError(f"the value nests more than MAX_DEPTH={MAX_DEPTH} containers.")
    if code == _TUPLE:
        items = _unpack(data, depth, budget)
        if not isinstance(items, list):
            raise SerializationError(f"a tuple must be encoded as a list, got {items!r:.80}.")
        return tuple(items)
    if code == _NPSCALAR:
        dtype, raw = _fields(data, depth, budget, 2, "numpy scalar")
        return np.frombuffer(raw, dtype=_dtype(dtype), count=1)[0]
    if code == _NDARRAY:
        dtype, shape, raw = _fields(data, depth, budget, 3, "numpy array")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise SerializationError(f"an array's shape must be sizes >= 0, got {shape!r:.80}.")
        return np.frombuffer(raw, dtype=_dtype(dtype)).reshape(shape).copy()
    if code == _KEY:
        impl, raw = _fields(data, depth, budget, 2, "PRNG key array")
        if not (isinstance(impl, str) and isinstance(raw, np.ndarray)):
            raise SerializationError(
                f"a PRNG key array must be encoded as 2 fields, a name and an array; got "
                f"{impl!r:.80}."
            )
        return from_raw(raw, impl)  # a name JAX does not know raises ValueError
    raise SerializationError(f"received a value with unknown extension code {code}.")


def _unpack(data: bytes, depth: int, budget: _Budget) -> Any:
    return msgpack.unpackb(
        data,
        ext_hook=lambda code, inner: _decode(code, inner, depth + 1, budget),
        list_hook=budget.list_hook,
        object_hook=budget.map_hook,
        # A header may not promise more elements than the budget (msgpack allocates them).
        max_array_len=MAX_OBJECTS,
        max_map_len=MAX_OBJECTS,
        raw=False,
        strict_map_key=False,
    )


def dumps(obj: Any) -> bytes:
    """Encodes ``obj`` for a peer, which decodes it with :func:`loads`.

    ``obj`` may nest None, bool, int, float, str, bytes, list, tuple, dict,
    numpy arrays and numpy scalars, up to :data:`MAX_DEPTH` containers deep and
    :data:`MAX_OBJECTS` objects in all;
    ``jax.Array`` s travel as numpy arrays, and typed PRNG key arrays
    (``jax.random.key``) as their raw data and implementation's name, decoded
    into key arrays again.

    Raises:
      TypeError: ``obj`` holds a value of another type.
      SerializationError: ``obj`` nests too deep, holds more than
        :data:`MAX_OBJECTS` objects, or encodes to more than :data:`MAX_BYTES`.

    Example:
      >>> import numpy as np
      >>> loads(dumps({"step": 3, "shape": (2, 3), "w": np.arange(3)}))
      {'step': 3, 'shape': (2, 3), 'w': array([0, 1, 2])}
    """
    _check_shape(obj)
    try:
        packed = _pack(obj)
    except (ValueError, OverflowError) as e:  # msgpack's limits: ints over 64 bits, 4 GiB
        raise SerializationError(f"cannot encode the value: {e}") from None
    if len(packed) > MAX_BYTES:
        raise SerializationError(
            f"the value encodes to {len(packed)} bytes, more than MAX_BYTES={MAX_BYTES}; "
            "host collectives carry small control values (send arrays through a step)."
        )
    return packed


def loads(data: bytes) -> Any:
    """Decodes bytes made by :func:`dumps`; builds only the supported types.

    Raises:
      SerializationError: ``data`` is not a value :func:`dumps` makes, or is
        over :data:`MAX_BYTES`, :data:`MAX_DEPTH` or :data:`MAX_OBJECTS`.
        Never another error, whatever the bytes.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SerializationError(f"expected bytes, got {type(data).__name__}.")
    if len(data) > MAX_BYTES:
        raise SerializationError(f"received {len(data)} bytes, more than MAX_BYTES={MAX_BYTES}.")
    try:
        value = _unpack(bytes(data), 0, _Budget())
        _check_shape(value)
    except SerializationError:
        raise
    except Exception as e:  # msgpack, numpy and unicode errors: whatever the bytes say
        if "exceeds max_array_len" in str(e) or "exceeds max_map_len" in str(e):
            raise SerializationError(
                f"received a container of more than MAX_OBJECTS={MAX_OBJECTS} elements "
                f"({e}); host collectives carry small control values."
            ) from None
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise SerializationError(
            f"received {len(data)} bytes that are not a value encoded by fdp.runtime ({detail})."
        ) from None
    return value
