"""Unused parameters: found from the traced program, left untouched like DDP's None grads."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_data
from flax.training.train_state import TrainState

import fdp
from fdp.step.grads._usage import CONDITIONAL, UNUSED, USED, analyse_usage


def test_analysis_of_branches_calls_and_aux():
    def loss(p, x, flag):
        z = x @ p["body"]
        branch = jax.lax.cond(flag, lambda h: jnp.sum(h @ p["a"]), lambda h: jnp.sum(h), z)
        both = jax.lax.cond(flag, lambda: jnp.sum(p["c"]), lambda: jnp.sum(2 * p["c"]))
        inner = jax.jit(lambda q: jnp.sum(jax.nn.softmax(q)))(p["jit"])
        return branch + both + inner, jnp.sum(p["aux_only"])

    params = {k: jnp.ones((4, 4)) for k in ("body", "a", "c", "jit", "aux_only", "never")}
    usage = analyse_usage(loss, params, jnp.ones((2, 4)), True)
    levels = dict(zip(usage.key_paths, usage.levels, strict=True))
    assert levels == {
        "['a']": CONDITIONAL,
        "['aux_only']": UNUSED,
        "['body']": USED,
        "['c']": USED,
        "['jit']": USED,
        "['never']": UNUSED,
    }
    assert fdp.find_unused_parameters(loss, params, jnp.ones((2, 4)), True) == (
        "['aux_only']",
        "['never']",
    )


class WithHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x.reshape(x.shape[0], -1)))
        nn.Dense(5, name="head")(h)  # created, never used in the loss
        return nn.Dense(10)(h)


def head_state():
    model = WithHead()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2))


def ce(apply_fn):
    def loss_fn(params, batch):
        logits = apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn


def test_unused_head_and_its_adamw_state_stay_bit_for_bit_unchanged():
    init = head_state()
    step = fdp.train_step(ce(init.apply_fn), find_unused_parameters=True)
    state = fdp.replicate(init)
    for s in range(6):
        state, _ = step(state, fdp.shard_batch(make_data(s, 16)))
    assert step.usage.unused_key_paths == ("['head']['bias']", "['head']['kernel']")
    assert all("head" not in b for bucket in step.plan.buckets for b in bucket.key_paths)
    chex.assert_trees_all_equal(state.params["head"], init.params["head"])
    adam = state.opt_state[0]
    chex.assert_trees_all_equal(adam.mu["head"], init.opt_state[0].mu["head"])
    chex.assert_trees_all_equal(adam.nu["head"], init.opt_state[0].nu["head"])
    assert not np.allclose(state.params["Dense_0"]["kernel"], init.params["Dense_0"]["kernel"])
    # Without detection, AdamW's weight decay moves the head (what DDP avoids).
    plain = fdp.train_step(ce(init.apply_fn))
    with pytest.warns(UserWarning, match=r"\['head'\]\['bias'\], \['head'\]\['kernel'\]"):
        moved, _ = plain(fdp.replicate(init), fdp.shard_batch(make_data(0, 16)))
    assert not np.array_equal(moved.params["head"]["kernel"], init.params["head"]["kernel"])


def routed_loss(params, batch):
    # Each device picks a branch from its own data: route > 0 uses "a", else "b".
    h = batch["x"] @ params["body"]
    out = jax.lax.cond(
        jnp.mean(batch["route"]) > 0, lambda h: h @ params["a"], lambda h: h @ params["b"], h
    )
    return jnp.mean((out - batch["y"]) ** 2)


def routed(seed, routes):
    rng = np.random.default_rng(seed)
    n = len(routes) * 2
    return {
        "x": rng.normal(size=(n, 3)).astype(np.float32),
        "y": rng.normal(size=(n, 2)).astype(np.float32),
        "route": np.repeat(np.asarray(routes, np.float32), 2),
    }


def routed_params():
    rng = np.random.default_rng(1)
    return {
        k: rng.normal(size=s).astype(np.float32)
        for k, s in {"body": (3, 4), "a": (4, 2), "b": (4, 2)}.items()
    }


def test_a_branch_used_on_some_devices_is_reduced_like_ddp():
    params = routed_params()
    batch = routed(0, [1, 1, 1, 0, 0, 0, 0, 1])
    # DDP: each rank's gradient of its own shard (zeros for the branch it did not
    # take), averaged over the 8 ranks.
    shards = [{k: v[2 * d : 2 * d + 2] for k, v in batch.items()} for d in range(8)]
    shard_grads = [jax.grad(routed_loss)(params, shard) for shard in shards]
    want = jax.tree.map(lambda *g: np.mean(g, axis=0), *shard_grads)
    state = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(1.0))
    step = fdp.train_step(routed_loss, find_unused_parameters=True)
    new, _ = step(fdp.replicate(state), fdp.shard_batch(batch))
    assert step.usage.conditional_key_paths == ("['a']", "['b']")
    for k in params:
        np.testing.assert_allclose(
            params[k] - np.asarray(new.params[k]), want[k], rtol=1e-5, atol=1e-6
        )


def test_a_branch_no_device_used_is_untouched_with_its_optimizer_state():
    params = routed_params()
    state = fdp.replicate(TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-2)))
    step = fdp.train_step(routed_loss, find_unused_parameters=True)
    for s in range(3):  # every device routes to "a"
        state, _ = step(state, fdp.shard_batch(routed(s, [1] * 8)))
    np.testing.assert_array_equal(state.params["b"], params["b"])
    assert not np.asarray(state.opt_state[0].mu["b"]).any()
    assert not np.array_equal(state.params["a"], params["a"])
    state, _ = step(state, fdp.shard_batch(routed(9, [0] + [1] * 7)))  # one device uses "b"
    assert not np.array_equal(state.params["b"], params["b"])


def test_usage_is_the_union_over_micro_batches():
    # pytorch#69031: DDP only counted the last micro-batch's usage. Here "b" is
    # used only in the first of two micro-batches, and still updated.
    params = routed_params()
    state = fdp.replicate(TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)))
    step = fdp.train_step(routed_loss, find_unused_parameters=True, accumulate_steps=2)
    first, second = routed(0, [0] * 8), routed(1, [1] * 8)
    batch = {
        k: np.concatenate(
            [first[k].reshape(8, 2, -1), second[k].reshape(8, 2, -1)], axis=1
        ).reshape(32, *first[k].shape[1:])
        for k in first
    }
    new, _ = step(state, fdp.shard_batch(batch))
    assert not np.array_equal(new.params["b"], params["b"])
    assert not np.array_equal(new.params["a"], params["a"])
