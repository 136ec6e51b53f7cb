"""``step.init_sharded``: a train state built straight into the step's layout, never whole.

The reference is the ordinary path: the state built whole, then placed by ``step.init``.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, cross_entropy, make_data
from _procs import launch
from flax import nnx
from flax.training.train_state import TrainState

import fdp
from fdp.step.layout._sharded_init import jit_build, shardings_of

N = 8
TX = optax.adam(1e-2)
MODEL = MLP(features=(64, 32))  # kernels divide by 8; the head's bias (10) stays whole


def make_state(key):
    params = MODEL.init(key, jnp.zeros((1, 8, 8, 1)))["params"]
    return TrainState.create(apply_fn=MODEL.apply, params=params, tx=TX)


loss_fn = cross_entropy(MODEL.apply)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def make_pair(key):
    model = Net(nnx.Rngs(key))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def nnx_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def batches(num=3, rows=32):
    data = make_data(1, rows * num)
    return [{k: v[i * rows : (i + 1) * rows] for k, v in data.items()} for i in range(num)]


def assert_same_placed(got, want):
    """Leaf by leaf: the same sharding and bit-identical values."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def held_per_device(tree):
    """Bytes of every leaf's shard on the first device."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("stage", [1, 3])
def test_linen_equals_whole_then_placed(stage):
    step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=stage))
    got = step.init_sharded(make_state, jax.random.key(0))
    want = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=stage)).init(
        make_state(jax.random.key(0))
    )
    assert_same_placed(got, want)
    kernel = got.opt_state[0].mu["Dense_0"]["kernel"]  # [64, 64]: 8 rows each
    assert kernel.addressable_shards[0].data.shape == (64 // N, 64)
    head = got.params["Dense_2"]["kernel"]  # [32, 10]
    assert head.addressable_shards[0].data.shape == ((32 // N, 10) if stage == 3 else (32, 10))

    ref_step = fdp.train_step(loss_fn)
    ref = make_state(jax.random.key(0))
    for batch in batches():
        got, _ = step(got, fdp.shard_batch(batch))
        ref, _ = ref_step(ref, fdp.shard_batch(batch))
    chex.assert_trees_all_close(
        jax.device_get(got.params), jax.device_get(ref.params), atol=2e-6, rtol=1e-5
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_nnx_equals_whole_then_placed(stage):
    step = fdp.nnx_train_step(nnx_loss, sharding=fdp.Sharding(zero_stage=stage))
    model, optimizer = step.init_sharded(make_pair, jax.random.key(0))
    want_model, want_opt = make_pair(jax.random.key(0))
    fdp.nnx_train_step(nnx_loss, sharding=fdp.Sharding(zero_stage=stage)).init(want_model, want_opt)
    assert_same_placed(nnx.state((model, optimizer)), nnx.state((want_model, want_opt)))
    mu = optimizer.opt_state[0].mu["hidden"]["kernel"]  # [64, 32]
    assert mu[...].addressable_shards[0].data.shape == (64 // N, 32)

    ref_model, ref_opt = make_pair(jax.random.key(0))
    ref_step = fdp.nnx_train_step(nnx_loss)
    for batch in batches():
        step(model, optimizer, fdp.shard_batch(batch))
        ref_step(ref_model, ref_opt, fdp.shard_batch(batch))
    chex.assert_trees_all_close(
        jax.device_get(nnx.state(model, nnx.Param)),
        jax.device_get(nnx.state(ref_model, nnx.Param)),
        atol=2e-6,
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"reduction": fdp.Reduction(comm_hook="noop")},
        {
            "sharding": fdp.Sharding(zero_stage=1),
            "reduction": fdp.Reduction(comm_hook=fdp.hooks.powersgd(1)),
        },
    ],
    ids=["stage0", "per_device_copies", "stage1_stateful_hook"],
)
def test_the_rest_of_init_still_applies(settings):
    """Replicated at stage 0, one copy per device for `noop`, the hook's state filled."""

    def make(key):  # fdp.TrainState: room for the hook's state
        params = MODEL.init(key, jnp.zeros((1, 8, 8, 1)))["params"]
        return fdp.TrainState.create(apply_fn=MODEL.apply, params=params, tx=TX)

    got = fdp.train_step(loss_fn, **settings).init_sharded(make, jax.random.key(0))
    want = fdp.train_step(loss_fn, **settings).init(make(jax.random.key(0)))
    assert_same_placed(got, want)


