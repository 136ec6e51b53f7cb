"""Small Flax models whose parameters ``fdp describe`` can show buckets for.

Only their shapes are built (``jax.eval_shape``): nothing is allocated or run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    """The digits demo's MLP (examples/train_digits.py): 64 -> 256 -> 256 -> 10."""

    hidden: int = 256
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(x)


class CNN(nn.Module):
    """A small convolutional classifier for 28x28 greyscale images."""

    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for features in (32, 64):
            x = nn.relu(nn.Conv(features, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.classes)(x)


class Transformer(nn.Module):
    """A two-block encoder language model: vocabulary 1000, width 128, 4 heads."""

    vocab: int = 1000
    width: int = 128
    blocks: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(self.blocks):
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(x))
            h = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
            x = x + nn.Dense(self.width)(h)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], jax.Array]]] = {
    "mlp": (MLP, lambda: jnp.zeros((1, 64))),
    "cnn": (CNN, lambda: jnp.zeros((1, 28, 28, 1))),
    "transformer": (Transformer, lambda: jnp.zeros((1, 16), jnp.int32)),
}


def parameter_shapes(name: str, dtype: Any = jnp.float32) -> Any:
    """The parameters of model ``name`` as ``jax.ShapeDtypeStruct``, in ``dtype``.

    Raises:
      ValueError: an unknown model name.

    Example:
      >>> shapes = parameter_shapes("mlp")
      >>> shapes["Dense_0"]["kernel"].shape, shapes["Dense_2"]["bias"].dtype
      ((64, 256), dtype('float32'))
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}.")
    make, example = MODELS[name]
    shapes = jax.eval_shape(lambda: make().init(jax.random.key(0), example())["params"])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), shapes)
