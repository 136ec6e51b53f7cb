"""Uneven inputs: padded and masked batches, Join, and DataParallel inference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_data, make_state

import fdp


def per_example(apply_fn):
    def loss_fn(params, batch):
        logits = apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    return loss_fn


def reference(init, batches):
    """One device, the mean loss over exactly the real examples of each step."""
    loss_fn = lambda p, b: per_example(init.apply_fn)(p, b).mean()  # noqa: E731
    state = jax.device_put(init, jax.devices()[0])
    for batch in batches:
        state = state.apply_gradients(grads=jax.grad(loss_fn)(state.params, batch))
    return state


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_thirteen_examples_on_eight_devices(opt):
    init = make_state("mlp", opt)
    batches = [make_data(s, 13) for s in range(2)]
    want = reference(init, batches)
    step = fdp.train_step(per_example(init.apply_fn), per_example=True)
    state = fdp.replicate(init)
    for batch in batches:  # an unplaced 13-row batch: padded to 16 and masked inside
        state, metrics = step(state, batch)
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.opt_state, want.opt_state, rtol=1e-5, atol=1e-6)
    ref_loss = per_example(init.apply_fn)(want.params, batches[0]).mean()
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(ref_loss))


def test_mask_weighs_examples():
    init = make_state("mlp", "sgd")
    batch = make_data(0, 16)
    keep = np.array([1, 0] * 8, np.float32)
    want = reference(init, [jax.tree.map(lambda x: x[keep > 0], batch)])
    step = fdp.train_step(per_example(init.apply_fn), per_example=True)
    state, _ = step(fdp.replicate(init), fdp.shard_batch(batch), mask=fdp.shard_batch(keep))
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)


def device_stream(data, start, length, size=2):
    for i in range(start, start + length, size):
        yield {k: v[i : min(i + size, start + length)] for k, v in data.items()}


@pytest.mark.slow
def test_devices_that_run_out_early_take_part_with_zero_weight():
    lengths = [5, 3, 0, 8, 2, 6, 1, 4]
    starts = np.cumsum([0, *lengths[:-1]])
    data = make_data(0, sum(lengths))
    init = make_state("mlp", "adam")
    streams = [device_stream(data, s, n) for s, n in zip(starts, lengths, strict=True)]
    like = {k: v[:2] for k, v in data.items()}
    # The mean over the real examples of each step: torch's Join with
    # divide_by_initial_world_size=False when batches are full (torch's default, True,
    # is checked against its formula in tests/step/test_weighting.py).
    step = fdp.train_step(
        per_example(init.apply_fn), per_example=True, divide_by_initial_world_size=False
    )
    state, steps, real = fdp.replicate(init), 0, []
    for batch, mask in fdp.join(*streams, batch_size=2, like=like):
        state, _ = step(state, fdp.shard_batch(batch), mask=fdp.shard_batch(mask))
        real.append({k: v[mask > 0] for k, v in batch.items()})
        steps += 1
    assert steps == 4  # the longest stream: 8 examples, 2 per step
    assert [len(r["y"]) for r in real] == [13, 9, 5, 2]  # 29 = sum(lengths)
    want = reference(init, real)
    chex.assert_trees_all_close(state.params, want.params, rtol=1e-5, atol=1e-6)


def test_join_can_raise_on_early_termination_instead():
    data = make_data(0, 6)
    streams = [device_stream(data, 0, 2), device_stream(data, 2, 4)]
    it = fdp.join(*streams, batch_size=2, throw_on_early_termination=True)
    next(it)
    with pytest.raises(RuntimeError, match=r"at step 1 participants ran out of data.*\[0\]"):
        next(it)


def test_join_shapes_an_empty_participant_after_the_others():
    data = make_data(0, 3)
    ((batch, mask),) = list(fdp.join(iter([]), device_stream(data, 0, 3, size=3), batch_size=3))
    assert batch["x"].shape == (6, 8, 8, 1) and mask.tolist() == [0, 0, 0, 1, 1, 1]
    assert list(fdp.join(iter([]), batch_size=2)) == []


@pytest.mark.parametrize("size", [13, 37, 8])
def test_data_parallel_inference_with_uneven_batches(size):
    init = make_state("cnn", "sgd")
    x = make_data(3, size)["x"]
    apply = fdp.data_parallel(lambda p, b: init.apply_fn({"params": p}, b))
    out = apply(init.params, x)
    assert out.shape == (size, 10)
    np.testing.assert_allclose(out, init.apply_fn({"params": init.params}, x), rtol=1e-5, atol=1e-6)


def test_data_parallel_passes_more_arguments_whole_to_every_device():
    init = make_state("cnn", "sgd")
    x = make_data(3, 13)["x"]

    def scaled(p, b, temperature, bias):  # a sampler's temperature, a table: not split
        return init.apply_fn({"params": p}, b) / temperature + bias

    apply = fdp.data_parallel(scaled)
    bias = jnp.arange(10.0)
    out = apply(init.params, x, jnp.float32(2.0), bias)
    want = init.apply_fn({"params": init.params}, x) / 2.0 + bias
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_bad_uneven_input_is_a_clear_error():
    init = make_state("mlp", "sgd")
    mean_loss = lambda p, b: per_example(init.apply_fn)(p, b).mean()  # noqa: E731
    with pytest.raises(ValueError, match="mask= weighs examples and needs per_example=True"):
        fdp.train_step(mean_loss, donate=False)(init, make_data(0, 16), mask=np.ones(16))
    with pytest.raises(ValueError, match=r"or per_example=True to pad and mask an uneven batch"):
        fdp.train_step(mean_loss, donate=False)(init, make_data(0, 13))
    with pytest.raises(TypeError, match=r"one float loss per example .*\[2\]; got float32\[\]"):
        fdp.train_step(mean_loss, per_example=True, donate=False)(init, make_data(0, 16))
    with pytest.raises(ValueError, match="the batch has 3 rows, more than size=2"):
        fdp.pad_batch(jnp.zeros((3, 2)), 2)
