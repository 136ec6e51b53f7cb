"""fdp.ddp: your own step, data-parallel, equals the same step on one device on the whole batch."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _procs import run
from flax import nnx
from flax.training.train_state import TrainState

import fdp

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 6)).astype(np.float32)
Y = RNG.integers(0, 4, size=32).astype(np.int32)
# The batch is the last argument of every step below (apply_model takes two: images, labels).
DDP_LAST = functools.partial(fdp.ddp, batch_argnums=-1)
DDP_LINEN = functools.partial(fdp.ddp, batch_argnums=(1, 2))


def linen_steps(decorate, reduce):
    """The Linen MNIST example's shape: apply_model returns grads, loss, accuracy."""

    @decorate
    def apply_model(state, images, labels):
        def loss_fn(params):
            logits = images @ params["w"] + params["b"]
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads = reduce(grads)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return grads, loss, accuracy, logits

    @jax.jit
    def update_model(state, grads):
        return state.apply_gradients(grads=grads)

    return apply_model, update_model


def linen_run(decorate, reduce):
    apply_model, update_model = linen_steps(decorate, reduce)
    params = {"w": jnp.asarray(RNG.normal(size=(6, 4)), jnp.float32), "b": jnp.zeros(4)}
    state = TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1, 0.9))
    outs = []
    for i in range(2):
        grads, loss, accuracy, logits = apply_model(
            state, X[i * 16 : (i + 1) * 16], Y[i * 16 :][:16]
        )
        state = update_model(state, grads)
        outs.append((loss, accuracy, logits))
    return state.params, outs


def test_linen_step_matches_one_device_on_the_whole_batch():
    """On main there is no fdp.ddp: the step had to be rewritten for fdp.train_step."""
    RNG.bit_generator.state = np.random.default_rng(1).bit_generator.state
    ref_params, ref = linen_run(jax.jit, lambda g: g)
    RNG.bit_generator.state = np.random.default_rng(1).bit_generator.state
    params, got = linen_run(DDP_LINEN, fdp.reduce_gradients)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
    for (loss, acc, logits), (rl, ra, rlog) in zip(got, ref, strict=True):
        np.testing.assert_allclose(loss, rl, rtol=1e-5)
        assert float(acc) == float(ra)
        assert logits.shape == (16, 4)  # gathered along the batch, in order
        np.testing.assert_allclose(logits, rlog, rtol=1e-5, atol=1e-5)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def nnx_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits


def nnx_steps(decorate, reduce):
    """The NNX tutorial's shape: metrics updated inside the step, in place."""

    @decorate
    def train_step(model, optimizer, metrics, batch):
        (loss, logits), grads = nnx.value_and_grad(nnx_loss, has_aux=True)(model, batch)
        grads = reduce(grads)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])
        optimizer.update(model, grads)

    @decorate
    def eval_step(model, metrics, batch):
        loss, logits = nnx_loss(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])

    return train_step, eval_step


def nnx_run(decorate, reduce):
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    train_step, eval_step = nnx_steps(decorate, reduce)
    for i in range(2):
        train_step(model, optimizer, metrics, {"x": X[i * 16 :][:16], "y": Y[i * 16 :][:16]})
    train = {k: float(v) for k, v in metrics.compute().items()}
    metrics.reset()
    eval_step(model, metrics, {"x": X, "y": Y})
    test = {k: float(v) for k, v in metrics.compute().items()}
    return nnx.to_pure_dict(nnx.state(model, nnx.Param)), train, test, int(optimizer.step[...])


def test_nnx_step_with_metrics_inside_matches_one_device():
    ref_params, ref_train, ref_test, ref_steps = nnx_run(nnx.jit, lambda g: g)
    params, train, test, steps = nnx_run(DDP_LAST, fdp.reduce_gradients)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
    assert steps == ref_steps == 2
    for got, want in ((train, ref_train), (test, ref_test)):
        assert got.keys() == want.keys()
        for k in got:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)


def test_nnx_rngs_passed_as_an_argument_draw_per_device_masks():
    """The official tutorial's pattern; on main, nnx_train_step raised TraceContextError."""
    rngs = nnx.Rngs(dropout=1)
    drop = nnx.Dropout(0.5)

    @fdp.ddp(batch_argnums=1)
    def masks(rngs, x):
        return drop(x, rngs=rngs)

    out = np.asarray(masks(rngs, jnp.ones((16, 64))))
    assert out.shape == (16, 64)
    per_device = out.reshape(8, 2, 64)
    assert not np.array_equal(per_device[0], per_device[1])  # each device its own masks
    assert int(rngs.dropout.count[...]) == 1  # the stream advanced once, as under nnx.jit


