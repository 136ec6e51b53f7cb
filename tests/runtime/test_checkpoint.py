"""fdp.CheckpointManager in one process (several processes: test_multiprocess_training.py)."""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import cross_entropy, make_data, make_state
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp


class HookedState(TrainState):
    """A TrainState with the extra fields a comm hook and a data loader add."""

    comm_state: dict = flax.struct.field(default_factory=dict)


def hooked_state(seed=0):
    base = make_state("mlp", "adam", seed=seed)
    comm = {
        "error": jnp.arange(16.0).reshape(8, 2) + seed,
        "iteration": jnp.int32(7 + seed),
        "key": jax.random.key(3 + seed),
        "half": jnp.ones(3, jnp.bfloat16),
    }
    state = HookedState.create(
        apply_fn=base.apply_fn, params=base.params, tx=base.tx, comm_state=comm
    )
    state = fdp.replicate(state)
    # One leaf sharded over the data axis, as a per-device hook state would be.
    sharded = NamedSharding(fdp.data_mesh(), P("data"))
    return state.replace(
        comm_state={**state.comm_state, "error": jax.device_put(comm["error"], sharded)}
    )


def assert_same(a, b):
    paths = [
        [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
        for t in (a, b)
    ]
    assert paths[0] == paths[1]  # the same leaves (static fields may be other objects)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.sharding.is_equivalent_to(y.sharding, x.ndim)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_whole_state_round_trips_with_its_shardings(tmp_path):
    state = hooked_state()
    with fdp.CheckpointManager(tmp_path / "ck") as ckpt:
        ckpt.save(5, state, data_position={"epoch": 2, "batch": 9})
        template = hooked_state(seed=1)  # other values, the same layout
        restored = ckpt.restore(template)
    assert (restored.step, restored.data_position) == (5, {"epoch": 2, "batch": 9})
    assert isinstance(restored.state, HookedState) and restored.state.tx is template.tx
    assert_same(restored.state, state)
    assert restored.state.comm_state["error"].sharding.spec == P("data")


def test_restore_places_leaves_like_the_template(tmp_path):
    mesh = fdp.data_mesh()
    replicated = {"w": fdp.replicate(jnp.arange(16.0))}
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, replicated)
        template = {"w": jax.device_put(jnp.zeros(16), NamedSharding(mesh, P("data")))}
        out = ckpt.restore(template).state["w"]
    assert out.sharding.spec == P("data") and len(out.addressable_shards) == 8
    np.testing.assert_array_equal(out, np.arange(16.0))


def test_keeps_the_last_k_and_restores_any_of_them(tmp_path):
    ckpt = fdp.CheckpointManager(tmp_path, max_to_keep=2)
    state = fdp.replicate({"w": jnp.zeros(2)})
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        ckpt.restore(state)
    for step in range(1, 6):
        ckpt.save(step, jax.tree.map(lambda x, s=step: x + s, state))
    assert ckpt.all_steps() == [4, 5] and ckpt.latest_step() == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]
    np.testing.assert_array_equal(ckpt.restore(state, step=4).state["w"], [4.0, 4.0])
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step=2 .*\[4, 5\]"):
        ckpt.restore(state, step=2)
    ckpt.close()


def test_a_half_written_checkpoint_is_ignored_and_removed(tmp_path):
    state = fdp.replicate({"w": jnp.ones(2)})
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(3, state)
    # What a run killed while writing step 4 leaves behind.
    partial = tmp_path / "4.orbax-checkpoint-tmp-1234"
    partial.mkdir()
    (partial / "junk").write_text("x")
    with fdp.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.latest_step() == 3
        assert ckpt.restore(state).step == 3
    assert not partial.exists()


def test_resuming_continues_exactly(tmp_path):
    """Save at step 2 of 4, restore into a fresh state, finish: the same as no stop."""
    data = make_data(0, 64)
    batches = [{k: v[i * 16 : (i + 1) * 16] for k, v in data.items()} for i in range(4)]
    state = make_state("mlp", "adam")
    step = fdp.train_step(cross_entropy(state.apply_fn))
    fresh = lambda: fdp.replicate(make_state("mlp", "adam"))  # noqa: E731
    straight = fresh()
    for b in batches:
        straight, _ = step(straight, fdp.shard_batch(b))
    resumed = fresh()
    with fdp.CheckpointManager(tmp_path) as ckpt:
        for i, b in enumerate(batches[:2]):
            resumed, _ = step(resumed, fdp.shard_batch(b))
            ckpt.save(i + 1, resumed, data_position={"batch": i + 1})
        resumed, position, at = ckpt.restore(fresh())
    for b in batches[position["batch"] :]:
        resumed, _ = step(resumed, fdp.shard_batch(b))
    assert at == 2 and int(resumed.step) == 4
    assert_same(resumed.params, straight.params)
    assert_same(resumed.opt_state, straight.opt_state)


