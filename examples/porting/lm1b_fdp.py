"""Flax's examples/lm1b/train.py: its train step as written, on synthetic padded tokens.

The loss, metrics and step are lm1b's (``compute_weighted_cross_entropy``,
``compute_weighted_accuracy``, ``compute_metrics``, ``train_step``), the model is its
``models.py`` unmodified (``lm1b_models.py``), jitted as lm1b jits it (static config,
learning-rate function and label smoothing). The data is token sequences of different
lengths, padded with 0, so that it runs offline; a small config keeps it quick on a CPU.
``lm1b_original.py`` (one device) and ``lm1b_fdp.py`` (data-parallel) differ only in
the lines docs/porting.md shows.
"""

import jax
import jax.numpy as jnp
import lm1b_models as models
import numpy as np
import optax
from flax import linen as nn
from flax.training import common_utils, train_state

import fdp


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    """Compute weighted cross entropy and entropy for log probs and targets."""
    if logits.ndim != targets.ndim + 1:
        raise ValueError(
            f"Incorrect shapes. Got shape {logits.shape} logits and {targets.shape} targets"
        )
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence)
        + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = common_utils.onehot(
        targets, vocab_size, on_value=confidence, off_value=low_confidence
    )

    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant

    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()

    return loss.sum(), normalizing_factor


def compute_weighted_accuracy(logits, targets, weights=None):
    """Compute weighted accuracy for log probs and targets."""
    if logits.ndim != targets.ndim + 1:
        raise ValueError(
            f"Incorrect shapes. Got shape {logits.shape} logits and {targets.shape} targets"
        )
    loss = jnp.equal(jnp.argmax(logits, axis=-1), targets)
    normalizing_factor = np.prod(logits.shape[:-1])
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()

    return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
    """Compute summary metrics."""
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    acc, _ = compute_weighted_accuracy(logits, labels, weights)
    metrics = {
        "loss": loss,
        "accuracy": acc,
        "denominator": weight_sum,
    }
    return metrics


def train_step(
    state,
    batch,
    config,
    learning_rate_fn,
    label_smoothing=0.0,
    dropout_rng=None,
):
    """Perform a single training step."""
    train_keys = ["inputs", "inputs_position", "inputs_segmentation"]
    (inputs, inputs_positions, inputs_segmentation) = (batch.get(k, None) for k in train_keys)

    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)

    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        """loss function used for training."""
        logits = models.TransformerLM(config).apply(
            {"params": params},
            inputs,
            inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation,
            rngs={"dropout": dropout_rng},
        )

        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights, label_smoothing)
        mean_loss = loss / weight_sum
        return mean_loss, logits

    step = state.step
    lr = learning_rate_fn(step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    grads = fdp.reduce_gradients(grads, weight=weights.sum())
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(logits, inputs, weights)
    metrics["learning_rate"] = lr

    return new_state, metrics


CONFIG = models.TransformerConfig(
    vocab_size=64,
    output_vocab_size=64,
    emb_dim=32,
    num_heads=4,
    num_layers=2,
    qkv_dim=32,
    mlp_dim=64,
    max_len=16,
    dropout_rate=0.1,
    attention_dropout_rate=0.1,
)


def batches(steps, rows=32, length=16, seed=0):
    """Token sequences of 2-16 tokens, padded with 0 to ``length``."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        lengths = rng.integers(2, length + 1, size=(rows,))
        real = np.arange(length)[None] < lengths[:, None]
        yield {"inputs": (rng.integers(1, 64, size=(rows, length)) * real).astype(np.int32)}


def train(steps=3, config=CONFIG, optimizer=optax.adam):
    learning_rate_fn = optax.constant_schedule(1e-3)
    model = models.TransformerLM(config.replace(deterministic=True))
    params = model.init(jax.random.key(0), jnp.ones((1, 16), jnp.int32))["params"]
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=nn.unbox(params), tx=optimizer(learning_rate_fn)
    )
    jit_train_step = fdp.ddp(
        train_step,
        batch_argnums=1,
        static_argnums=(2, 3, 4),
        output_reduction="sum",
    )
    dropout_rngs = jax.random.key(1)
    for batch in batches(steps):
        state, metrics = jit_train_step(state, batch, config, learning_rate_fn, 0.0, dropout_rngs)
        loss = metrics["loss"] / metrics["denominator"]
        print(f"loss {float(loss):.4f}, tokens {int(metrics['denominator'])}")
    return state


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # simulated CPU devices; GPUs are used as they are
    train()
