"""fdp.train_step equals single-device training on the full batch."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import cross_entropy, make_data, make_state, reference_steps
from flax.training.train_state import TrainState

import fdp

STEPS = 3
GLOBAL_BATCH = 16


@pytest.mark.parametrize("cap_mb", [1e-6, 1000.0], ids=["tiny-cap", "huge-cap"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_matches_single_device_on_the_full_batch(n, model, opt, cap_mb):
    # Both layouts: N = 2 and 8 pack flat bucket buffers, N = 1 and 4 reduce in place.
    layout = "flat" if n in (2, 8) else "leaves"
    init = make_state(model, opt)
    loss_fn = cross_entropy(init.apply_fn)
    batches = [make_data(seed, GLOBAL_BATCH) for seed in range(STEPS)]
    want, want_losses = reference_steps(init, batches, loss_fn)

    mesh = fdp.data_mesh(jax.devices()[:n])
    step = fdp.train_step(
        loss_fn, mesh=mesh, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb, layout=layout
    )
    state = fdp.replicate(init, mesh)
    losses = []
    for batch in batches:
        state, metrics = step(state, fdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))

    num_leaves = len(jax.tree.leaves(init.params))
    assert len(step.plan.buckets) == (num_leaves if cap_mb < 1 else 1)
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.opt_state, want.opt_state, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert int(state.step) == STEPS
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.is_fully_replicated


@pytest.mark.parametrize("layout", ["leaves", "flat"])
def test_compiled_step_reduces_each_gradient_once_over_the_data_axis(layout):
    init = make_state("mlp", "sgd")
    loss_fn = cross_entropy(init.apply_fn)
    step = fdp.train_step(loss_fn, bucket_cap_mb=1e-3, first_bucket_cap_mb=1e-3, layout=layout)
    lowered = step.lower(fdp.replicate(init), fdp.shard_batch(make_data(0, GLOBAL_BATCH)))
    plan = step.plan
    assert len(plan.buckets) > 1

    # Emitted in bucket order: 'flat' one all-reduce per bucket buffer, 'leaves'
    # one per gradient; then one for the loss.
    emitted = fdp.collective_stats(lowered)
    if layout == "flat":
        want = [(b.size,) for b in plan.buckets]
    else:
        want = [shape for b in plan.buckets for shape in b.shapes]
    assert [op.shapes[0] for op in emitted.ops] == [*want, ()]
    assert {op.kind for op in emitted.ops} == {"all-reduce"}
    assert all(op.groups == (tuple(range(8)),) for op in emitted.ops)

    # Compiled for CPU: XLA combines the in-place ones into one all-reduce and keeps
    # flat buckets apart (DDP's buckets); every gradient byte is reduced once.
    compiled = fdp.collective_stats(lowered.compile())
    assert set(compiled.summary()) == {"all-reduce"}
    assert compiled.count() == (len(plan.buckets) + 1 if layout == "flat" else 1)
    assert compiled.nbytes("all-reduce") == plan.nbytes + 4
    assert all(op.groups == (tuple(range(8)),) for op in compiled.ops)


def test_two_axis_mesh_reduces_over_the_data_axis_only():
    mesh = jax.make_mesh((4, 2), ("batch", "model"))
    init = make_state("mlp", "adam")
    loss_fn = cross_entropy(init.apply_fn)
    batches = [make_data(seed, GLOBAL_BATCH) for seed in range(2)]
    want, _ = reference_steps(init, batches, loss_fn)
    step = fdp.train_step(loss_fn, mesh=mesh, axis_name="batch")
    state = fdp.replicate(init, mesh)
    for batch in batches:
        state, _ = step(state, fdp.shard_batch(batch, mesh, axis_name="batch"))
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)
    lowered = step.lower(state, fdp.shard_batch(batches[0], mesh, axis_name="batch"))
    compiled = fdp.collective_stats(lowered.compile())
    assert compiled.count("all-reduce") >= 1
    assert {op.groups for op in compiled.ops} == {((0, 2, 4, 6), (1, 3, 5, 7))}


def test_has_aux_and_rng():
    init = make_state("mlp", "sgd")

    def loss_fn(params, batch, rng):
        logits = init.apply_fn({"params": params}, batch["x"])
        noise = jax.random.normal(rng, ())
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        correct = jnp.sum(jnp.argmax(logits, -1) == batch["y"])
        return loss, {"correct": correct, "noise": noise, "acc": jnp.mean(correct / 2.0)}

    step = fdp.train_step(loss_fn, has_aux=True)
    data = make_data(0, GLOBAL_BATCH)
    _, metrics = step(fdp.replicate(init), fdp.shard_batch(data), jax.random.key(1))
    logits = init.apply_fn({"params": init.params}, data["x"])
    want_correct = int(np.sum(np.argmax(logits, -1) == data["y"]))
    assert int(metrics["aux"]["correct"]) == want_correct
    np.testing.assert_allclose(float(metrics["aux"]["acc"]), want_correct / GLOBAL_BATCH, rtol=1e-6)
    # Each device folds its index into the key: the mean of 8 different draws.
    draws = [jax.random.normal(jax.random.fold_in(jax.random.key(1), i), ()) for i in range(8)]
    np.testing.assert_allclose(float(metrics["aux"]["noise"]), np.mean(draws), rtol=1e-5)


def test_unplaced_inputs_are_placed_on_auto_and_explicit_meshes():
    init = make_state("mlp", "sgd")
    loss_fn = cross_entropy(init.apply_fn)
    batch = make_data(0, GLOBAL_BATCH)
    want, _ = reference_steps(init, [batch], loss_fn)
    explicit = jax.make_mesh((8,), ("data",))
    assert explicit.axis_types == (jax.sharding.AxisType.Explicit,)
    for mesh in (None, explicit):
        state, _ = fdp.train_step(loss_fn, mesh=mesh, donate=False)(init, batch)
        chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)


def test_state_is_donated():
    init = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(cross_entropy(init.apply_fn))
    step(init, fdp.shard_batch(make_data(0, GLOBAL_BATCH)))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(init.params))


def test_bad_input_is_a_clear_error():
    init = make_state("mlp", "sgd")
    loss_fn = cross_entropy(init.apply_fn)
    step = fdp.train_step(loss_fn, donate=False)
    with pytest.raises(ValueError, match=r"\['x'\] has shape \(12, 8, 8, 1\).*divisible by the 8"):
        step(init, make_data(0, 12))
    with pytest.raises(ValueError, match="shard_batch: the batch size \\(12\\) must be divisible"):
        fdp.shard_batch(make_data(0, 12))
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB, got 0"):
        fdp.train_step(loss_fn, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="first_bucket_cap_mb must be a positive"):
        fdp.train_step(loss_fn, first_bucket_cap_mb=-1)
    with pytest.raises(
        ValueError, match=r"layout must be one of \('auto', 'leaves', 'flat'\), got 'tuple'"
    ):
        fdp.train_step(loss_fn, layout="tuple")
    with pytest.raises(
        ValueError, match=r"axis_name='batch' is not an axis of the mesh.*\('data',\)"
    ):
        fdp.train_step(loss_fn, mesh=fdp.data_mesh(), axis_name="batch")
    per_example = fdp.train_step(
        lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
            init.apply_fn({"params": p}, b["x"]), b["y"]
        ),
        donate=False,
    )
    with pytest.raises(TypeError, match=r"float scalar; got float32\[2\]. Reduce it with .mean"):
        per_example(init, make_data(0, GLOBAL_BATCH))
    with pytest.raises(TypeError, match="state must be a flax.training.train_state.TrainState"):
        step(init.params, make_data(0, GLOBAL_BATCH))
    with pytest.raises(
        TypeError, match=r"must return \(loss, aux\) since has_aux=True; got an arr"
    ):
        fdp.train_step(loss_fn, has_aux=True, donate=False)(init, make_data(0, GLOBAL_BATCH))
    assert isinstance(init, TrainState)


def test_replicate_copies_so_donation_leaves_the_original_intact():
    init = make_state("mlp", "sgd")
    step = fdp.train_step(cross_entropy(init.apply_fn))
    step(fdp.replicate(init), fdp.shard_batch(make_data(0, GLOBAL_BATCH)))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(init.params))


def test_an_unplaced_state_compiles_the_step_once():
    init = make_state("mlp", "sgd")
    traces = []
    base = cross_entropy(init.apply_fn)

    def counting_loss(params, batch):
        traces.append(1)
        return base(params, batch)

    step = fdp.train_step(counting_loss)
    batch = fdp.shard_batch(make_data(0, GLOBAL_BATCH))
    state, _ = step(init, batch)  # on one device: the step places it first
    after_first = len(traces)
    for _ in range(2):
        state, _ = step(state, batch)
    assert len(traces) == after_first


def test_a_one_device_mesh_compiles_without_collectives():
    init = make_state("mlp", "adam")
    loss_fn = cross_entropy(init.apply_fn)
    mesh = fdp.data_mesh(jax.devices()[:1])
    step = fdp.train_step(loss_fn, mesh=mesh)
    state = fdp.replicate(init, mesh)
    lowered = step.lower(state, fdp.shard_batch(make_data(0, 8), mesh))
    assert not fdp.collective_stats(lowered.compile()).ops
    assert step.config.layout == "leaves"  # 'auto' in one process


def test_the_same_key_at_every_step_is_warned_once():
    init = make_state("mlp", "sgd")

    def loss_fn(params, batch, rng):
        keep = jax.random.bernoulli(rng, 0.9, batch["x"].shape)  # dropout on the input
        logits = init.apply_fn({"params": params}, batch["x"] * keep)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    batch = fdp.shard_batch(make_data(0, GLOBAL_BATCH))
    one = jax.random.key(1)
    for key in (lambda: one, lambda: jax.random.key(1)):  # one object; the seed made again
        step = fdp.train_step(loss_fn)
        state, _ = step(fdp.replicate(init), batch, key())
        with pytest.warns(UserWarning, match="equals the previous call's.*fold_in"):
            state, _ = step(state, batch, key())
        state, _ = step(state, batch, key())  # warned once: no error
    fresh = fdp.train_step(loss_fn)
    state = fdp.replicate(init)
    for i in range(3):  # a new key each step: no warning (warnings are errors here)
        state, _ = fresh(state, batch, jax.random.fold_in(jax.random.key(1), i))