def test_forgetting_reduce_gradients_is_an_error():
    train_step, _ = nnx_steps(DDP_LAST, lambda g: g)
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    with pytest.raises(ValueError, match=r"never calls fdp.reduce_gradients.*Add `grads = fdp"):
        train_step(model, optimizer, metrics, {"x": X[:16], "y": Y[:16]})


def test_a_batch_that_does_not_split_names_the_argument():
    apply_model, _ = linen_steps(DDP_LINEN, fdp.reduce_gradients)
    state = TrainState.create(
        apply_fn=None, params={"w": jnp.ones((6, 4)), "b": jnp.zeros(4)}, tx=optax.sgd(0.1)
    )
    with pytest.raises(
        ValueError, match=r"argument 1 \(images\) .* shape \(12, 6\).*multiple of 8"
    ):
        apply_model(state, X[:12], Y[:12])


def test_nnx_train_step_with_captured_rngs_explains_the_fix():
    class Drop(nnx.Module):
        def __init__(self):
            self.l = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
            self.d = nnx.Dropout(0.5)

        def __call__(self, x, rngs):
            return self.d(self.l(x), rngs=rngs)

    model = Drop()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    rngs = nnx.Rngs(dropout=1)
    step = fdp.nnx_train_step(lambda m, b: jnp.mean(m(b["x"], rngs)))
    with pytest.raises(TypeError, match=r"nnx.Rngs captured from outside.*@fdp.ddp"):
        step(model, optimizer, {"x": X[:16]})


LAZY = """
import jax, jax.numpy as jnp, optax
import fdp

@fdp.ddp(batch_argnums=1)
def step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(x @ w))(w)
    return w - fdp.reduce_gradients(g), loss

apply = fdp.data_parallel(lambda w, x: x @ w)
train = fdp.train_step(lambda p, b: jnp.mean(b @ p))
jax.config.update("jax_num_cpu_devices", 4)  # raises if building the steps started JAX
w, loss = step(jnp.ones(3), jnp.ones((8, 3)))
print(jax.device_count(), apply(w, jnp.ones((6, 3))).shape, float(loss))
"""


def test_building_steps_at_module_level_starts_no_backend(marker):
    """On main, fdp.data_parallel made its mesh when built, so the config update raised."""
    out = run(["-c", LAZY], marker, timeout=120)
    assert out.returncode == 0, out.output[-3000:]
    assert "4 (6,) 3.0" in out.stdout


def test_a_comm_hook_inside_the_step():
    hook = fdp.hooks.resolve("bf16_compress")

    @fdp.ddp(batch_argnums=1)
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        g, _ = fdp.hooks.reduce_with_hook(hook, (), g, axis_name="data")
        return w - 0.1 * g, loss

    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    w, loss = step(jnp.ones(2), x)
    grad = 2 * x.T @ (x @ np.ones(2)) / 8  # numpy, the whole batch
    np.testing.assert_allclose(w, 1 - 0.1 * grad, rtol=1e-2)  # bf16 on the wire
    assert float(loss) == 309.0


def table_step(w, x, table):
    """A step with a replicated lookup table of 8 entries: 8 devices, 8 rows."""
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) * table[0]))(w)
    return w - 0.1 * fdp.reduce_gradients(g), loss, table.sum()


def test_only_the_named_arguments_are_split():
    """On main, fdp.ddp guessed batches by shape: the table was split, table.sum() was 4.5."""
    with pytest.raises(TypeError, match=r"batch_argnums is required.*table_step\(w, x, table\)"):
        fdp.ddp(table_step)
    table = jnp.arange(1.0, 9.0)
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    w, loss, total = fdp.ddp(table_step, batch_argnums=1)(jnp.ones(2), x, table)
    assert float(total) == 36.0  # every device saw the whole table
    np.testing.assert_allclose(w, 1 - 0.1 * x.mean(0), rtol=1e-6)  # numpy, the whole batch
    np.testing.assert_allclose(loss, np.mean(x @ np.ones(2)), rtol=1e-6)


