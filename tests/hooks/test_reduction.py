"""fdp.reduce_gradients inside users' own shard_map and pmap steps."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp

N = 8
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N * 2, 5)).astype(np.float32)
PARAMS = {
    "w": RNG.normal(size=(5, 3)).astype(np.float32),
    "b": np.zeros(3, np.float32),
    "count": np.int32(7),
}


def loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def full_batch_grads():
    return jax.grad(loss)({"w": PARAMS["w"], "b": PARAMS["b"]}, X)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def test_one_line_adoption_in_a_shard_map_step(mesh):
    def step(params, x):
        params = jax.lax.pcast(params, "data", to="varying")
        grads = jax.grad(loss, allow_int=True)(params, x)
        return fdp.reduce_gradients(grads, bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)

    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    grads = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))(
        PARAMS, x
    )
    want = full_batch_grads()
    chex.assert_trees_all_close(grads["w"], want["w"], rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(grads["b"], want["b"], rtol=1e-5, atol=1e-7)
    assert grads["count"].dtype == jax.dtypes.float0


def test_check_vma_false_and_legacy_pmap(mesh):
    params = {"w": PARAMS["w"], "b": PARAMS["b"]}

    def step(params, x):
        return fdp.reduce_gradients(jax.grad(loss)(params, x))

    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    got = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    )(params, x)
    chex.assert_trees_all_close(got, full_batch_grads(), rtol=1e-5, atol=1e-7)

    stacked = jax.tree.map(lambda p: np.broadcast_to(p, (N, *p.shape)), params)
    got = jax.pmap(step, axis_name="data")(stacked, X.reshape(N, 2, 5))
    for d in range(N):
        device_grads = {k: v[d] for k, v in got.items()}
        chex.assert_trees_all_close(device_grads, full_batch_grads(), rtol=1e-5, atol=1e-7)


def test_double_reduction_is_caught(mesh):
    def step(params, x):
        grads = jax.grad(loss)(params, x)  # params replicated: jax.grad already summed
        return fdp.reduce_gradients(grads)

    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    params = {"w": PARAMS["w"], "b": PARAMS["b"]}
    with pytest.raises(ValueError, match=r"gradient \['w'\] is already reduced over 'data'"):
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(params, x)


def test_reduction_outside_a_mapped_axis_is_a_clear_error():
    with pytest.raises(NameError, match="axis_name='data' is not a bound mesh axis"):
        fdp.reduce_gradients({"w": jnp.ones(3)})


@pytest.mark.parametrize("hook", ["bf16_compress", "quantize_per_tensor"])
def test_comm_hook_equals_the_same_hook_in_train_step(hook):
    params = {"w": PARAMS["w"], "b": PARAMS["b"]}
    state = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.5))
    reduction = fdp.Reduction(comm_hook=hook, layout="leaves")
    step = fdp.train_step(loss, reduction=reduction, fold_dots=False, donate=False)
    want, _ = step(fdp.replicate(state), fdp.shard_batch(X))

    def own(state, x, comm_hook):
        grads = jax.grad(loss)(state.params, x)
        return state.apply_gradients(grads=fdp.reduce_gradients(grads, comm_hook=comm_hook))

    got = fdp.ddp(lambda s, x: own(s, x, hook), batch_argnums=1)(state, X)
    mean = fdp.ddp(lambda s, x: own(s, x, None), batch_argnums=1)(state, X)
    for name in params:
        np.testing.assert_array_equal(got.params[name], want.params[name])
    # The hook ran: its rounding moved the weights away from the plain mean's.
    assert not np.array_equal(got.params["w"], mean.params["w"])


def test_a_hook_with_state_is_refused_by_name(mesh):
    def step(params, x):
        params = jax.lax.pcast(params, "data", to="varying")
        return fdp.reduce_gradients(jax.grad(loss)(params, x), comm_hook="powersgd")

    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    params = {"w": PARAMS["w"], "b": PARAMS["b"]}
    with pytest.raises(ValueError, match=r"'powersgd\(.*keeps state.*reduce_with_hook"):
        mapped(params, jax.device_put(X, NamedSharding(mesh, P("data"))))