def linen_init(stage):
    step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=stage))
    layout = step.abstract_init(make_state, jax.random.key(0))
    return make_state, layout, lambda: step.init_sharded(make_state, jax.random.key(0))


def nnx_init(stage):
    step = fdp.nnx_train_step(nnx_loss, sharding=fdp.Sharding(zero_stage=stage))
    layout = nnx.state(step.abstract_init(make_pair, jax.random.key(0)))
    built = lambda: nnx.state(step.init_sharded(make_pair, jax.random.key(0)))  # noqa: E731
    return lambda key: nnx.split(make_pair(key))[1], layout, built


@pytest.mark.parametrize("front", [linen_init, nnx_init])
def test_compiled_init_holds_only_shards(front):
    """At stage 3 each device's output is 1/8 of the state plus the leaves kept whole."""
    build, layout, init_sharded = front(3)
    jitted, _ = jit_build(build, shardings_of(layout))
    memory = jitted.lower(jax.random.key(0)).compile().memory_analysis()
    sizes = [(math.prod(x.shape) * x.dtype.itemsize, x.shape) for x in jax.tree.leaves(layout)]
    total = sum(b for b, _ in sizes)
    kept_whole = sum(b for b, shape in sizes if not any(d % N == 0 and d >= N for d in shape))
    expected = (total - kept_whole) // N + kept_whole
    assert expected < total / 4  # the point: far from the whole state
    # Plus, on CPU, the output tuple's table of one 8-byte pointer per leaf.
    assert expected <= memory.output_size_in_bytes <= expected + 8 * len(sizes)
    # The random parameters are drawn shard by shard: no whole copy in the scratch space.
    assert memory.temp_size_in_bytes < total / 4
    assert held_per_device(init_sharded()) == expected


def test_abstract_init_is_the_placed_layout():
    step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=3))
    layout = step.abstract_init(make_state, jax.random.key(0))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(layout))
    placed = step.init(make_state(jax.random.key(0)))
    assert shardings_of(layout) == [x.sharding for x in jax.tree.leaves(placed)]


def test_restore_into_abstract_template_lands_sharded(tmp_path):
    step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=3))
    state = step.init_sharded(make_state, jax.random.key(0))
    state, _ = step(state, fdp.shard_batch(batches(1)[0]))
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(step.abstract_init(make_state, jax.random.key(1))).state
    assert_same_placed(restored, state)
    # Each device holds its shards only: a quarter of the whole state would be too much.
    whole = sum(x.nbytes for x in jax.tree.leaves(restored))
    assert held_per_device(restored) == held_per_device(state) < whole / 4


def test_nnx_restore_into_abstract_template_lands_sharded(tmp_path):
    step = fdp.nnx_train_step(nnx_loss, sharding=fdp.Sharding(zero_stage=3))
    model, optimizer = step.init_sharded(make_pair, jax.random.key(0))
    step(model, optimizer, fdp.shard_batch(batches(1)[0]))
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, (model, optimizer))
        ckpt.wait_until_finished()
        template = fdp.nnx_train_step(nnx_loss, sharding=fdp.Sharding(zero_stage=3)).abstract_init(
            make_pair, jax.random.key(1)
        )
        ckpt.restore(template)
    assert_same_placed(nnx.state(template), nnx.state((model, optimizer)))


def test_make_must_return_model_and_optimizer():
    step = fdp.nnx_train_step(nnx_loss, sharding=fdp.Sharding(zero_stage=1))
    with pytest.raises(TypeError, match=r"make must return \(model, optimizer\)"):
        step.init_sharded(lambda key: Net(nnx.Rngs(key)), jax.random.key(0))


def test_linen_make_state_must_build_a_train_state():
    step = fdp.train_step(loss_fn, sharding=fdp.Sharding(zero_stage=1))
    with pytest.raises(TypeError, match="state must be a flax.training.train_state.TrainState"):
        step.init_sharded(lambda key: {"w": jax.random.normal(key, (8,))}, jax.random.key(0))


def test_two_processes_build_restore_and_train_their_shards(tmp_path, marker):
    """2 processes x 2 devices at stage 3: each checks its own shards against build-whole."""
    out = launch(
        ["--nproc-per-node", "2"], "sharded_init.py", ["--ckpt-dir", tmp_path / "ck"], marker
    )
    assert out.returncode == 0, out.output
    assert out.output.count("sharded init ok") == 2, out.output
