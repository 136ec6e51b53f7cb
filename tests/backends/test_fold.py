"""Dense products of n-D activations folded to 2-D (StepConfig.fold_dots)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import fdp
from fdp.backends.cpu._fold import NESTED, SHARDED, FoldCount, count_folds, fold_leading_dims
from fdp.observe._fingerprint import settings_fingerprint
from fdp.step.options._config import StepConfig


def _dots(jaxpr) -> list[tuple]:
    """(lhs shape, rhs shape, dimension numbers) of every dot_general, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes = tuple(tuple(v.aval.shape) for v in eqn.invars)
            out.append((*shapes, eqn.params["dimension_numbers"]))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _dots(getattr(sub, "jaxpr", sub))
    return out


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))


def test_weight_gradient_is_a_2d_product_equal_to_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6, 8)).astype(np.float32)
    w = (rng.normal(size=(8, 5)) / 3).astype(np.float32)
    grad = jax.grad(fold_leading_dims(_loss))
    dots = _dots(jax.make_jaxpr(grad)(w, x).jaxpr)
    assert dots and all(len(a) == 2 and len(b) == 2 for a, b, _ in dots), dots
    # Unfolded, the weight gradient contracts two dimensions of 3-D operands.
    assert any(len(a) == 3 for a, _, _ in _dots(jax.make_jaxpr(jax.grad(_loss))(w, x).jaxpr))
    x2 = x.reshape(-1, 8).astype(np.float64)
    expected = x2.T @ (1 - np.tanh(x2 @ w) ** 2)  # d/dw sum(tanh(x w)), in numpy
    np.testing.assert_allclose(grad(w, x), expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    ("spec", "x_shape", "w_shape"),
    [
        ("bsd,dhk->bshk", (2, 3, 4), (4, 2, 5)),  # DenseGeneral to heads (kernel [in, h, k])
        ("bshk,hkd->bsd", (2, 3, 2, 5), (2, 5, 4)),  # attention's output projection
        ("bsd,fd->bsf", (2, 3, 4), (5, 4)),  # a torch-layout kernel [out, in]: x @ w.T
    ],
)
def test_dense_general_products_fold_and_equal_numpy(spec, x_shape, w_shape):
    rng = np.random.default_rng(3)
    x = rng.normal(size=x_shape).astype(np.float32)
    w = (rng.normal(size=w_shape) / 3).astype(np.float32)

    def loss(w, x):
        return jnp.sum(jnp.tanh(jnp.einsum(spec, x, w)))

    grad = jax.grad(fold_leading_dims(loss))
    dots = _dots(jax.make_jaxpr(grad)(w, x).jaxpr)
    assert dots and all(len(a) == 2 and len(b) == 2 for a, b, _ in dots), dots
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    g = 1 - np.tanh(np.einsum(spec, x64, w64)) ** 2  # d sum(tanh(y)) / dy, in numpy
    ins, out = spec.split("->")
    x_spec, w_spec = ins.split(",")
    expected = np.einsum(f"{x_spec},{out}->{w_spec}", x64, g)
    np.testing.assert_allclose(grad(w, x), expected, rtol=2e-5, atol=2e-6)


def test_values_and_outputs_structure_are_kept():
    def fn(params, batch):
        h = batch["x"] @ params["w"] + params["b"]
        return {"loss": jnp.mean(h**2), "h": h}, None

    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "b": jnp.ones(2)}
    batch = {"x": jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)}
    got = fold_leading_dims(fn)(params, batch)
    want = fn(params, batch)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        # batch dimensions (attention scores): left as written
        (lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), ((2, 3, 4), (2, 5, 4))),
        # a 2-D left operand: already a matrix product
        (lambda x, w: x @ w, ((6, 4), (4, 3))),
        # contracting a leading dimension: not a dense layer
        (lambda x, w: jnp.einsum("bsd,bf->sdf", x, w), ((2, 3, 4), (2, 5))),
    ],
)
def test_other_products_are_left_alone(fn, args):
    arrays = [jnp.ones(s) for s in args]
    assert _dots(jax.make_jaxpr(fold_leading_dims(fn))(*arrays).jaxpr) == _dots(
        jax.make_jaxpr(fn)(*arrays).jaxpr
    )


def test_products_inside_a_nested_jit_are_folded():
    inner = jax.jit(lambda x, w: jnp.tanh(x @ w))
    fn = fold_leading_dims(lambda w, x: inner(x, w).sum())
    dots = _dots(jax.make_jaxpr(jax.grad(fn))(jnp.ones((3, 4)), jnp.ones((2, 5, 3))).jaxpr)
    assert dots and all(len(a) == 2 for a, _, _ in dots)


def test_config_resolves_on_cpu_and_checks_its_type():
    assert StepConfig().bind().fold_dots is True  # the test mesh is CPU devices
    assert StepConfig(fold_dots=False).bind().fold_dots is False
    with pytest.raises(TypeError, match=r"fold_dots must be True, False or None, got 'yes'"):
        StepConfig(fold_dots="yes")  # type: ignore[arg-type]


class _Tiny(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16)(tokens)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(x)
        x = x + nn.Dense(16)(nn.gelu(nn.Dense(32)(x)))
        return nn.Dense(32)(x)


