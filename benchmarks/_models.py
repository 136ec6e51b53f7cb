"""Benchmark models: an MLP, a small CNN and a ~10M-parameter transformer."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


class MLP(nn.Module):
    width: int = 1024
    depth: int = 8
    classes: int = 10

    @nn.compact
    def __call__(self, x, train=True):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(self.classes)(x)


class CNN(nn.Module):
    """A small CNN; with ``norm=True`` it carries BatchNorm statistics.

    ``axis_name`` makes the BatchNorm a SyncBatchNorm over that mesh axis (inside
    ``shard_map``): the statistics of the global batch, as GSPMD computes them for a
    batch sharded under plain ``jit``.
    """

    classes: int = 10
    norm: bool = False
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train=True):
        for feat in (32, 64, 128):
            x = nn.Conv(feat, (3, 3))(x)
            if self.norm:
                x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(self.classes)(nn.relu(nn.Dense(256)(x)))


class Block(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(
            h, h, mask=nn.make_causal_mask(x[..., 0])
        )
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.dim)(h)
        return x + nn.Dense(self.dim)(nn.gelu(h))


class Transformer(nn.Module):
    vocab: int = 4096
    dim: int = 384
    depth: int = 6
    heads: int = 6
    seq: int = 64

    @nn.compact
    def __call__(self, tokens, train=True):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.dim))
        for _ in range(self.depth):
            x = Block(self.dim, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


@dataclasses.dataclass(frozen=True)
class Bench:
    """A model, its batch maker and its loss.

    ``spmd_module`` is the same model for use inside ``shard_map`` where it differs
    (a BatchNorm that names the data axis); models with BatchNorm statistics have a
    loss ``loss(params, batch, batch_stats) -> (loss, new_batch_stats)``.
    """

    name: str
    module: nn.Module
    make_batch: Callable[[int, int], dict[str, np.ndarray]]
    tx: Callable[[], optax.GradientTransformation]
    spmd_module: nn.Module | None = None

    def init_variables(self, seed: int = 0) -> dict[str, Any]:
        batch = self.make_batch(2, seed)
        return dict(self.module.init(jax.random.key(seed), batch["x"]))

    def init_params(self, seed: int = 0) -> Any:
        return self.init_variables(seed)["params"]

    @functools.cached_property
    def has_stats(self) -> bool:
        return "batch_stats" in jax.eval_shape(self.init_variables)

    def loss_fn(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = self.module.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def loss_for(self, spmd: bool) -> Callable[..., Any]:
        """The loss of ``module`` (``spmd=False``) or ``spmd_module``, with statistics."""
        module = (self.spmd_module or self.module) if spmd else self.module
        if not self.has_stats:
            return self.loss_fn

        def loss(params, batch, batch_stats):
            logits, updates = module.apply(
                {"params": params, "batch_stats": batch_stats},
                batch["x"],
                mutable=["batch_stats"],
            )
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return ce, updates["batch_stats"]

        return loss


def _images(shape: tuple[int, ...], classes: int) -> Callable[[int, int], dict[str, np.ndarray]]:
    def make(n: int, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {
            "x": rng.normal(size=(n, *shape)).astype(np.float32),
            "y": rng.integers(0, classes, size=(n,)).astype(np.int32),
        }

    return make


def _tokens(seq: int, vocab: int) -> Callable[[int, int], dict[str, np.ndarray]]:
    def make(n: int, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        tok = rng.integers(0, vocab, size=(n, seq + 1)).astype(np.int32)
        return {"x": tok[:, :-1], "y": tok[:, 1:]}

    return make


BENCHES = {
    "mlp": Bench("mlp", MLP(), _images((1024,), 10), lambda: optax.sgd(0.01)),
    "cnn": Bench("cnn", CNN(), _images((32, 32, 3), 10), lambda: optax.adam(1e-3)),
    "cnn_bn": Bench(
        "cnn_bn",
        CNN(norm=True),
        _images((32, 32, 3), 10),
        lambda: optax.adam(1e-3),
        spmd_module=CNN(norm=True, axis_name="data"),
    ),
    "transformer": Bench(
        "transformer", Transformer(), _tokens(64, 4096), lambda: optax.adamw(1e-3)
    ),
}


def param_count(params: Any) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def as_jnp(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in batch.items()}
