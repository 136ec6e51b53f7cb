"""A steady-state call is jit's dispatch: no Python that grows with the model, no new plan.

The first call for an input signature checks, places, plans and compiles; later
calls with that signature hand their arguments to the jitted step. A signature jit
has not seen with the last plan makes the step plan again (the traced function
refuses the old plan), so a new batch size, a new sharding or a state that is not
ready still takes the full path.
"""

from __future__ import annotations

import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fdp
from fdp.step.core import _plan


class MLP(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.tanh(nn.Dense(4)(x))
        return nn.Dense(1)(x)


class NNXMLP(nnx.Module):
    def __init__(self, depth, rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(depth)])
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.tanh(layer(x))
        return self.out(x)


def _batch(rows=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(rows, 4)).astype(np.float32), "y": np.ones((rows, 1), np.float32)}


def _python_calls(fn):
    """Python function calls made by ``fn()`` (jit's C++ dispatch makes none of its own)."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    jax.block_until_ready(out)
    return calls[0]


def _linen(depth, **kwargs):
    model = MLP(depth)
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    step = fdp.train_step(loss_fn, **kwargs)
    state = step.init(fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2)))
    return step, state, loss_fn


def _steady(call, state):
    """A function making one steady-state call (after two warm-up calls) on ``state``."""
    holder = {"state": state}

    def once():
        holder["state"], out = call(holder["state"])
        return out

    for _ in range(2):
        once()
    return once


def _linen_call(depth, rows, kwargs):
    step, state, _ = _linen(depth, **kwargs)
    batch = fdp.shard_batch(_batch(rows))
    return _steady(lambda s: step(s, batch), state)


def _nnx_call(depth, plain=False):
    """A steady call of ``step.apply`` (or, ``plain``, of jax.jit over the same split state)."""
    model = NNXMLP(depth, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    graphdef, state = step.split(model, optimizer)
    batch = fdp.shard_batch(_batch())
    if plain:  # jit's own work on this state: flattening NNX variables, comparing trees
        same = jax.jit(lambda s, b: (jax.tree.map(lambda x: x + 0, s), {"loss": b["x"].sum()}))
        return _steady(lambda s: same(s, batch), state)
    return _steady(lambda s: step.apply(graphdef, s, batch), state)


def _ddp_call(depth):
    def loss(params, x):
        for i in range(depth):
            x = jnp.tanh(x @ params[f"w{i}"])
        return jnp.mean(x**2)

    @fdp.ddp(batch_argnums=1)
    def sgd(params, batch):
        grads = fdp.reduce_gradients(jax.grad(loss)(params, batch["x"]))
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new, new

    params = fdp.replicate({f"w{i}": jnp.full((4, 4), 0.1) for i in range(depth)})
    batch = fdp.shard_batch(_batch())
    return _steady(lambda p: sgd(p, batch), params)


@pytest.mark.parametrize(
    ("rows", "kwargs"),
    [
        (8, {}),
        (8, {"sharding": fdp.Sharding(zero_stage=3)}),
        (32, {"accumulation": fdp.Accumulation(steps=4)}),
    ],
    ids=["stage0", "stage3", "accumulate4"],
)
def test_a_linen_call_costs_the_same_python_for_2_and_24_layers(rows, kwargs):
    counts = [_python_calls(_linen_call(depth, rows, kwargs)) for depth in (2, 24)]
    assert counts[0] == counts[1], counts
    assert counts[0] < 40, counts  # a handful of bookkeeping calls, not a walk of the state


def test_fdp_ddp_costs_the_same_python_for_2_and_24_layers():
    counts = [_python_calls(_ddp_call(depth)) for depth in (2, 24)]
    assert counts[0] == counts[1], counts


def test_an_nnx_split_call_costs_what_jit_costs_on_its_state_and_no_more():
    # NNX variables flatten in Python, in jit's dispatch too: fdp adds a constant.
    extra = [
        _python_calls(_nnx_call(depth)) - _python_calls(_nnx_call(depth, plain=True))
        for depth in (2, 24)
    ]
    assert extra[0] == extra[1], extra
    assert extra[0] < 40, extra


def test_new_signatures_plan_again_and_old_ones_do_not(monkeypatch):
    step, state, loss_fn = _linen(2)
    planned = []
    prepare = _plan.prepare
    monkeypatch.setattr(
        "fdp.step.front._linen.prepare", lambda *a, **k: planned.append(a[2]) or prepare(*a, **k)
    )
    small, large = fdp.shard_batch(_batch(8)), fdp.shard_batch(_batch(16, seed=1))
    params = jax.device_get(state.params)
    want = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    for batch in (small, large, small, large, small):
        host = jax.device_get(batch)
        want_loss = loss_fn(want.params, host)
        want = want.apply_gradients(grads=jax.grad(loss_fn)(want.params, host))
        state, metrics = step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-5)
    assert planned == [8, 16]  # each batch size planned once, then taken from jit's cache
    chex.assert_trees_all_close(jax.device_get(state.params), want.params, rtol=1e-5, atol=1e-6)


def test_a_state_that_is_not_ready_takes_the_full_path_after_fast_calls():
    # A stateful hook's comm_state is filled by the first path; a fresh state has none.
    step, state, _ = _linen(2, reduction=fdp.Reduction(comm_hook="powersgd"))
    batch = fdp.shard_batch(_batch())
    fresh = jax.device_get(state)
    state = fdp.TrainState.create(apply_fn=None, params=state.params, tx=optax.adam(1e-2))
    for _ in range(2):
        state, _ = step(state, batch)
    assert state.comm_state is not None
    again = fdp.TrainState.create(apply_fn=None, params=fresh.params, tx=optax.adam(1e-2))
    assert again.comm_state is None
    again, _ = step(again, batch)  # filled, not refused by jit nor run without it
    assert again.comm_state is not None


def test_a_donated_state_passed_again_is_refused_on_the_steady_path():
    step, state, _ = _linen(2)
    batch = fdp.shard_batch(_batch())
    old, _ = step(state, batch)
    step(old, batch)
    with pytest.raises(RuntimeError, match="donated to an earlier step"):
        step(old, batch)
    model = NNXMLP(2, nnx.Rngs(0))
    nstep = fdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    graphdef, first = nstep.split(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    second, _ = nstep.apply(graphdef, first, batch)
    nstep.apply(graphdef, second, batch)
    with pytest.raises(RuntimeError, match="donated to an earlier step"):
        nstep.apply(graphdef, first, batch)


# One device: jax 0.10's multi-device CPU mesh bounds the steps in flight, a per-call
# task that keeps its steps off the program-alone path; one device needs nothing per call.
def _one_device():
    return fdp.data_mesh(jax.devices()[:1])


def _jit_call(depth):
    """A steady call of plain jit doing the Linen step's work on the same kind of state."""
    _, state, loss_fn = _linen(depth, mesh=_one_device())

    @jax.jit
    def plain(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}

    batch = _batch()
    return _steady(lambda s: plain(s, batch), jax.device_get(state))


