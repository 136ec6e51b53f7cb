"""Compressed reductions (all-to-all, f32 sum, all-gather) and ``reduce_dtype``.

Errors are checked against numpy's float64 mean; bytes are read from the lowered
StableHLO (what fdp emits, before XLA:CPU promotes 16-bit collectives to f32).
"""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _models import MLP, cross_entropy, make_data, make_state
from jax.sharding import PartitionSpec as P

import fdp
from fdp.bucketing import plan_for
from fdp.hooks._compressed import compressed_mean, wire_ratio
from fdp.observe._hlo import collective_stats
from fdp.step.options._config import StepConfig

N = 8
MESH = fdp.data_mesh()


def mean_over_devices(xs, **kwargs):
    """compressed_mean of per-device rows ``xs`` [N, size], as every device got it."""

    def local(x):
        return compressed_mean(x[0], "data", **kwargs)[0][None]

    fn = jax.shard_map(local, mesh=MESH, in_specs=P("data"), out_specs=P("data"))
    return np.asarray(jax.jit(fn)(xs))


def int8_bound(xs, block=256):
    """Worst error of the int8 path: half a step of each device's block, then of the sum's."""
    n, size = xs.shape
    y = xs / n
    chunk = -(-size // n)
    chunk = -(-chunk // block) * block
    padded = np.zeros((n, n * chunk))
    padded[:, :size] = y
    blocks = np.abs(padded).reshape(n, -1, block).max(axis=2) / 127 / 2  # per device, per block
    first = blocks.sum(axis=0)  # the N encodings of a block add up
    total = np.abs(padded.sum(axis=0)).reshape(-1, block).max(axis=1) + first
    second = total / 127 / 2
    return np.repeat(first + second, block)[:size]


def test_int8_mean_is_within_half_a_step_of_each_encoding():
    xs = np.random.default_rng(0).normal(size=(N, 5000)).astype(np.float32)
    got = mean_over_devices(jnp.asarray(xs), encoding="int8")
    want = xs.astype(np.float64).mean(axis=0)
    err = np.abs(got - want)
    assert (got == got[0]).all()  # every device has the same mean
    assert (err <= int8_bound(xs.astype(np.float64)) + 1e-7).all()
    assert err.max() > 1e-5  # it was compressed


@pytest.mark.parametrize("encoding", ["bfloat16", "float16"])
def test_16_bit_means_round_once_per_encoding_and_sum_in_f32(encoding):
    xs = np.random.default_rng(1).normal(size=(N, 3001)).astype(np.float32)
    got = mean_over_devices(jnp.asarray(xs), encoding=encoding)
    low = ml_dtypes.bfloat16 if encoding == "bfloat16" else np.float16
    # numpy: encode each device's share, sum in f32, encode the sum.
    want = (xs / N).astype(low).astype(np.float32).sum(axis=0).astype(low).astype(np.float32)
    np.testing.assert_allclose(got[0], want, rtol=0, atol=1e-6)


def test_error_feedback_keeps_the_error_from_accumulating():
    x = np.random.default_rng(2).normal(size=(N, 4096)).astype(np.float32)
    want = x.astype(np.float64).mean(axis=0)

    def local(x, r):
        mean, res = compressed_mean(x[0], "data", encoding="int8", residual=r[0])
        return mean[None], res[None]

    step = jax.jit(
        jax.shard_map(local, mesh=MESH, in_specs=(P("data"), P("data")), out_specs=P("data"))
    )
    plain = mean_over_devices(jnp.asarray(x), encoding="int8")
    residual = jnp.zeros_like(jnp.asarray(x))
    total = np.zeros(4096)
    steps = 50
    for _ in range(steps):
        mean, residual = step(jnp.asarray(x), residual)
        total += np.asarray(mean)[0]
    one_step = np.abs(plain[0] - want).max()
    # Without feedback the same gradient makes the same error every step: it adds up.
    assert np.abs(steps * plain[0] - steps * want).max() > 10 * one_step
    assert np.abs(total - steps * want).max() <= 2 * one_step


def lowered_ops(hook, **kwargs):
    state = fdp.replicate(make_state("mlp", "sgd"))
    batch = fdp.shard_batch(make_data(0, 32))
    step = fdp.train_step(cross_entropy(MLP().apply), comm_hook=hook, **kwargs)
    return collective_stats(step.lower(state, batch)).ops


def sent(ops):
    return sum(op.sent_bytes for op in ops if op.shapes != ((),))  # leave out the loss


@pytest.mark.parametrize(
    ("encoding", "limit"), [("int8", 0.30), ("bfloat16", 0.55), ("float16", 0.55)]
)
def test_bytes_on_the_wire_against_the_f32_all_reduce(encoding, limit):
    base = sent(lowered_ops("allreduce"))
    ops = lowered_ops(fdp.hooks.compressed_allreduce(encoding))
    assert {op.kind for op in ops if op.shapes != ((),)} == {"all-to-all", "all-gather"}
    ratio = sent(ops) / base
    assert ratio <= limit
    sizes = [b.size for b in plan_for(make_state("mlp", "sgd").params).buckets]
    predicted = sum(wire_ratio(encoding, s, N) * s for s in sizes) / sum(sizes)
    assert ratio == pytest.approx(predicted, rel=0.02)


def test_torch_all_gather_hooks_send_as_much_as_the_f32_all_reduce_on_8_devices():
    base = sent(lowered_ops("allreduce"))
    assert sent(lowered_ops("quantize_per_tensor")) / base > 0.85


@pytest.mark.parametrize("error_feedback", [False, True])
def test_training_with_int8_stays_close_to_the_exact_step(error_feedback):
    data = make_data(3, 32 * 4)
    hook = fdp.hooks.compressed_allreduce("int8", error_feedback=error_feedback)
    exact = fdp.train_step(cross_entropy(MLP().apply))
    step = fdp.train_step(cross_entropy(MLP().apply), comm_hook=hook)
    start = make_state("mlp", "sgd")
    a = fdp.replicate(start)
    b = fdp.replicate(fdp.TrainState.create(apply_fn=None, params=start.params, tx=start.tx))
    for i in range(4):
        batch = fdp.shard_batch({k: v[32 * i : 32 * (i + 1)] for k, v in data.items()})
        a, _ = exact(a, batch)
        b, _ = step(b, batch)
    chex.assert_trees_all_close(jax.device_get(b.params), jax.device_get(a.params), atol=2e-3)
    assert (b.comm_state is not None) == error_feedback


def test_reduce_dtype_float32_sums_bfloat16_gradients_once():
    """bf16 gradients on 8 devices: a bf16 running sum rounds at every addition."""
    # 1 + 2^-8 is not a bf16 number: added one by one in bf16, the small parts vanish.
    g = np.full((N, 512), 2.0**-9, np.float64)
    g[0] = 1.0
    grads = jnp.asarray(g, jnp.bfloat16)
    want = g.mean(axis=0).astype(ml_dtypes.bfloat16)
    running = np.zeros(512, ml_dtypes.bfloat16)
    for row in (g / N).astype(ml_dtypes.bfloat16):
        running = (running + row).astype(ml_dtypes.bfloat16)
    assert (running != want).all()  # the failure the option exists for

    hook = StepConfig(reduction=fdp.Reduction(reduce_dtype=jnp.float32), mesh=MESH).bind().hook

    def local(x):
        reduced, _ = fdp.hooks.reduce_with_hook(hook, (), {"g": x[0]}, axis_name="data")
        return reduced["g"][None]

    fn = jax.jit(
        jax.shard_map(local, mesh=MESH, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    got = np.asarray(fn(grads))
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got[0], want)
    ops = collective_stats(jax.jit(fn).lower(grads)).ops
    assert [op.dtypes for op in ops] == [("f32",)]


def test_reduce_dtype_bfloat16_sends_bf16_and_sums_in_f32():
    ops = lowered_ops(None, reduce_dtype=jnp.bfloat16)
    assert {d for op in ops if op.shapes != ((),) for d in op.dtypes} == {"bf16"}
    assert {op.kind for op in ops if op.shapes != ((),)} == {"all-to-all", "all-gather"}


def test_reduce_dtype_is_checked_where_the_step_is_built():
    with pytest.raises(ValueError, match="reduce_dtype must be a floating dtype"):
        fdp.train_step(lambda p, b: 0.0, reduce_dtype=jnp.int32)
    with pytest.raises(ValueError, match="sets the dtype of the default mean all-reduce"):
        fdp.train_step(lambda p, b: 0.0, reduce_dtype=jnp.float32, comm_hook="powersgd")
