"""Buckets follow the order the backward pass completes gradients, as DDP's rebuilt buckets do.

Flax sorts module names, so the reverse of ``jax.tree.leaves`` puts a GPT's token
embedding (its gradient finishes last) in the first bucket and ``Block_10`` before
``Block_2``. The step reads the ready order from ``jax.grad``'s program instead.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import fdp
from fdp.bucketing import plan_for
from fdp.step.grads._ready import ready_order


class Tower(nn.Module):
    """An embedding, 12 blocks (Block_10 sorts before Block_2) and a head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 16)(tokens)
        for i in range(12):
            x = x + nn.Dense(16, name=f"Block_{i}")(jnp.tanh(x))
        return nn.Dense(64, name="head")(x)


def loss_fn(params, batch):
    logits = Tower().apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def shapes():
    params = jax.eval_shape(
        lambda: Tower().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    )
    batch = {"x": jnp.zeros((8, 4), jnp.int32), "y": jnp.zeros((8, 4), jnp.int32)}
    return params, batch


def modules(params, order):
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    names = [paths[i].split("'")[1] for i in order]
    return list(dict.fromkeys(names))  # each module once, in order


def test_ready_order_is_the_backward_pass_not_the_sorted_names():
    params, batch = shapes()
    order = ready_order(loss_fn, params, batch)
    assert sorted(order) == list(range(len(jax.tree.leaves(params))))
    want = ["head", *[f"Block_{i}" for i in reversed(range(12))], "Embed_0"]
    assert modules(params, order) == want
    # The reverse of the leaves (DDP's initial order) is the sorted names, reversed.
    assert modules(params, range(len(order) - 1, -1, -1))[:3] == ["head", "Embed_0", "Block_9"]


def test_a_jitted_loss_orders_as_the_plain_one():
    params, batch = shapes()
    assert ready_order(jax.jit(loss_fn), params, batch) == ready_order(loss_fn, params, batch)


def test_the_step_buckets_in_ready_order_and_trains_as_before():
    params = Tower().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    state = fdp.replicate(fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)))
    tokens = jax.random.randint(jax.random.key(1), (16, 4), 0, 64)
    batch = fdp.shard_batch({"x": tokens, "y": jnp.roll(tokens, 1, axis=1)})
    step = fdp.train_step(loss_fn, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)
    new, metrics = step(state, batch)
    plan = step.plan
    first = {p.split("'")[1] for p in plan.buckets[0].key_paths}
    last = {p.split("'")[1] for p in plan.buckets[-1].key_paths}
    assert "head" in first and "Embed_0" in last
    # The plan is DDP's assignment over the ready order, nothing else changed.
    want = plan_for(
        params, 0.004, 0.002, order=ready_order(loss_fn, params, {"x": tokens, "y": tokens})
    )
    assert plan == want
    # One device on the whole batch: the same step (independent of the plan).
    grads = jax.grad(loss_fn)(params, {"x": tokens, "y": jnp.roll(tokens, 1, axis=1)})
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    chex.assert_trees_all_close(jax.device_get(new.params), expected, rtol=1e-5, atol=1e-6)
    assert metrics["loss"].shape == ()


def test_a_hook_with_state_keeps_the_first_plan():
    # PowerSGD's state is shaped by the buckets and may be made before any batch
    # (step.init, a checkpoint template): the plan stays the reverse of the leaves.
    params = Tower().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    state = fdp.replicate(fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)))
    tokens = jnp.zeros((16, 4), jnp.int32)
    batch = fdp.shard_batch({"x": tokens, "y": tokens})
    hook = fdp.hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)
    step = fdp.train_step(loss_fn, comm_hook=hook, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)
    step(state, batch)
    assert step.plan == plan_for(params, 0.004, 0.002)