def test_a_steady_call_needing_nothing_else_is_its_program_alone():
    """No Python of fdp's beyond the call itself: what jit's own call costs, plus a frame
    for the step's ``__call__`` and one for ``jax.stages.Compiled.__call__``."""
    mesh = _one_device()
    step, state, _ = _linen(2, mesh=mesh)
    batch = fdp.shard_batch(_batch(), mesh=mesh)
    linen = _python_calls(_steady(lambda s: step(s, batch), state))
    assert linen <= _python_calls(_jit_call(2)) + 2, linen
    model = NNXMLP(2, nnx.Rngs(0))
    nstep = fdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), mesh=mesh)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, nstate = nstep.split(model, optimizer)
    kept = jax.device_get(nstate)  # the step donates its state; jit gets a copy
    nnx_calls = _python_calls(_steady(lambda s: nstep.apply(graphdef, s, batch), nstate))
    same = jax.jit(lambda s, b: (jax.tree.map(lambda x: x + 0, s), {"loss": b["x"].sum()}))
    assert nnx_calls <= _python_calls(_steady(lambda s: same(s, batch), kept)) + 2, nnx_calls


def test_the_program_alone_passes_other_signatures_and_donated_states_on():
    mesh = _one_device()
    step, state, loss_fn = _linen(2, mesh=mesh)
    want = jax.device_get(state)
    for rows in (8, 8, 8, 16, 16, 8, 8):  # steady, then a new batch size, then back
        batch = _batch(rows, seed=rows)
        want_loss = loss_fn(want.params, batch)
        want = want.apply_gradients(grads=jax.grad(loss_fn)(want.params, batch))
        old, (state, metrics) = state, step(state, fdp.shard_batch(batch, mesh=mesh))
        np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-5)
    assert step._alone is not None  # the steady calls took it
    with pytest.raises(RuntimeError, match="donated to an earlier step"):
        step(old, fdp.shard_batch(_batch(), mesh=mesh))
    with pytest.raises(TypeError, match="state must be a flax.training.train_state.TrainState"):
        step({"params": state.params}, fdp.shard_batch(_batch(), mesh=mesh))
    chex.assert_trees_all_close(jax.device_get(state.params), want.params, rtol=1e-5, atol=1e-6)


