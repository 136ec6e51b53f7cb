"""DiLoCo and streaming DiLoCo, against a reference written with plain optax per device."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, cross_entropy, make_data, make_state

import fdp

N = 8
ROWS = 32


def batches(num, seed=3):
    data = make_data(seed, ROWS * num)
    return [{k: v[ROWS * i : ROWS * (i + 1)] for k, v in data.items()} for i in range(num)]


def start_state(tx):
    return fdp.TrainState.create(apply_fn=None, params=make_state("mlp", "sgd").params, tx=tx)


def run(step, state, data):
    for batch in data:
        state, _ = step(state, fdp.shard_batch(batch))
    return state


def device(tree, i):
    return jax.tree.map(lambda x: np.asarray(x[i]), jax.device_get(tree))


def reference(data, inner_steps, inner_tx, outer_tx):
    """DiLoCo by hand: 8 workers, each with its rows of every batch, plain optax."""
    loss_fn = cross_entropy(MLP().apply)
    anchor = make_state("mlp", "sgd").params
    outer_state = outer_tx.init(anchor)
    workers = [(anchor, inner_tx.init(anchor)) for _ in range(N)]
    grad = jax.jit(jax.grad(loss_fn))
    for t, batch in enumerate(data):
        for i, (params, opt) in enumerate(workers):
            rows = {k: v[i * ROWS // N : (i + 1) * ROWS // N] for k, v in batch.items()}
            updates, opt = inner_tx.update(grad(params, rows), opt, params)
            workers[i] = (optax.apply_updates(params, updates), opt)
        if (t + 1) % inner_steps == 0:
            deltas = [jax.tree.map(lambda a, p: a - p, anchor, w[0]) for w in workers]
            pseudo = jax.tree.map(lambda *d: sum(d) / N, *deltas)
            updates, outer_state = outer_tx.update(pseudo, outer_state, anchor)
            anchor = optax.apply_updates(anchor, updates)
            workers = [(anchor, opt) for _, opt in workers]
    return anchor, [w[0] for w in workers]


def test_one_inner_step_with_outer_sgd_at_lr_1_is_plain_ddp():
    data = batches(4)
    tx = optax.sgd(0.1)
    ddp = run(fdp.train_step(cross_entropy(MLP().apply)), fdp.replicate(start_state(tx)), data)
    averager = fdp.hooks.diloco(1, outer_optimizer=optax.sgd(1.0))
    step = fdp.train_step(cross_entropy(MLP().apply), model_averager=averager)
    state = run(step, fdp.replicate(start_state(tx)), data)
    for i in range(N):
        chex.assert_trees_all_close(device(state.params, i), jax.device_get(ddp.params), atol=1e-6)


def test_diloco_matches_the_per_worker_reference_and_syncs_every_h_steps():
    data = batches(6)
    inner, outer = optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True)
    step = fdp.train_step(cross_entropy(MLP().apply), model_averager=fdp.hooks.diloco(4))
    state = fdp.replicate(start_state(inner))
    state = run(step, state, data[:4])
    anchor, _ = reference(data[:4], 4, inner, outer)
    for i in range(N):  # synced after step 4: every device at the new anchor
        chex.assert_trees_all_close(device(state.params, i), anchor, atol=1e-6)
    chex.assert_trees_all_close(device(state.comm_state["anchor"], 0), anchor, atol=1e-6)
    state = run(step, state, data[4:])
    _, workers = reference(data, 4, inner, outer)
    for i in range(N):  # two local steps later: each device its own way
        chex.assert_trees_all_close(device(state.params, i), workers[i], atol=1e-6)
    kernel = np.asarray(state.params["Dense_0"]["kernel"])
    assert np.abs(kernel[0] - kernel[1]).max() > 1e-4


def test_streaming_syncs_one_fragment_at_a_time():
    data = batches(4)
    averager = fdp.hooks.diloco(4, fragments=2)
    step = fdp.train_step(cross_entropy(MLP().apply), model_averager=averager, bucket_cap_mb=1e-3)
    state = run(step, fdp.replicate(start_state(optax.sgd(0.1))), data[:2])
    plan = step.plan
    frag = fdp.hooks._diloco.fragment_of_leaves(plan, 2)
    leaves = jax.tree.leaves(state.params)
    assert set(frag) == {0, 1}
    for leaf, f in zip(leaves, frag, strict=True):
        spread = float(jnp.abs(leaf - leaf[0:1]).max())
        # After step 2 only fragment 1 (offset 2) has synced.
        assert (spread == 0) == (f == 1), (f, spread)
    state = run(step, state, data[2:])
    for leaf, f in zip(jax.tree.leaves(state.params), frag, strict=True):
        spread = float(jnp.abs(leaf - leaf[0:1]).max())
        assert (spread == 0) == (f == 0), (f, spread)


def test_checkpoints_carry_the_anchor_and_outer_state(tmp_path):
    data = batches(6)
    step = fdp.train_step(cross_entropy(MLP().apply), model_averager=fdp.hooks.diloco(2))
    whole = run(step, fdp.replicate(start_state(optax.sgd(0.1))), data)
    state = run(step, fdp.replicate(start_state(optax.sgd(0.1))), data[:3])
    ckpt = fdp.CheckpointManager(tmp_path)
    ckpt.save(3, state)
    ckpt.close()
    template = step.init(fdp.replicate(start_state(optax.sgd(0.1))))
    restored = fdp.CheckpointManager(tmp_path).restore(template).state
    chex.assert_trees_all_equal(
        jax.device_get(restored.comm_state), jax.device_get(state.comm_state)
    )
    resumed = run(step, restored, data[3:])
    chex.assert_trees_all_equal(jax.device_get(resumed.params), jax.device_get(whole.params))


def test_settings_are_checked():
    with pytest.raises(ValueError, match="fragments=3 must divide inner_steps=8"):
        fdp.hooks.diloco(8, fragments=3)
    with pytest.raises(ValueError, match="inner_steps must be an integer >= 1"):
        fdp.hooks.diloco(0)
    with pytest.raises(ValueError, match="brings its own comm hook"):
        fdp.train_step(
            lambda p, b: 0.0, model_averager=fdp.hooks.diloco(4), comm_hook="bf16_compress"
        )
    with pytest.raises(ValueError, match="fragments=4 needs at least as many buckets"):
        step = fdp.train_step(
            cross_entropy(MLP().apply), model_averager=fdp.hooks.diloco(4, fragments=4)
        )
        run(step, fdp.replicate(start_state(optax.sgd(0.1))), batches(1))
