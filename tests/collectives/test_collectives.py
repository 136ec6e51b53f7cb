"""fdp.collectives against numpy on the stacked per-device inputs (8 devices)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fdp import collectives as C

N = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def per_device(mesh, fn, *stacked, replicated=False):
    """Runs fn on each device's slice of the stacked inputs; returns stacked outputs."""
    stacked = [jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data"))) for x in stacked]

    def body(*xs):
        out = fn(*[x[0] for x in xs])
        return out if replicated else jax.tree.map(lambda o: o[None], out)

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=P("data"), out_specs=P() if replicated else P("data")
        )
    )
    return jax.tree.map(np.asarray, f(*stacked))


RNG = np.random.default_rng(0)
FLOATS = RNG.normal(size=(N, 3, 4)).astype(np.float32)
INTS = RNG.integers(0, 1 << 20, size=(N, 5)).astype(np.int32)
BOOLS = RNG.random(size=(N, 6)) < 0.5
SMALL_INTS = RNG.integers(1, 4, size=(N, 5)).astype(np.int32)

NUMPY_OPS = {
    "sum": lambda x: x.sum(0),
    "avg": lambda x: x.mean(0),
    "min": lambda x: x.min(0),
    "max": lambda x: x.max(0),
    "product": lambda x: x.prod(0),
    "band": lambda x: np.bitwise_and.reduce(x, 0),
    "bor": lambda x: np.bitwise_or.reduce(x, 0),
    "bxor": lambda x: np.bitwise_xor.reduce(x, 0),
}
CASES = [
    ("sum", FLOATS),
    ("sum", INTS),
    ("avg", FLOATS),
    ("min", FLOATS),
    ("min", INTS),
    ("max", FLOATS),
    ("max", BOOLS),
    ("min", BOOLS),
    ("product", FLOATS),
    ("product", SMALL_INTS),
    ("band", INTS),
    ("bor", INTS),
    ("bxor", INTS),
    ("band", BOOLS),
    ("bor", BOOLS),
    ("bxor", BOOLS),
]


@pytest.mark.parametrize(("op", "x"), CASES, ids=[f"{o}-{x.dtype}" for o, x in CASES])
def test_all_reduce_matches_numpy_and_is_replicated(mesh, op, x):
    out = per_device(mesh, functools.partial(C.all_reduce, op=op), x, replicated=True)
    np.testing.assert_allclose(out, NUMPY_OPS[op](x), rtol=1e-5)
    assert out.dtype == x.dtype


def test_all_reduce_premul_sum_and_pytrees(mesh):
    out = per_device(
        mesh,
        lambda a, b: C.all_reduce({"a": a, "b": b}, C.ReduceOp.PREMUL_SUM, factor=0.5),
        FLOATS,
        FLOATS[:, 0],
    )
    np.testing.assert_allclose(out["a"][3], 0.5 * FLOATS.sum(0), rtol=1e-5)
    np.testing.assert_allclose(out["b"][3], 0.5 * FLOATS[:, 0].sum(0), rtol=1e-5)


def test_broadcast(mesh):
    out = per_device(mesh, lambda x: C.broadcast(x, 5), FLOATS)
    np.testing.assert_array_equal(out, np.broadcast_to(FLOATS[5], out.shape))
    out = per_device(mesh, lambda x: C.broadcast(x, 2), BOOLS)
    np.testing.assert_array_equal(out, np.broadcast_to(BOOLS[2], out.shape))


@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather(mesh, tiled):
    out = per_device(mesh, lambda x: C.all_gather(x, tiled=tiled), FLOATS)
    want = FLOATS.reshape(N * 3, 4) if tiled else FLOATS
    for d in range(N):
        np.testing.assert_array_equal(out[d], want)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_scatter(mesh, op):
    x = RNG.normal(size=(N, 2 * N, 3)).astype(np.float32)
    out = per_device(mesh, lambda v: C.reduce_scatter(v, op), x)
    full = NUMPY_OPS[op](x)
    for d in range(N):
        np.testing.assert_allclose(out[d], full[2 * d : 2 * d + 2], rtol=1e-5)
    untiled = per_device(mesh, lambda v: C.reduce_scatter(v[:N], op, tiled=False), x)
    for d in range(N):
        np.testing.assert_allclose(untiled[d], NUMPY_OPS[op](x[:, :N])[d], rtol=1e-5)


def test_all_to_all(mesh):
    x = RNG.normal(size=(N, N * 2, 3)).astype(np.float32)
    out = per_device(mesh, C.all_to_all, x)
    for i in range(N):
        want = np.concatenate([x[j, 2 * i : 2 * i + 2] for j in range(N)])
        np.testing.assert_array_equal(out[i], want)


def test_reduce_to_dst(mesh):
    out = per_device(mesh, lambda x: C.reduce(x, 6, "max"), FLOATS)
    np.testing.assert_array_equal(out[6], FLOATS.max(0))
    for d in set(range(N)) - {6}:
        np.testing.assert_array_equal(out[d], FLOATS[d])


