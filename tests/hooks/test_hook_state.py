"""Hook state lives in the train state: through jit, donation, checkpoints and NNX."""

import chex
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _models import cross_entropy, make_data, make_state
from flax import nnx

import fdp
from fdp import hooks


def powersgd_state():
    init = make_state("mlp", "adam")
    state = fdp.TrainState.create(apply_fn=init.apply_fn, params=init.params, tx=init.tx)
    hook = hooks.powersgd(matrix_approximation_rank=2, start_powersgd_iter=2)
    return fdp.replicate(state), fdp.train_step(cross_entropy(init.apply_fn), comm_hook=hook)


def test_hook_state_is_per_device_and_survives_donated_steps():
    state, step = powersgd_state()
    assert state.comm_state is None
    for t in range(4):
        state, _ = step(state, fdp.shard_batch(make_data(t, 16)))
    comm = state.comm_state
    assert comm["iter"].shape == (8,) and comm["iter"].tolist() == [4] * 8
    assert comm["error"][0].sharding.spec == jax.P("data")
    assert comm["error"][0].shape[0] == 8 and np.asarray(comm["error"][0]).any()
    for leaf in jax.tree.leaves(state.params):
        assert leaf.sharding.is_fully_replicated


@pytest.mark.slow
def test_hook_state_round_trips_through_an_orbax_checkpoint(tmp_path):
    state, step = powersgd_state()
    for t in range(3):
        state, _ = step(state, fdp.shard_batch(make_data(t, 16)))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = ckpt.restore(tmp_path / "ckpt", target)
    chex.assert_trees_all_equal(restored.comm_state, state.comm_state)
    assert restored.comm_state["error"][0].sharding.spec == jax.P("data")
    for t in range(3, 5):  # both continue identically
        batch = make_data(t, 16)
        state, _ = step(state, fdp.shard_batch(batch))
        restored, _ = step(restored, fdp.shard_batch(batch))
    chex.assert_trees_all_equal(restored.params, state.params)
    chex.assert_trees_all_equal(restored.comm_state, state.comm_state)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x.reshape(x.shape[0], -1))))


def nnx_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def test_nnx_keeps_hook_state_on_the_optimizer():
    runs = {}
    for name, hook in [
        ("allreduce", None),
        ("powersgd", hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)),
    ]:
        model = Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = fdp.nnx_train_step(nnx_loss, comm_hook=hook)
        kernels = []
        for t in range(3):
            step(model, opt, fdp.shard_batch(make_data(t, 16)))
            kernels.append(np.asarray(model.l1.kernel[...]))
        runs[name] = (opt, kernels)
    opt, kernels = runs["powersgd"]
    assert opt.fdp_comm_state.get_value()["iter"].tolist() == [3] * 8
    assert not hasattr(runs["allreduce"][0], "fdp_comm_state")
    for t in (0, 1):  # plain all-reduce before start_powersgd_iter
        np.testing.assert_allclose(kernels[t], runs["allreduce"][1][t], rtol=1e-6, atol=1e-7)
    assert not np.allclose(kernels[2], runs["allreduce"][1][2], atol=1e-4)


def test_nnx_rejects_hooks_whose_replicas_diverge():
    with pytest.raises(ValueError, match="lets replicas diverge.*Use fdp.train_step"):
        fdp.nnx_train_step(nnx_loss, comm_hook="noop")
