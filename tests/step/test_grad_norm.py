"""``metrics['grad_norm']``: the global norm of the gradient the update receives.

The reference is ``optax.tree.norm`` (``optax.global_norm`` before) of the single-device
gradient of the whole batch (what ``optax.clip_by_global_norm`` sees there), at every ZeRO stage: at
stages 1-3 each device holds its share of the split leaves and the norm sums the
shares over the data axis; leaves kept whole (the head's bias of 10 on 8 devices)
are counted once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, cross_entropy, make_data
from flax import nnx
from flax.training.train_state import TrainState

import fdp
from fdp.observe._hlo import collective_stats

NORM = fdp.Reduction(grad_norm=True)


def linen_state():
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))


def linen_reference(state, batch):
    grads = jax.jit(jax.grad(cross_entropy(state.apply_fn)))(state.params, batch)
    return float(optax.tree.norm(grads))


@pytest.mark.parametrize(
    "stage, accumulate, kept_gathered",
    [(0, 1, False), (1, 1, False), (2, 1, False), (2, 2, False), (3, 1, False), (3, 1, True)],
)
def test_linen_grad_norm_is_the_full_batch_gradient_norm(stage, accumulate, kept_gathered):
    state, batch = linen_state(), make_data(1, 32)
    expected = linen_reference(state, batch)
    # kept_gathered: stage 3 gathering every bucket at the start (not per use).
    sharding = fdp.Sharding(zero_stage=stage, reshard_after_forward=not kept_gathered)
    step = fdp.train_step(
        cross_entropy(state.apply_fn),
        reduction=NORM,
        sharding=sharding,
        accumulation=fdp.Accumulation(steps=accumulate),
    )
    _, metrics = step(state, fdp.shard_batch(batch))
    assert metrics["grad_norm"].shape == () and metrics["grad_norm"].dtype == jnp.float32
    np.testing.assert_allclose(float(metrics["grad_norm"]), expected, rtol=2e-6)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(64, 32, rngs=rngs)
        self.head = nnx.Linear(32, 10, rngs=rngs)  # its bias (10) stays whole on 8 devices

    def __call__(self, x):
        return self.head(nnx.relu(self.body(x.reshape(x.shape[0], -1))))


def nnx_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nnx_grad_norm_is_the_full_batch_gradient_norm(stage):
    batch = make_data(1, 32)
    reference = Net(nnx.Rngs(0))
    grads = nnx.grad(nnx_loss)(reference, jax.tree.map(jnp.asarray, batch))
    expected = float(optax.tree.norm(grads))
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = fdp.nnx_train_step(nnx_loss, reduction=NORM, sharding=fdp.Sharding(zero_stage=stage))(
        model, optimizer, fdp.shard_batch(batch)
    )
    np.testing.assert_allclose(float(metrics["grad_norm"]), expected, rtol=2e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_norm_adds_one_scalar_all_reduce_only_where_gradients_are_split(stage):
    """Stage 0 reduces the whole gradient locally; the split stages sum one scalar more.

    Off (the default), the step has no norm and no extra all-reduce."""
    batch = make_data(1, 32)
    sharding = fdp.Sharding(zero_stage=stage)
    counts = {}
    for norm in (False, True):
        state = linen_state()  # the step donates the state it is given
        reduction = fdp.Reduction(grad_norm=norm)
        step = fdp.train_step(cross_entropy(state.apply_fn), reduction=reduction, sharding=sharding)
        ops = collective_stats(step.lower(state, fdp.shard_batch(batch)).as_text()).ops
        counts[norm] = sum(op.kind == "all-reduce" and op.shapes == ((),) for op in ops)
        _, metrics = step(state, fdp.shard_batch(batch))
        assert ("grad_norm" in metrics) == norm
    assert counts == {False: 1, True: 1 if stage == 0 else 2}  # the loss's, and the norm's


def test_grad_norm_must_be_a_bool():
    with pytest.raises(TypeError, match="grad_norm must be True or False, got 1"):
        fdp.Reduction(grad_norm=1)