def test_gather_to_dst(mesh):
    out = per_device(mesh, lambda x: C.gather(x, 1), INTS)
    np.testing.assert_array_equal(out[1], INTS)
    assert not out[0].any() and not out[7].any()


def test_scatter_from_src(mesh):
    x = RNG.normal(size=(N, N, 3)).astype(np.float32)
    out = per_device(mesh, lambda v: C.scatter(v, 4), x)
    for d in range(N):
        np.testing.assert_array_equal(out[d], x[4, d])


def test_permute_and_shift(mesh):
    out = per_device(mesh, lambda x: C.permute(x, [(0, 3), (3, 0), (5, 6)]), FLOATS)
    np.testing.assert_array_equal(out[3], FLOATS[0])
    np.testing.assert_array_equal(out[0], FLOATS[3])
    np.testing.assert_array_equal(out[6], FLOATS[5])
    assert not out[1].any()
    ring = per_device(mesh, lambda x: C.shift(x, 1), FLOATS)
    np.testing.assert_array_equal(ring, np.roll(FLOATS, 1, axis=0))
    back = per_device(mesh, lambda x: C.shift(x, -2, wrap=False), FLOATS)
    np.testing.assert_array_equal(back[: N - 2], FLOATS[2:])
    assert not back[N - 2 :].any()


def test_barrier(mesh):
    out = per_device(mesh, lambda x: C.barrier(x), FLOATS)
    np.testing.assert_array_equal(out, FLOATS)
    assert per_device(mesh, lambda x: C.barrier(), FLOATS, replicated=True) == N


@pytest.mark.parametrize(
    ("fn", "x", "error", "match"),
    [
        (lambda x: C.all_reduce(x, "bor"), FLOATS, TypeError, "BOR is a bitwise op"),
        (lambda x: C.all_reduce(x, "avg"), INTS, TypeError, "AVG needs floating"),
        (lambda x: C.all_reduce(x, "sum"), BOOLS, TypeError, "SUM is not defined for bool"),
        (lambda x: C.all_reduce(x, "mean"), FLOATS, ValueError, "op must be a ReduceOp"),
        (lambda x: C.all_reduce(x, "premul_sum"), FLOATS, ValueError, "needs factor="),
        (lambda x: C.all_reduce(x, "sum", factor=2.0), FLOATS, ValueError, "only used with"),
        (lambda x: C.broadcast(x, 8), FLOATS, ValueError, "src=8 is out of range .* size 8"),
        (lambda x: C.reduce(x, -1), FLOATS, ValueError, "dst=-1 is out of range"),
        (lambda x: C.gather(x, 1.0), FLOATS, TypeError, "dst must be a Python int"),
        (lambda x: C.permute(x, [(0, 1), (2, 1)]), FLOATS, ValueError, r"\[1\] receives more"),
        (lambda x: C.scatter(x, 0), FLOATS, ValueError, "leading dimension to equal 8"),
        (lambda x: C.reduce_scatter(x, "sum"), FLOATS, ValueError, "divisible by 8"),
        (
            lambda x: C.all_reduce(x, axis_name="batch"),
            FLOATS,
            NameError,
            "axis_name='batch' is not a bound mesh axis",
        ),
    ],
)
def test_bad_input_is_a_clear_error(mesh, fn, x, error, match):
    with pytest.raises(error, match=match):
        per_device(mesh, fn, x)


def test_rooted_and_gathering_collectives_move_typed_keys(mesh):
    """Keys move as their raw data (psum takes no key dtype; JAX cannot lower their
    all_gather) and come back as keys of the same implementation, bit for bit."""
    keys = jax.random.split(jax.random.key(0, impl="rbg"), N)
    data = np.asarray(jax.random.key_data(keys))  # (N, 4) uint32
    stacked = np.stack([data] * N)  # every device holds all N keys (for scatter)

    def body(k, all_k):
        out = {
            "broadcast": C.broadcast(k, 3),
            "all_gather": C.all_gather(k, axis=-1),
            "gather": C.gather(k, 0),
            "scatter": C.scatter(all_k, 5),
        }
        assert all(jax.random.key_impl(v) == "rbg" for v in out.values())
        return jax.tree.map(jax.random.key_data, out)

    wrap = functools.partial(jax.random.wrap_key_data, impl="rbg")
    out = per_device(mesh, lambda k, a: body(wrap(k), wrap(a)), data, stacked)
    np.testing.assert_array_equal(out["broadcast"], np.stack([data[3]] * N))
    np.testing.assert_array_equal(out["all_gather"], np.stack([data] * N))
    np.testing.assert_array_equal(out["gather"][0], data)
    assert not out["gather"][1:].any()
    np.testing.assert_array_equal(out["scatter"], data)
