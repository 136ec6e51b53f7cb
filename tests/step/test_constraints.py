"""A loss that constrains activations on the data axis (MaxText style): refused with the fix.

fdp/step/grads/_constraints.py. Inside the step's shard_map JAX raises an error that does not
mention fdp; the step must refuse such a loss before tracing it, Linen and NNX, and
leave constraints on other meshes alone.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp

FIX = r"leave the constraint out when the model runs under fdp"


def batch():
    rng = np.random.default_rng(0)
    return fdp.shard_batch(
        {"x": rng.normal(size=(16, 4)).astype("f4"), "y": rng.normal(size=(16, 2)).astype("f4")}
    )


class Constrained(nn.Module):
    spec: P

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = jax.lax.with_sharding_constraint(x, NamedSharding(fdp.data_mesh(), self.spec))
        return nn.Dense(2)(jnp.tanh(x))


BARE = r"Pass the bare PartitionSpec instead"


@pytest.mark.parametrize("spec, fix", [(P("data"), FIX), (P(), BARE)])
def test_a_linen_loss_constraining_on_the_data_mesh_is_refused_with_the_fix(spec, fix):
    model = Constrained(spec)
    params = model.init(jax.random.key(0), jnp.zeros((8, 4)))["params"]

    def loss(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    state = fdp.replicate(fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)))
    for stage in (0, 3):
        step = fdp.train_step(loss, sharding=fdp.Sharding(zero_stage=stage))
        with pytest.raises(ValueError, match=rf"with_sharding_constraint .* axis 'data'.*{fix}"):
            step(state, batch())


class NNXConstrained(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        h = jax.lax.with_sharding_constraint(h, NamedSharding(fdp.data_mesh(), P("data")))
        return self.out(h)


def test_an_nnx_loss_constraining_inside_a_scan_is_refused_too():
    def loss(model, b):
        def body(c, x):  # the constraint sits in a sub-program
            return c, model(x)

        _, out = jax.lax.scan(body, 0.0, b["x"][None])
        return jnp.mean((out[0] - b["y"]) ** 2)

    model = NNXConstrained(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match=FIX):
        fdp.nnx_train_step(loss)(model, optimizer, batch())


def test_a_constraint_on_another_axis_is_not_the_steps_business():
    other = jax.make_mesh(
        (1,), ("model",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,)
    )
    sharding = NamedSharding(other, P("model"))

    def loss(w, x):
        return jax.lax.with_sharding_constraint(x @ w, sharding).sum()

    from fdp.step.grads._constraints import check_no_data_constraints

    closed = jax.make_jaxpr(loss)(jnp.ones((4, 4)), jnp.ones((8, 4)))
    check_no_data_constraints(closed.jaxpr, ("data",))  # no error
    with pytest.raises(ValueError, match="axis 'model'"):
        check_no_data_constraints(closed.jaxpr, ("model",))