def test_async_save(tmp_path):
    state = hooked_state()
    with fdp.CheckpointManager(tmp_path, async_save=True) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        assert_same(ckpt.restore(state).state, state)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c, s: c.save(-1, s), ValueError, "step must be a non-negative int, got step=-1"),
        (
            lambda c, s: c.save(1, s, data_position={"x": object()}),
            TypeError,
            "data_position must be JSON-serialisable",
        ),
        (
            lambda c, s: fdp.CheckpointManager(c.directory, max_to_keep=0),
            ValueError,
            "max_to_keep must be a positive int or None, got max_to_keep=0",
        ),
    ],
)
def test_bad_arguments_are_named(tmp_path, call, error, message):
    with fdp.CheckpointManager(tmp_path) as ckpt, pytest.raises(error, match=message):
        call(ckpt, {"w": jnp.zeros(1)})


def test_a_state_saved_on_8_devices_restores_onto_4_and_trains_on(tmp_path):
    """World size 8 -> 4: replicated leaves are read onto the template's mesh."""
    batch = make_data(0, 16)
    state = make_state("mlp", "adam")
    loss = cross_entropy(state.apply_fn)
    big = fdp.replicate(state)
    big, _ = fdp.train_step(loss)(big, fdp.shard_batch(batch))
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, big)
        mesh = fdp.data_mesh(jax.devices()[:4])
        small = ckpt.restore(fdp.replicate(make_state("mlp", "adam"), mesh)).state
    assert small.params["Dense_0"]["kernel"].sharding.mesh.devices.size == 4
    assert_same(small.params, fdp.replicate(big.params, mesh))
    step = fdp.train_step(loss, mesh=mesh)
    small, _ = step(small, fdp.shard_batch(make_data(1, 16), mesh))
    big, _ = fdp.train_step(loss)(big, fdp.shard_batch(make_data(1, 16)))
    np.testing.assert_allclose(
        small.params["Dense_0"]["kernel"], big.params["Dense_0"]["kernel"], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_fails_hides_no_older_step(tmp_path, async_save):
    with fdp.CheckpointManager(tmp_path, max_to_keep=2, async_save=async_save) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": jnp.full(2, float(step))})
        ckpt.wait_until_finished()
        with pytest.raises(Exception):  # noqa: B017  # orbax's own error for an object leaf
            ckpt.save(4, {"w": jnp.ones(2), "bad": object()})
            ckpt.wait_until_finished()
        assert ckpt.all_steps() == [2, 3]  # nothing was deleted, nothing is hidden
        restored = ckpt.restore({"w": jnp.zeros(2)}, step=2)
        np.testing.assert_array_equal(restored.state["w"], [2.0, 2.0])


def test_a_stage_3_stack_saved_along_its_layer_axis_restores_into_todays_layout(tmp_path):
    """fdp split a stack [8, 16, 16] along its layer axis until 2026-11-26; now along dim 1."""
    import optax

    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.normal(size=(8, 16, 16)) * 0.3, jnp.float32)

    def make():
        return TrainState.create(apply_fn=None, params={"stack": stack}, tx=optax.adam(1e-2))

    def loss(params, batch):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"], params["stack"])
        return jnp.mean((h - batch["y"]) ** 2)

    mesh = fdp.data_mesh()
    old = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if np.ndim(x) == 3 else P())),
        make(),
    )
    assert old.opt_state[0].mu["stack"].sharding.spec == P("data")
    step = fdp.train_step(loss, sharding=fdp.Sharding(zero_stage=3))
    batch = {k: rng.normal(size=(32, 16)).astype("f4") for k in ("x", "y")}
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(0, old)
        restored = ckpt.restore(step.abstract_init(make)).state
    assert restored.params["stack"].sharding.spec == P(None, "data")
    assert restored.opt_state[0].mu["stack"].sharding.spec == P(None, "data")
    np.testing.assert_array_equal(restored.params["stack"], stack)
    after, _ = step(restored, fdp.shard_batch(batch))
    fresh, _ = step(fdp.replicate(make()), fdp.shard_batch(batch))
    assert_same(after.params, fresh.params)
    assert_same(after.opt_state, fresh.opt_state)
