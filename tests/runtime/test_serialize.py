"""The object serialization under hostile input: it returns a value or raises SerializationError.

Whatever bytes a peer sends, `loads` must neither crash the process (the C stack),
nor raise anything but fdp's error, nor build a type outside the supported ones.
"""

import functools
import subprocess
import sys

import jax
import msgpack
import numpy as np
import pytest
from _procs import ROOT, child_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fdp.runtime import SerializationError
from fdp.runtime._serialize import MAX_BYTES, MAX_DEPTH, MAX_OBJECTS, dumps, loads

# Deterministic: the same examples on every run, so a failure reproduces.
FUZZ = settings(
    derandomize=True,
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-9, 9)), inner, max_size=4),
    ),
    max_leaves=20,
)
# Raw data of one threefry key, encoded as a numpy array (extension 2).
KEY_DATA = msgpack.ExtType(2, msgpack.packb(["<u4", [2], b"\0" * 8]))
SUPPORTED = (type(None), bool, int, float, str, bytes, list, tuple, dict, np.ndarray, np.generic)


def nested_tuple(depth):
    return functools.reduce(lambda inner, _: (inner,), range(depth), None)


def deep_payload(depth):
    """`depth` nested tuples, encoded by hand, as a peer that skips dumps' check would."""
    data = msgpack.packb(None)
    for _ in range(depth):
        data = msgpack.packb(msgpack.ExtType(1, msgpack.packb([msgpack.ExtType(1, data)])))
    return data


def only_supported_types(value):
    stack = [value]
    while stack:
        v = stack.pop()
        # A typed PRNG key array is the one value decoded into a jax.Array.
        is_key = isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
        assert is_key or isinstance(v, SUPPORTED), type(v)
        if isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list | tuple):
            stack += list(v)


def decode_or_fdp_error(data):
    try:
        value = loads(data)
    except SerializationError:
        return
    only_supported_types(value)


@FUZZ
@given(values)
def test_plain_values_round_trip(value):
    assert loads(dumps(value)) == value


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_fdp_error(data):
    decode_or_fdp_error(data)


@FUZZ
@given(values, st.data())
def test_corrupted_encodings_decode_or_raise_fdp_error(value, data):
    """Valid encodings with bytes flipped, cut or inserted: the inputs a parser trips on."""
    raw = bytearray(dumps({"v": value, "a": np.arange(3, dtype=np.int16), "s": np.float32(2)}))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip":
            raw[i] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del raw[i:]
            if not raw:
                break
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=4))
    decode_or_fdp_error(bytes(raw))


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb(msgpack.ExtType(2, msgpack.packb(["|O", [1], b"\0" * 8]))),  # object array
        msgpack.packb(msgpack.ExtType(2, msgpack.packb(["<f4", [-1, 4], b"\0" * 8]))),
        msgpack.packb(msgpack.ExtType(2, msgpack.packb(["<f4", [2**62, 2**62], b""]))),
        msgpack.packb(msgpack.ExtType(2, msgpack.packb([7, [1], b"\0" * 8]))),  # dtype not a str
        msgpack.packb(msgpack.ExtType(3, msgpack.packb(["<f8", b""]))),  # scalar without bytes
        msgpack.packb(msgpack.ExtType(3, msgpack.packb(["not a dtype", b"\0"]))),
        msgpack.packb(msgpack.ExtType(3, msgpack.packb("x"))),
        msgpack.packb(msgpack.ExtType(1, b"\xc1")),  # tuple of garbage
        msgpack.packb(msgpack.ExtType(1, msgpack.packb(5))),  # tuple of an int
        msgpack.packb(msgpack.ExtType(9, b"")),  # unknown extension
        msgpack.packb(msgpack.ExtType(4, msgpack.packb([7, b""]))),  # key without a name
        msgpack.packb(msgpack.ExtType(4, msgpack.packb(["bogus", KEY_DATA]))),  # unknown impl
        msgpack.packb(msgpack.ExtType(4, msgpack.packb(["rbg", KEY_DATA]))),  # rbg has 4 words
        msgpack.packb({msgpack.ExtType(2, msgpack.packb(["<i1", [1], b"\0"])): 1}),  # array key
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 billion items
        b"\xa3\xff\xfe\xfd",  # a string that is not UTF-8
        b"\xc1",  # a byte msgpack never uses (its FormatError has an empty message)
        b"",
        deep_payload(300),
        msgpack.packb(functools.reduce(lambda inner, _: [inner], range(MAX_DEPTH + 1), 1)),
    ],
    ids=lambda p: f"{bytes(p[:6]).hex()}..{len(p)}B",
)
def test_adversarial_payloads_raise_fdp_error(payload):
    reasons = "nests|not a value|dtype|shape|extension|fields|tuple|MAX_OBJECTS"
    with pytest.raises(SerializationError, match=reasons):
        loads(payload)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_round_trip_as_keys(impl):
    keys = jax.random.split(jax.random.key(3, impl=impl), 4)
    back = loads(dumps({"keys": keys, "one": keys[0]}))
    for got, want in ((back["keys"], keys), (back["one"], keys[0])):
        assert got.dtype == want.dtype and jax.random.key_impl(got) == impl
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))


def test_depth_and_size_are_bounded_on_both_sides():
    assert loads(dumps(nested_tuple(MAX_DEPTH - 1))) == nested_tuple(MAX_DEPTH - 1)
    with pytest.raises(SerializationError, match=f"more than MAX_DEPTH={MAX_DEPTH} deep"):
        dumps(nested_tuple(200))
    cycle = []
    cycle.append(cycle)
    with pytest.raises(SerializationError, match="contains itself"):
        dumps(cycle)
    with pytest.raises(SerializationError, match="more than MAX_BYTES"):
        loads(b"\0" * (MAX_BYTES + 1))
    with pytest.raises(SerializationError, match="cannot encode the value"):
        dumps(2**70)


def test_a_deeply_nested_value_no_longer_kills_the_process():
    """Today's main dies with SIGSEGV (exit -11) on `loads` of 200 nested tuples."""
    code = (
        "import msgpack\n"
        "from fdp.runtime import _serialize as S\n"
        "data = msgpack.packb(None)\n"
        "for _ in range(2000):\n"
        "    data = msgpack.packb(msgpack.ExtType(1, msgpack.packb([msgpack.ExtType(1, data)])))\n"
        "try:\n"
        "    S.loads(data)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=child_env("serialize"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "refused: the value nests more than MAX_DEPTH" in out.stdout


def test_object_count_is_bounded_on_both_sides():
    """On main a 16 MiB value of empty lists decoded into +1.1 GiB of memory (in 35-117 s)."""
    most = (MAX_OBJECTS - 1) // 2  # the list, and each element both as an element and a list
    assert loads(dumps([[]] * most)) == [[]] * most
    with pytest.raises(SerializationError, match=f"more than MAX_OBJECTS={MAX_OBJECTS}"):
        dumps([[]] * (most + 1))
    with pytest.raises(SerializationError, match=f"more than MAX_OBJECTS={MAX_OBJECTS}"):
        loads(msgpack.packb([[]] * (most + 1)))
    # A header promising more elements than the bound is refused before they are made.
    flat = b"\xdd" + (16 * 2**20).to_bytes(4, "big") + b"\x90" * 16
    with pytest.raises(SerializationError, match=f"more than MAX_OBJECTS={MAX_OBJECTS}"):
        loads(flat)
