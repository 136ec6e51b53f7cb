"""Hook state lives in the train state (NNX: its own object): jit, donation, checkpoints."""

import chex
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _models import MLP, NNXMLP, cross_entropy, make_data, make_state, nnx_cross_entropy
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


Net, nnx_loss = NNXMLP, nnx_cross_entropy


def test_nnx_keeps_hook_state_in_its_comm_state():
    runs = {}
    for name, hook in [
        ("allreduce", None),
        ("powersgd", hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)),
    ]:
        model = Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = fdp.nnx_train_step(nnx_loss, comm_hook=hook)
        comm = step.init(model, opt)
        kernels = []
        for t in range(3):
            step(model, opt, fdp.shard_batch(make_data(t, 16)), comm_state=comm)
            kernels.append(np.asarray(model.l1.kernel[...]))
        runs[name] = (comm, kernels)
    comm, kernels = runs["powersgd"]
    assert comm.comm_state.get_value()["iter"].tolist() == [3] * 8
    assert runs["allreduce"][0].comm_state is None
    for t in (0, 1):  # plain all-reduce before start_powersgd_iter
        np.testing.assert_allclose(kernels[t], runs["allreduce"][1][t], rtol=1e-6, atol=1e-7)
    assert not np.allclose(kernels[2], runs["allreduce"][1][2], atol=1e-4)


def test_nnx_init_and_steps_add_nothing_to_the_optimizer_or_model():
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    attrs = (set(vars(model)), set(vars(opt)))
    graphs = (nnx.graphdef(model), nnx.graphdef(opt))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(nnx.state(opt))]
    hook = hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)
    step = fdp.nnx_train_step(nnx_loss, reduction=fdp.Reduction(comm_hook=hook))
    comm = step.init(model, opt)
    assert isinstance(comm, fdp.NNXCommState) and comm.comm_state is not None
    for t in range(3):
        step(model, opt, fdp.shard_batch(make_data(t, 16)), comm_state=comm)
    assert (set(vars(model)), set(vars(opt))) == attrs
    assert (nnx.graphdef(model), nnx.graphdef(opt)) == graphs
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(nnx.state(opt))] == paths
    assert int(opt.step[...]) == 3 and comm.comm_state.get_value()["iter"].tolist() == [3] * 8


def test_nnx_powersgd_equals_linen_powersgd():
    """The same model in both front ends, the hook state carried by each: equal weights."""
    hook = hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    mlp = MLP(features=(32,), classes=10)
    layers = {"Dense_0": model.l1, "Dense_1": model.l2}
    params = {
        k: {"kernel": np.asarray(v.kernel[...]), "bias": np.asarray(v.bias[...])}
        for k, v in layers.items()
    }
    state = fdp.TrainState.create(apply_fn=mlp.apply, params=params, tx=optax.sgd(0.1))
    linen = fdp.train_step(cross_entropy(mlp.apply), reduction=fdp.Reduction(comm_hook=hook))
    state = linen.init(state)
    step = fdp.nnx_train_step(nnx_loss, reduction=fdp.Reduction(comm_hook=hook))
    comm = step.init(model, opt)
    for t in range(3):
        batch = fdp.shard_batch(make_data(t, 16))
        state, _ = linen(state, batch)
        step(model, opt, batch, comm_state=comm)
    for name, layer in layers.items():
        for leaf in ("kernel", "bias"):
            np.testing.assert_allclose(
                getattr(layer, leaf)[...], state.params[name][leaf], rtol=1e-5, atol=1e-6
            )
    chex.assert_trees_all_close(comm.comm_state.get_value(), state.comm_state, atol=1e-6)


def test_nnx_without_comm_state_keeps_fdp_0_1s_place_with_a_deprecation_warning():
    hook = hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)
    runs = []
    for explicit in (True, False):
        model = Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = fdp.nnx_train_step(nnx_loss, reduction=fdp.Reduction(comm_hook=hook))
        comm = step.init(model, opt) if explicit else None
        for t in range(3):
            batch = fdp.shard_batch(make_data(t, 16))
            if explicit:
                step(model, opt, batch, comm_state=comm)
            else:
                with pytest.warns(DeprecationWarning, match=r"comm_state = step.init\(model"):
                    step(model, opt, batch)
        runs.append((model, opt, comm))
    (model, _, comm), (old_model, old_opt, _) = runs
    np.testing.assert_array_equal(old_model.l1.kernel[...], model.l1.kernel[...])
    chex.assert_trees_all_equal(old_opt.fdp_comm_state.get_value(), comm.comm_state.get_value())
    # Both places at once: the step would not know which to use.
    with pytest.raises(ValueError, match=r"fdp_comm_state(.|\n)*step.init\(model, optimizer\)"):
        step(old_model, old_opt, fdp.shard_batch(make_data(3, 16)), comm_state=fdp.NNXCommState())
    with pytest.raises(TypeError, match="comm_state must be the fdp.NNXCommState"):
        step(old_model, old_opt, fdp.shard_batch(make_data(3, 16)), comm_state={})


def test_nnx_a_call_without_its_comm_state_is_refused_and_lower_adds_nothing():
    # Once, a call without comm_state= made a fresh hook state on the optimizer (fdp
    # 0.1's place): PowerSGD restarted silently, and the next correct call was refused.
    hook = hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fdp.nnx_train_step(nnx_loss, reduction=fdp.Reduction(comm_hook=hook))
    comm = step.init(model, opt)
    batch = fdp.shard_batch(make_data(0, 16))
    step(model, opt, batch, comm_state=comm)
    step.lower(model, opt, batch)  # an inspection without comm_state: nothing added
    assert not hasattr(opt, "fdp_comm_state")
    with pytest.raises(ValueError, match=r"comm_state: .*pass it on every call"):
        step(model, opt, batch)
    assert not hasattr(opt, "fdp_comm_state") and int(opt.step[...]) == 1
    step(model, opt, batch, comm_state=comm)
    assert comm.comm_state.get_value()["iter"].tolist() == [2] * 8


def test_nnx_rejects_hooks_whose_replicas_diverge():
    with pytest.raises(ValueError, match="lets replicas diverge.*Use fdp.train_step"):
        fdp.nnx_train_step(nnx_loss, comm_hook="noop")
