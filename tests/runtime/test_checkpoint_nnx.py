"""Saving and resuming a Flax NNX run: the whole run comes back, bit for bit."""

import jax
import numpy as np
import optax
import pytest
from _models import make_data
from flax import nnx

import fdp
from fdp import hooks


class Net(nnx.Module):
    """Parameters, BatchNorm buffers and a Dropout random stream: all must survive."""

    def __init__(self, seed):
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(64, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.l1(x.reshape(x.shape[0], -1))))
        return self.l2(self.drop(x))


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


BATCHES = [make_data(seed, 16) for seed in range(6)]


def fresh(seed, hook):
    model = Net(seed)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return model, opt, fdp.nnx_train_step(loss_fn, comm_hook=hook)


def everything(*objects):
    return jax.tree.map(
        lambda x: np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        ),
        nnx.to_pure_dict(nnx.state(objects)),
    )


def powersgd():
    return hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)


@pytest.mark.parametrize("hook", ["allreduce", "powersgd"])
def test_resuming_an_nnx_run_is_bit_identical(tmp_path, hook):
    make_hook = powersgd if hook == "powersgd" else lambda: None
    model, opt, step = fresh(0, make_hook())
    comm = step.init(model, opt)
    losses = []
    with fdp.CheckpointManager(tmp_path) as ckpt:
        for i, b in enumerate(BATCHES):
            losses.append(float(step(model, opt, fdp.shard_batch(b), comm_state=comm)["loss"]))
            if i == 2:  # saved in the background while the run goes on (donating its arrays)
                ckpt.save(3, (model, opt, comm), data_position={"batch": 3})
    # A new process: other seeds, nothing placed yet. step.init gives the comm hook's
    # state (a stateful hook's) to restore into.
    model2, opt2, step2 = fresh(7, make_hook())
    comm2 = step2.init(model2, opt2)
    with fdp.CheckpointManager(tmp_path) as ckpt:
        restored = ckpt.restore((model2, opt2, comm2))
    assert restored.state[0] is model2 and restored.data_position == {"batch": 3}
    resumed = [
        float(step2(model2, opt2, fdp.shard_batch(b), comm_state=comm2)["loss"])
        for b in BATCHES[3:]
    ]
    assert resumed == losses[3:]
    # Every array (parameters, moments, batch statistics, RNG counts, hook state)
    # is the one of the run that never stopped.
    jax.tree.map(
        np.testing.assert_array_equal, everything(model2, opt2, comm2), everything(model, opt, comm)
    )


def test_an_fdp_0_1_checkpoint_restores_into_a_comm_state(tmp_path):
    """fdp 0.1 saved the hook state on the optimizer; restore moves it into comm_state."""
    model, opt, step = fresh(0, powersgd())
    losses = []
    with fdp.CheckpointManager(tmp_path) as ckpt:
        for i, b in enumerate(BATCHES):
            with pytest.warns(DeprecationWarning, match="comm_state"):  # fdp 0.1's spelling
                losses.append(float(step(model, opt, fdp.shard_batch(b))["loss"]))
            if i == 2:
                ckpt.save(3, (model, opt))  # the optimizer holds fdp_comm_state
    model2, opt2, step2 = fresh(7, powersgd())
    comm2 = step2.init(model2, opt2)
    with fdp.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"fdp 0.1(.|\n)*comm_state = step.init"):
            ckpt.restore((model2, opt2))  # no place for the hook state: the fix is named
        restored = ckpt.restore((model2, opt2, comm2))
    assert restored.state[2] is comm2 and not hasattr(opt2, "fdp_comm_state")
    resumed = [
        float(step2(model2, opt2, fdp.shard_batch(b), comm_state=comm2)["loss"])
        for b in BATCHES[3:]
    ]
    assert resumed == losses[3:]
    old = everything(model, opt)
    old_comm = old[1].pop("fdp_comm_state")
    new = everything(model2, opt2, comm2)
    jax.tree.map(np.testing.assert_array_equal, (new[0], new[1]), (old[0], old[1]))
    jax.tree.map(np.testing.assert_array_equal, new[2]["comm_state"], old_comm)


def test_restoring_into_a_fresh_unplaced_model_then_stepping_works(tmp_path):
    model, opt, step = fresh(0, None)
    step(model, opt, fdp.shard_batch(BATCHES[0]))
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, (model, opt))
        model2, opt2, step2 = fresh(3, None)  # leaves on device 0, as a new process has them
        ckpt.restore((model2, opt2))
    step2(model2, opt2, fdp.shard_batch(BATCHES[1]))
    step(model, opt, fdp.shard_batch(BATCHES[1]))
    jax.tree.map(np.testing.assert_array_equal, everything(model2, opt2), everything(model, opt))


@pytest.mark.parametrize("what", ["nnx.state(optimizer)", "optimizer", "optimizer+comm"])
def test_a_save_that_leaves_the_model_out_is_refused(tmp_path, what):
    model, opt, step = fresh(0, powersgd())
    state = {
        "nnx.state(optimizer)": lambda: nnx.state(opt),
        "optimizer": lambda: opt,
        "optimizer+comm": lambda: (opt, step.init(model, opt)),  # a comm state is no model
    }[what]()
    with fdp.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(
            ValueError, match=r"stale parameters.*ckpt.save\(step, \(model, optimizer\)\)"
        ):
            ckpt.save(1, state)
        assert ckpt.all_steps() == []


def test_a_missing_comm_hook_state_is_named(tmp_path):
    model, opt, step = fresh(0, powersgd())
    comm = step.init(model, opt)
    step(model, opt, fdp.shard_batch(BATCHES[0]), comm_state=comm)
    with fdp.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, (model, opt, comm))
        model2, opt2, _ = fresh(0, powersgd())
        with pytest.raises(
            ValueError,
            match=r"comm_state.*in the checkpoint, not in the template(.|\n)*step.init",
        ):
            ckpt.restore((model2, opt2))
