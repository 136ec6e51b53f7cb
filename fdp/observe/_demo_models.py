"""Small Flax models whose parameters ``fdp describe`` can show buckets for.

Only their shapes are built (``jax.eval_shape``): nothing is allocated or run.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

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


def parameter_shapes(name: str, dtype: Any = None) -> Any:
    """The parameters of model ``name`` as ``jax.ShapeDtypeStruct``.

    Args:
      name: a built-in model (``mlp``, ``cnn``, ``transformer``), or
        ``module:function`` naming a function of no arguments that returns the
        parameters (a pytree of arrays; the ``{"params": ...}`` that Linen's
        ``init`` returns is unwrapped). The module is imported as ``python -m``
        would, with the current directory first on ``sys.path``; the function
        runs under ``jax.eval_shape``, so only shapes are built.
      dtype: the dtype of every floating-point leaf; None: the model's own
        (float32 for the built-in ones).

    Raises:
      ValueError: an unknown model name, or a ``module:function`` that cannot
        be imported or called.

    Example:
      >>> shapes = parameter_shapes("mlp")
      >>> shapes["Dense_0"]["kernel"].shape, shapes["Dense_2"]["bias"].dtype
      ((64, 256), dtype('float32'))
    """
    if name in MODELS:
        make, example = MODELS[name]
        shapes = jax.eval_shape(lambda: make().init(jax.random.key(0), example())["params"])
    elif ":" in name:
        shapes = jax.eval_shape(_function(name))
        if isinstance(shapes, Mapping) and set(shapes) >= {"params"}:
            shapes = shapes["params"]
    else:
        raise ValueError(
            f"model must be one of {sorted(MODELS)} or module:function (a function of no "
            f"arguments returning the parameters, e.g. mypkg.models:init_params), got {name!r}."
        )
    if dtype is None:
        return shapes

    def cast(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        floating = jnp.issubdtype(s.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype) if floating else s.dtype)

    return jax.tree.map(cast, shapes)


def _function(spec: str) -> Callable[[], Any]:
    """The function ``module:function`` names (``function`` may be dotted: ``mod:Class.f``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"model {spec!r} must read module:function, e.g. mypkg.models:params.")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m: modules in the current directory
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"model {spec!r}: cannot import module {module_name!r} ({e}); run from the "
            "directory that holds it, or put it on PYTHONPATH."
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model {spec!r}: {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model {spec!r}: {attr!r} is a {type(obj).__name__}, not a function.")
    return obj


# The label shape of one example of each built-in model: a class, or a token per position.
_LABELS = {"mlp": (), "cnn": (), "transformer": (16,)}


def gpu_step(
    name: str,
    target: str,
    *,
    devices: int = 8,
    rows_per_device: int = 32,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
) -> tuple[Any, Any]:
    """A built-in model's train step compiled for ``devices`` GPUs of ``target``, deviceless.

    Adam, cross-entropy, ``rows_per_device`` examples per GPU; only shapes exist.

    Returns:
      ``(step, compiled)``.

    Raises:
      ValueError: ``name`` is not a built-in model (a ``module:function`` gives
        parameters only: no loss to compile).
    """
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fdp.data._placement import replicate
    from fdp.observe._gpu import gpu_mesh
    from fdp.step._build import train_step
    from fdp.step.core._state import TrainState
    from fdp.step.options._policies import Reduction

    if name not in MODELS:
        raise ValueError(
            f"--gpu compiles a built-in model's step ({sorted(MODELS)}); {name!r} gives "
            "parameters only. Compile your own step with fdp.observe.gpu_mesh (docs/gpu.md)."
        )
    make, example = MODELS[name]
    model = make()
    mesh = gpu_mesh(target, devices)
    rows = NamedSharding(mesh, P("data"))
    x, n = example(), rows_per_device * devices
    label_shape = _LABELS[name]
    batch = {
        "x": jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype, sharding=rows),
        "y": jax.ShapeDtypeStruct((n, *label_shape), jnp.int32, sharding=rows),
    }

    def init() -> Any:
        params = model.init(jax.random.key(0), example())["params"]
        return TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        logits = cast(jax.Array, model.apply({"params": params}, batch["x"]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    state = replicate(jax.eval_shape(init), mesh)
    caps = Reduction(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
    step = train_step(loss_fn, mesh=mesh, reduction=caps)
    return step, step.lower(state, batch).compile()
