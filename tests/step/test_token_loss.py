"""A language model's token-weighted loss: ``fdp.Loss(normalize="tokens")``.

Sequences of different lengths, padded, on 8 devices: the loss one device computes on
the whole batch is the sum of the per-token losses over the real tokens divided by
their number (lm1b's, MaxText's, torchtitan's normalisation), not the mean of the
devices' means. With ``loss_fn`` returning ``(loss_sum, token_count)`` the step divides
by the step's global count, over every device and micro-batch; the parameters then end
where one device does (plain optax, ``reference_steps``), and the mean of means does not.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import reference_steps
from flax import nnx

import fdp

VOCAB, LENGTH, ROWS, STEPS = 32, 12, 32, 3
TOL = {"rtol": 1e-5, "atol": 1e-6}
TX = optax.sgd(0.1, momentum=0.9)


def batches():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(2, LENGTH + 1, size=(ROWS,))
        mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)
        tokens = rng.integers(1, VOCAB, size=(ROWS, LENGTH)).astype(np.int32) * mask
        out.append({"tokens": tokens})
    return out


def token_sum(logits, tokens):
    """(sum of the next-token losses over real tokens, their number): lm1b's loss parts."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    weight = (tokens[:, 1:] > 0).astype(jnp.float32)
    return jnp.sum(ce * weight), jnp.sum(weight)


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.relu(nn.Dense(32)(nn.Embed(VOCAB, 16)(tokens)))
        return nn.Dense(VOCAB)(h)


def linen_sum(params, batch):
    return token_sum(LM().apply({"params": params}, batch["tokens"][:, :-1]), batch["tokens"])


def linen_mean(params, batch):  # what one device computes on the whole batch
    total, weight = linen_sum(params, batch)
    return total / weight


def linen_params():
    return LM().init(jax.random.key(0), jnp.zeros((1, LENGTH - 1), jnp.int32))["params"]


def linen_train(loss_fn, stage, steps, **kwargs):
    step = fdp.train_step(
        loss_fn,
        sharding=fdp.Sharding(zero_stage=stage),
        accumulation=fdp.Accumulation(steps=steps),
        **kwargs,
    )
    state = step.init(fdp.TrainState.create(apply_fn=None, params=linen_params(), tx=TX))
    for batch in batches():
        state, metrics = step(state, fdp.shard_batch(batch))
    return jax.device_get(state.params), float(metrics["loss"])


@pytest.mark.parametrize("stage, steps", [(0, 1), (0, 4), (3, 1), (3, 4)])
def test_linen_token_loss_ends_where_one_device_does(stage, steps):
    plain = fdp.TrainState.create(apply_fn=None, params=linen_params(), tx=TX)
    want, losses = reference_steps(plain, batches(), linen_mean)
    got, loss = linen_train(linen_sum, stage, steps, loss=fdp.Loss(normalize="tokens"))
    chex.assert_trees_all_close(got, jax.device_get(want.params), **TOL)
    np.testing.assert_allclose(loss, losses[-1], rtol=1e-6)  # the per-token mean
    # DDP's mean of each device's mean weighs a short sequence's tokens more.
    ddp, _ = linen_train(linen_mean, stage, steps)
    apart = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), ddp, got)))
    assert apart > 1e-3, apart


class NNXLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        return self.out(nnx.relu(self.hidden(self.embed(tokens))))


def nnx_sum(model, batch):
    return token_sum(model(batch["tokens"][:, :-1]), batch["tokens"])


def nnx_mean(model, batch):
    total, weight = nnx_sum(model, batch)
    return total / weight


@pytest.mark.parametrize("stage", [0, 3])
def test_nnx_token_loss_with_accumulation_ends_where_one_device_does(stage):
    model = NNXLM(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    step = fdp.nnx_train_step(
        nnx_sum,
        loss=fdp.Loss(normalize="tokens"),
        sharding=fdp.Sharding(zero_stage=stage),
        accumulation=fdp.Accumulation(steps=4),
    )
    step.init(model, optimizer)
    for batch in batches():
        step(model, optimizer, fdp.shard_batch(batch))

    reference = NNXLM(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, TX, wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, optimizer, batch):
        optimizer.update(model, nnx.grad(nnx_mean)(model, batch))

    for batch in batches():
        ref_step(reference, ref_opt, batch)
    chex.assert_trees_all_close(
        jax.device_get(jax.tree.leaves(nnx.state(model, nnx.Param))),
        jax.device_get(jax.tree.leaves(nnx.state(reference, nnx.Param))),
        **TOL,
    )


def test_the_token_contract_names_what_it_expects():
    step = fdp.train_step(linen_mean, loss=fdp.Loss(normalize="tokens"))
    state = step.init(fdp.TrainState.create(apply_fn=None, params=linen_params(), tx=TX))
    with pytest.raises(TypeError, match=r"must return \(loss_sum, weight\).*normalize='tokens'"):
        step(state, fdp.shard_batch(batches()[0]))
    with pytest.raises(ValueError, match="pick one"):
        fdp.Loss(normalize="tokens", per_example=True)
    with pytest.raises(ValueError, match=r"op='mean'"):
        fdp.train_step(
            linen_sum,
            loss=fdp.Loss(normalize="tokens"),
            accumulation=fdp.Accumulation(steps=2, op="sum"),
        )
    with pytest.raises(ValueError, match=r"normalize must be one of \('mean', 'tokens'\)"):
        fdp.Loss(normalize="token")