@pytest.mark.parametrize(
    ("argnums", "error", "match"),
    [
        ("1", TypeError, r"batch_argnums must be an int or a tuple of ints.*got '1'"),
        (True, TypeError, r"batch_argnums must be an int or a tuple of ints.*got True"),
        ((1, 3), ValueError, r"names position 3.*called with 3 positional arguments"),
    ],
)
def test_bad_batch_argnums_are_named(argnums, error, match):
    with pytest.raises(error, match=match):
        fdp.ddp(table_step, batch_argnums=argnums)(jnp.ones(2), X[:8, :2], jnp.ones(8))


def test_batch_argnums_cannot_name_an_nnx_object():
    model = Net(nnx.Rngs(0))
    step = fdp.ddp(lambda m, x: m(x).mean(), batch_argnums=(0, 1))
    with pytest.raises(ValueError, match=r"argument 0 \(m\), an NNX object \(Net\)"):
        step(model, X[:16])


class _Config:
    """A config object as lm1b passes one (hashable by identity: jax.jit's static rule)."""

    def __init__(self, lr):
        self.lr = lr


def lm_style(reduce):
    """lm1b's train_step shape: a static config positionally, a keyword, sum metrics."""

    def lm_style_step(state, batch, config, *, decay):
        def loss_fn(params):
            logits = batch["x"] @ params["w"]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return ce.mean(), ce.sum()

        (_, total), grads = jax.value_and_grad(loss_fn, has_aux=True)(state)
        grads = reduce(grads)
        new = jax.tree.map(lambda p, g: p * (1 - decay) - config.lr * g, state, grads)
        weights = (batch["y"] >= 0).astype(jnp.float32)  # lm1b's: real tokens, from the data
        return new, {"loss": total, "denominator": weights.sum()}

    return lm_style_step


lm_style_step = lm_style(fdp.reduce_gradients)


def test_ddp_takes_static_and_keyword_arguments_and_sums_sum_metrics():
    config, decay = _Config(0.5), jnp.float32(1e-3)
    state = {"w": jnp.asarray(RNG.normal(size=(6, 4)), jnp.float32)}
    batch = {"x": X, "y": Y}
    plain = jax.jit(lm_style(lambda grads: grads), static_argnums=2)
    want_state, want = plain(state, batch, config, decay=decay)
    step = fdp.ddp(lm_style_step, batch_argnums=1, static_argnums=2, output_reduction="sum")
    got_state, got = step(state, batch, config, decay=decay)
    chex.assert_trees_all_close(got_state, want_state, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)  # 8 devices' sums added
    assert float(got["denominator"]) == 32.0
    # By name, and the default mean: the sums come back as one device's share, on average.
    by_name = fdp.ddp(lm_style_step, batch_argnums=1, static_argnames="config")
    _, mean = by_name(state, batch, config=config, decay=decay)
    np.testing.assert_allclose(mean["loss"] * 8, want["loss"], rtol=1e-6)
    per_key = fdp.ddp(
        lm_style_step,
        batch_argnums=1,
        static_argnums=2,
        output_reduction=lambda path: "sum" if "denominator" in path else "mean",
    )
    assert float(per_key(state, batch, config, decay=decay)[1]["denominator"]) == 32.0


def test_ddp_static_arguments_are_checked():
    with pytest.raises(TypeError, match="static_argnums must be an int or a tuple of ints"):
        fdp.ddp(lm_style_step, batch_argnums=1, static_argnums="config")
    with pytest.raises(ValueError, match=r"output_reduction must be one of \('mean', 'sum'\)"):
        fdp.ddp(lm_style_step, batch_argnums=1, output_reduction="max")
    step = fdp.ddp(lm_style_step, batch_argnums=1, static_argnums=2)
    with pytest.raises(TypeError, match=r"argument 2 \(config\) is static .* hashable"):
        step({"w": jnp.ones((6, 4))}, {"x": X, "y": Y}, {"lr": 0.1}, decay=0.0)


def test_ddp_replicates_the_leaves_it_is_told_to_inside_a_batch():
    def step(table, batch):  # a per-example part and a scalar beside it
        return batch["rows"] * batch["index"] + table

    rows, index = jnp.arange(32.0).reshape(16, 2), jnp.float32(3.0)
    split_all = fdp.ddp(step, batch_argnums=1)
    with pytest.raises(ValueError, match=r"\['index'\] has shape \(\).*replicated_leaves="):
        split_all(jnp.ones(2), {"rows": rows, "index": index})
    ddp = fdp.ddp(step, batch_argnums=1, replicated_leaves=lambda i, path: path == "['index']")
    got = ddp(jnp.ones(2), {"rows": rows, "index": index})
    np.testing.assert_array_equal(got, rows * 3.0 + 1.0)
