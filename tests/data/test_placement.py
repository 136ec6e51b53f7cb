"""The default mesh, replicate and shard_batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdp


def test_default_mesh_spans_every_device_on_one_data_axis():
    mesh = fdp.data_mesh()
    assert dict(mesh.shape) == {"data": len(jax.devices())}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)
    assert list(mesh.devices.flat) == jax.devices()
    assert dict(fdp.data_mesh(jax.devices()[:2], axis_name="dp").shape) == {"dp": 2}
    with pytest.raises(ValueError, match="at least one device"):
        fdp.data_mesh([])


def test_replicate_places_every_leaf_on_every_device():
    tree = {"w": np.arange(6.0).reshape(2, 3), "step": 3}
    out = fdp.replicate(tree)
    for leaf in jax.tree.leaves(out):
        assert leaf.sharding.is_fully_replicated
        assert len(leaf.addressable_shards) == 8
    np.testing.assert_array_equal(out["w"], tree["w"])
    assert int(out["step"]) == 3


def test_shard_batch_splits_the_leading_axis():
    batch = {"x": np.arange(32.0).reshape(16, 2), "y": np.arange(16)}
    out = fdp.shard_batch(batch)
    for d, shard in enumerate(out["x"].addressable_shards):
        np.testing.assert_array_equal(shard.data, batch["x"][2 * d : 2 * d + 2])
    np.testing.assert_array_equal(out["y"], batch["y"])


def test_shard_batch_with_a_named_axis_of_a_two_axis_mesh():
    mesh = jax.make_mesh((2, 4), ("model", "dp"))
    out = fdp.shard_batch(np.zeros((8, 3)), mesh, axis_name="dp")
    assert out.sharding.spec == jax.P("dp")
    assert {s.data.shape for s in out.addressable_shards} == {(2, 3)}


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"x": np.zeros((12, 2))}, r"batch size \(12\) must be divisible by the 8 devices"),
        ({"x": np.zeros((8, 2)), "y": np.zeros(16)}, "share one leading batch size"),
        ({"x": np.zeros((8, 2)), "t": np.float32(1)}, r"leaf \['t'\] is a scalar"),
    ],
)
def test_shard_batch_rejects_bad_batches(batch, match):
    with pytest.raises(ValueError, match=match):
        fdp.shard_batch(batch)


def test_shard_batch_rejects_a_mesh_without_the_axis():
    with pytest.raises(ValueError, match=r"axis_name='data' is not an axis.*\('dp',\)"):
        fdp.shard_batch(jnp.zeros(8), fdp.data_mesh(axis_name="dp"))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        fdp.shard_batch(jnp.zeros(8), "data")


@pytest.mark.parametrize(
    "where",
    ["one device", "another device", "a smaller mesh", "host numpy", "sharded"],
)
def test_replicate_accepts_leaves_placed_anywhere(where):
    # Restored checkpoint leaves of a fresh (unplaced) template sit on device 0.
    devices = jax.devices()
    x = jnp.arange(16.0)
    placed = {
        "one device": lambda: jax.device_put(x, devices[0]),
        "another device": lambda: jax.device_put(x, devices[5]),
        "a smaller mesh": lambda: fdp.replicate(x, fdp.data_mesh(devices[:4])),
        "host numpy": lambda: np.arange(16.0, dtype=np.float32),
        "sharded": lambda: jax.device_put(
            x, jax.sharding.NamedSharding(fdp.data_mesh(), jax.sharding.PartitionSpec("data"))
        ),
    }[where]()
    out = fdp.replicate({"w": placed, "k": jax.device_put(jax.random.key(1), devices[0])})
    assert out["w"].sharding.is_fully_replicated and len(out["w"].addressable_shards) == 8
    np.testing.assert_array_equal(out["w"], np.arange(16.0))
    assert out["k"].sharding.is_fully_replicated
    if isinstance(placed, jax.Array):
        assert not placed.is_deleted()  # a copy: donating `out` leaves the input intact


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_keep_their_dtype_impl_and_bits(impl):
    """Typed PRNG keys (jax.random.key, nnx.Rngs) are placed as keys, not as raw data."""
    keys = jax.random.split(jax.random.key(0, impl=impl), 16)
    state = {"key": keys[0], "legacy": jax.random.PRNGKey(1), "w": jnp.ones(2)}
    out, batch = fdp.replicate(state), fdp.shard_batch({"keys": keys})
    for got, want in ((out["key"], keys[0]), (batch["keys"], keys)):
        assert got.dtype == want.dtype and jax.random.key_impl(got) == impl
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
    assert out["key"].sharding.is_fully_replicated
    assert batch["keys"].addressable_shards[0].data.shape == (2,)
    assert out["legacy"].dtype == jnp.uint32