def test_the_numerics_guard_keeps_its_per_call_check(monkeypatch):
    from fdp.step.grads import _finite

    monkeypatch.setenv(_finite.ENV_VAR, "1")
    mesh = _one_device()
    step, state, _ = _linen(2, mesh=mesh)
    for _ in range(3):
        state, _ = step(state, fdp.shard_batch(_batch(), mesh=mesh))
    assert step._alone is None  # the guard reads each call's codes
    bad = _batch()
    bad["x"][3] = np.nan
    with pytest.raises(FloatingPointError, match="at call 4 of this step"):
        step(state, fdp.shard_batch(bad, mesh=mesh))


def test_an_fdp_ddp_call_like_the_last_is_its_program_alone():
    mesh = _one_device()

    def loss(params, x):
        return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)

    def sgd(params, batch, reduce=fdp.reduce_gradients):
        grads = reduce(jax.grad(loss)(params, batch["x"]))
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new, {"loss": loss(params, batch["x"])}

    def one_device(params, batch):  # the reference: the whole batch's gradient as it is
        return sgd(params, batch, reduce=lambda grads: grads)

    step = fdp.ddp(sgd, mesh=mesh, batch_argnums=1)
    params = fdp.replicate({"w": jnp.full((4, 1), 0.1)}, mesh=mesh)
    batch = fdp.shard_batch(_batch(), mesh=mesh)
    calls = _python_calls(_steady(lambda p: step(p, batch), params))
    plain = jax.jit(one_device)
    assert calls <= _python_calls(_steady(lambda p: plain(p, batch), params)) + 2, calls
    # Another batch size is refused by the program and planned; then taken alone again.
    want = jax.device_get(params)
    for rows in (8, 16, 16, 8, 8):
        batch = _batch(rows, seed=rows)
        want, want_metrics = one_device(want, batch)
        params, metrics = step(params, fdp.shard_batch(batch, mesh=mesh))
        np.testing.assert_allclose(float(metrics["loss"]), float(want_metrics["loss"]), rtol=1e-5)
    assert step._alone is not None
    chex.assert_trees_all_close(jax.device_get(params), want, rtol=1e-5, atol=1e-6)


def test_an_in_place_nnx_call_without_hook_state_splits_without_filters(monkeypatch):
    # nnx.split(objects, HookState, ...) walks the state twice (439.8 against 241.3 us
    # for the benchmark's MLP): where the objects hold no hook state, the steady call
    # splits them whole, the same graph and the same rest.
    from fdp.step.front import _nnx

    split = []
    real = _nnx.split_hook_state
    monkeypatch.setattr(_nnx, "split_hook_state", lambda o: split.append(1) or real(o))
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    model = NNXMLP(2, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fdp.nnx_train_step(loss)
    batch = _batch()
    losses = [float(step(model, optimizer, fdp.shard_batch(batch))["loss"]) for _ in range(2)]
    split.clear()
    losses.append(float(step(model, optimizer, fdp.shard_batch(batch))["loss"]))
    assert split == []  # the steady call
    ref = NNXMLP(2, nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    for want in losses:
        value, grads = nnx.value_and_grad(loss)(ref, batch)
        ref_opt.update(ref, grads)
        np.testing.assert_allclose(want, float(value), rtol=1e-5)
    chex.assert_trees_all_close(nnx.state(model), nnx.state(ref), rtol=1e-5, atol=1e-7)
    # A hook that keeps state still has it split apart and written back.
    hooked = fdp.nnx_train_step(loss, comm_hook="powersgd")
    comm_state = hooked.init(model, optimizer)
    for _ in range(3):
        hooked(model, optimizer, fdp.shard_batch(batch), comm_state=comm_state)
    assert split
