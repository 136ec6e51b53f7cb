"""Comm hooks against numpy re-implementations of their math, on 8 devices."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _hook_harness import N, bucket_flat, make_grads, run_hook, split_flat
from _models import cross_entropy, make_data, make_state

import fdp
from fdp import hooks

SHAPES = {"kernel": (24, 16), "bias": (16,), "conv": (3, 3, 2, 4), "scale": ()}


def plan_of(grads, cap_mb=25.0):
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), grads)
    return fdp.plan_buckets(local, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb)


def assert_same_on_every_device(tree):
    for leaf in jax.tree.leaves(tree):
        for d in range(1, N):
            np.testing.assert_array_equal(leaf[d], leaf[0])


@pytest.mark.parametrize("layout", ["leaves", "flat"])
def test_allreduce_is_the_mean(layout):
    grads = make_grads(0, SHAPES)
    (out,), _ = run_hook(hooks.allreduce(), [grads], plan_of(grads, 1e-4), layout)
    assert_same_on_every_device(out)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[0], out), jax.tree.map(lambda g: g.mean(0), grads), rtol=1e-6
    )


def test_noop_returns_each_devices_own_gradient():
    grads = make_grads(1, SHAPES)
    (out,), _ = run_hook(hooks.noop(), [grads], plan_of(grads))
    chex.assert_trees_all_equal(out, grads)


@pytest.mark.parametrize(
    ("hook", "low", "ulp"),
    [
        (hooks.fp16_compress(), np.float16, 2.0**-10),
        (hooks.bf16_compress(), ml_dtypes.bfloat16, 2.0**-7),
        (hooks.bf16_compress_wrapper(hooks.allreduce()), ml_dtypes.bfloat16, 2.0**-7),
    ],
    ids=["fp16", "bf16", "bf16-wrapper"],
)
@pytest.mark.parametrize("layout", ["leaves", "flat"])
def test_low_precision_compression(hook, low, ulp, layout):
    grads = make_grads(2, SHAPES)
    (out,), _ = run_hook(hook, [grads], plan_of(grads), layout)
    assert_same_on_every_device(out)
    for name, g in grads.items():
        # Cast down and divide in low precision; then XLA:CPU sums float16 in
        # float16, in rank order, but promotes a bfloat16 all-reduce to float32.
        part = (g.astype(low) / np.asarray(N, low)).astype(low)
        if low == np.float16:
            total = part[0]
            for r in range(1, N):
                total = (total + part[r]).astype(low)
        else:
            total = part.astype(np.float32).sum(0).astype(low)
        want = total.astype(np.float32)
        assert out[name].dtype == np.float32
        np.testing.assert_allclose(out[name][0], want, rtol=ulp, atol=ulp * 1e-3)
        assert np.mean(out[name][0] == want) > 0.95
        np.testing.assert_allclose(out[name][0], g.mean(0), rtol=4 * ulp, atol=4 * ulp)


EPS = np.finfo(np.float32).eps


def np_qparams(x, axis=None):
    lo = np.minimum(x.min(axis=axis), 0).astype(np.float32)
    hi = np.maximum(x.max(axis=axis), 0).astype(np.float32)
    scale = np.maximum((hi - lo) / np.float32(255), EPS).astype(np.float32)
    return scale, np.clip(-np.round(lo / scale), 0, 255).astype(np.float32)


def np_dequantized(x, scale, zero):
    q = np.clip(np.round(x / scale) + zero, 0, 255).astype(np.uint8)
    return scale * (q.astype(np.float32) - zero)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_quantization_matches_numpy_within_its_rounding_bound(per_channel):
    grads = make_grads(3, {"a": (40, 30), "b": (30,), "c": (7,)})
    plan = plan_of(grads)
    hook = (
        hooks.quantize_per_channel(bucket_size=64) if per_channel else hooks.quantize_per_tensor()
    )
    (out,), _ = run_hook(hook, [grads], plan)
    assert_same_on_every_device(out)
    (bucket,) = plan.buckets
    flat = bucket_flat(grads, bucket)  # [N, size]
    total, half_steps = 0.0, 0.0
    for r in range(N):
        x = flat[r]
        if per_channel:
            rows = np.pad(x, (0, 64 - x.size % 64)).reshape(-1, 64)
            scale, zero = np_qparams(rows, axis=1)
            deq = np_dequantized(rows, scale[:, None], zero[:, None]).reshape(-1)[: x.size]
            step = np.repeat(scale, 64)[: x.size]
        else:
            scale, zero = np_qparams(x)
            deq, step = np_dequantized(x, scale, zero), np.full(x.size, scale)
        total, half_steps = total + deq, half_steps + step / 2
    want = total / N
    got = np.concatenate([out[k][0].reshape(-1) for k in ("c", "b", "a")])
    # Equal to numpy up to a rare round-half tie landing on the other level.
    mismatch = ~np.isclose(got, want, rtol=1e-6, atol=1e-7)
    assert mismatch.mean() < 1e-3
    np.testing.assert_array_less(np.abs(got - want), half_steps * 2 / N + 1e-6)
    # The bound of the method: within half a quantization step (averaged) of the mean.
    np.testing.assert_array_less(np.abs(got - flat.mean(0)), half_steps / N + 1e-6)
    split = split_flat(got, bucket)
    np.testing.assert_array_equal(split[2], out["a"][0])


def test_hook_result_of_the_wrong_shape_or_dtype_is_a_clear_error():
    grads = make_grads(4, {"w": (4, 3), "b": (3,)})

    def bad_dtype(state, bucket):
        return bucket.buffer.astype(jnp.float16), state

    def bad_len(state, bucket):
        return list(bucket.gradients)[:1], state

    def bad_type(state, bucket):
        return {"x": 1}, state

    plan = plan_of(grads)
    for fn, error, match in [
        (bad_dtype, ValueError, r"'bad' returned float16\[15\] for bucket 0; expected the flat"),
        (bad_len, ValueError, r"returned \[float32\[4, 3\]\] for bucket 0; .* one array per"),
        (bad_type, TypeError, "returned dict for bucket 0"),
    ]:
        hook = hooks.CommHook("bad", lambda p, pl: (), fn)
        with pytest.raises(error, match=match):
            run_hook(hook, [grads], plan)


def test_bad_configuration_is_a_clear_error():
    init = make_state("mlp", "sgd")
    loss_fn = cross_entropy(init.apply_fn)
    with pytest.raises(ValueError, match="comm_hook='bf16' is not a known hook; known names: "):
        fdp.train_step(loss_fn, comm_hook="bf16")
    with pytest.raises(TypeError, match="comm_hook must be a fdp.hooks.CommHook"):
        fdp.train_step(loss_fn, comm_hook=42)
    with pytest.raises(ValueError, match="matrix_approximation_rank must be an integer >= 1"):
        hooks.powersgd(matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="start_powersgd_iter must be > 1 when use_error_feedback"):
        hooks.powersgd(start_powersgd_iter=1)
    with pytest.raises(ValueError, match="bucket_size must be a positive integer"):
        hooks.quantize_per_channel(bucket_size=0)
    with pytest.raises(ValueError, match="period must be an integer >= 1"):
        hooks.PeriodicModelAverager(period=0)
    with pytest.raises(TypeError, match="fp16_compress_wrapper needs a CommHook"):
        hooks.fp16_compress_wrapper("allreduce")
    step = fdp.train_step(loss_fn, comm_hook=hooks.powersgd(start_powersgd_iter=2))
    with pytest.raises(
        TypeError,
        match="keeps state between steps; use fdp.TrainState .* "
        "instead of flax.training.train_state.TrainState",
    ):
        step(fdp.replicate(init), fdp.shard_batch(make_data(0, 16)))


# shm_allreduce sums across processes (one device each): it trains in
# tests/runtime/test_shm_allreduce.py, and refuses this 8-device process there.
IN_ONE_PROCESS = sorted(set(hooks.HOOKS) - {"shm_allreduce"})


@pytest.mark.parametrize("name", IN_ONE_PROCESS)
def test_every_named_hook_trains_a_step(name):
    init = make_state("mlp", "adam")
    state = fdp.replicate(
        fdp.TrainState.create(apply_fn=init.apply_fn, params=init.params, tx=init.tx)
    )
    step = fdp.train_step(cross_entropy(init.apply_fn), comm_hook=name)
    for seed in range(2):
        state, metrics = step(state, fdp.shard_batch(make_data(seed, 16)))
    assert np.isfinite(float(metrics["loss"]))
    assert int(np.max(state.step)) == 2