def test_step_with_folded_dots_equals_the_step_without():
    model = _Tiny()
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 32, size=(8, 6)), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    batch = {"x": tokens, "y": jnp.roll(tokens, -1, axis=1)}
    results = []
    mesh = fdp.data_mesh()
    for fold in (True, False):
        # SGD: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift
        # shared by all keys), ~1e-10 of rounding either way, which Adam would scale up
        # to ~1e-4 updates of either sign (seen on jax 0.12), comparing noise with noise.
        state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
        step = fdp.train_step(loss_fn, mesh=mesh, fold_dots=fold)
        state = fdp.replicate(state, mesh)
        hlo = step.lower(state, fdp.shard_batch(batch, mesh)).as_text()
        # Unfolded, the weight gradients of the Dense layers contract two dimensions.
        assert ("contracting_dims = [0, 1] x [0, 1]" in hlo) is not fold
        for _ in range(3):
            state, _ = step(state, fdp.shard_batch(batch, mesh))
        results.append(jax.device_get(state.params))
        # The INFO log says how many products were folded: q, k, v, out and 3 Dense: 7.
        assert step.logging_data()["fold_dots_products"] == (7 if fold else None)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *results)


def test_a_loss_with_a_sharded_sequence_runs_and_is_left_alone():
    """On main, fold_dots raised ShardingTypeError: reshape float32[2,4@s,4] -> (8,4)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "s"))  # explicit axes
    x = np.random.default_rng(4).normal(size=(4, 4, 4)).astype(np.float32)
    w0 = np.random.default_rng(5).normal(size=(4, 3)).astype(np.float32)

    def loss(p, b):
        b = jax.sharding.reshard(b, P(None, "s"))  # the sequence split over "s"
        return jnp.mean(jnp.tanh(b @ p["w"]))

    got = []
    for fold in (True, False):
        state = fdp.TrainState.create(apply_fn=None, params={"w": w0}, tx=optax.sgd(0.1))
        step = fdp.train_step(loss, mesh=mesh, fold_dots=fold)
        with jax.set_mesh(mesh):
            batch = jax.device_put(x, NamedSharding(mesh, P("data", "s")))
            new, _ = step(fdp.replicate(state, mesh), batch)
        got.append(np.asarray(new.params["w"]))
        data = step.logging_data()  # the INFO log's fields
        want = (0, {SHARDED: 1}) if fold else (None, None)
        assert (data["fold_dots_products"], data["fold_dots_left"]) == want
    # numpy, one device, the whole batch: d mean(tanh(x w)) / dw
    x2 = x.reshape(-1, 4).astype(np.float64)
    grad = x2.T @ (1 - np.tanh(x2 @ w0) ** 2) / (x2.shape[0] * 3)
    for params in got:
        np.testing.assert_allclose(params, w0 - 0.1 * grad, rtol=1e-5, atol=1e-6)


def test_count_folds_names_what_it_left():
    def fn(w, x):
        h = jnp.tanh(x @ w)  # folded
        h = jax.checkpoint(lambda h: jnp.tanh(h @ w))(h)  # not entered
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, length=2)[0].sum()

    count = count_folds(fn, jnp.ones((4, 4)), jnp.ones((2, 3, 4)))
    assert count == FoldCount(folded=1, left=((NESTED, 2),))


class _ScannedMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        def block(mdl, h, _):
            return nn.tanh(nn.Dense(8)(h)), None

        scan = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan(self, x, None)[0].sum(-1)


def test_a_loss_with_nothing_to_fold_is_not_rewritten(monkeypatch):
    """On main the scanned loss was traced to a jaxpr and evaluated again, for nothing."""
    from fdp.step.core import _core

    rewritten = []
    monkeypatch.setattr(
        _core, "fold_leading_dims", lambda f: rewritten.append(f) or fold_leading_dims(f)
    )
    model = _ScannedMLP()
    x = np.random.default_rng(6).normal(size=(8, 5, 8)).astype(np.float32)
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(params, batch):
        return jnp.mean(model.apply({"params": params}, batch) ** 2)

    assert count_folds(loss_fn, params, x) == FoldCount(0, ((NESTED, 1),))
    step = fdp.train_step(loss_fn, fold_dots=True)
    state = fdp.replicate(TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)))
    new, _ = step(state, fdp.shard_batch(x))
    assert step.logging_data()["fold_dots_products"] == 0 and rewritten == []
    ref = jax.grad(loss_fn)(params, x)  # plain JAX, one device, the whole batch
    jax.tree.map(
        lambda n, p, g: np.testing.assert_allclose(n, p - 0.1 * g, rtol=1e-5, atol=1e-6),
        jax.device_get(new.params),
        params,
        ref,
    )
    # The control: a dense product outside the scan is folded, so the loss is rewritten.
    step = fdp.train_step(
        lambda p, b: loss_fn(p, b) + jnp.mean(b @ jnp.ones((8, 3))), fold_dots=True
    )
    step(
        fdp.replicate(TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))),
        fdp.shard_batch(x),
    )
    assert len(rewritten) == 1 and step.logging_data()["fold_dots_products"] == 1
    # The DETAIL fingerprint carries the count, beside the setting.
    fingerprint = settings_fingerprint("fdp.train_step", step.config, step.step_plan, {})
    assert fingerprint["fold_dots"] is True and fingerprint["fold_dots products"] == 1
