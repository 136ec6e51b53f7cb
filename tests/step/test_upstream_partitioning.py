"""Flax's own lm1b model, its logical partitioning kept by fdp on a (data x tensor) mesh.

``examples/porting/lm1b_models.py`` is Flax's ``examples/lm1b/models.py``, unmodified.
Its parameters declare logical axes; the rules are lm1b's own (configs/default.py), except
that 'embed', which lm1b splits over its 'fsdp' axis, maps to no axis: fdp owns the data
axis (stage 0 replicates there, ZeRO splits its own way), and a rule naming it makes Flax
constrain values over it inside the step, which the step refuses with that fix.

SGD with momentum: every leaf ends within 1.2e-7 of one device on 8 x 1, 4 x 2 and
2 x 4 meshes. Adam divides by the root of the second moment, which turns the rounding
of a gradient near zero into updates of either sign (2.7e-6 on 8 x 1, 2.1e-5 on 4 x 2,
one element in 2,048, measured on 2026-11-29): those compare summation orders, not
layouts.
"""

import importlib.util
import pathlib
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import reference_steps
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fdp

PORTING = pathlib.Path(__file__).resolve().parents[2] / "examples" / "porting"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, PORTING / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # lm1b_original imports lm1b_models by name, as lm1b does
    spec.loader.exec_module(module)
    return module


lm1b = _load("lm1b_models")
# The port's config (docs/porting.md), its dropout off: one device draws no masks either.
CONFIG = _load("lm1b_original").CONFIG.replace(
    dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True
)
TX = optax.sgd(0.1, momentum=0.9)
RULES = (("mlp", "tensor"), ("vocab", "tensor"), ("embed", None), ("heads", "tensor"))


def loss_fn(params, batch):
    logits = lm1b.TransformerLM(CONFIG).apply({"params": params}, batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch).mean()


def batches(steps=2, rows=16):
    rng = np.random.default_rng(0)  # no padding (token 0): every token counts alike
    return [rng.integers(1, 64, size=(rows, 16)).astype(np.int32) for _ in range(steps)]


@pytest.mark.slow
def test_lm1b_trains_with_its_partitioning_kept_and_ends_where_one_device_does():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    with nn.logical_axis_rules(RULES):
        boxed = lm1b.TransformerLM(CONFIG).init(jax.random.key(0), batches()[0][:1])["params"]
        state = fdp.TrainState.create(apply_fn=None, params=boxed, tx=TX)
        step = fdp.train_step(loss_fn, mesh=mesh)
        state = step.init(state)
        for batch in batches():
            state, _ = step(state, fdp.shard_batch(batch, mesh))
    params = nn.unbox(state.params)
    decoder = params["decoder"]
    # lm1b splits 'mlp' and 'vocab' over 'tensor'; its attention ('embed', 'kv') stays whole.
    kept = {
        "mlp kernel": (
            decoder["encoderdecoderblock_0"]["MlpBlock_0"]["Dense_0"]["kernel"],
            P(None, "tensor"),
        ),
        "embedding": (decoder["Embed_0"]["embedding"], P("tensor")),
        "logits": (decoder["logitdense"]["kernel"], P(None, "tensor")),
    }
    for name, (leaf, spec) in kept.items():
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), name
        assert leaf.addressable_shards[0].data.size == leaf.size // 2, name
    split = [x for x in jax.tree.leaves(params) if not x.sharding.is_fully_replicated]
    assert len(split) == 2 * 3 + 3, len(split)  # per layer 2 kernels and a bias; 3 more

    plain = fdp.TrainState.create(apply_fn=None, params=nn.unbox(boxed), tx=TX)
    want = reference_steps(plain, batches(), loss_fn)[0].params
    chex.assert_trees_all_close(jax.device_get(params), jax.device_get(want), rtol=1e-5, atol=1e-6)


def test_lm1b_decodes_with_its_cache_under_fdp_ddp_as_under_jit():
    # lm1b's decode step as its temperature sampler calls it: the cache's keys and values
    # hold one row per sequence (split), its cache_index is a scalar (replicated).
    decode = CONFIG.replace(decode=True)
    model = lm1b.TransformerLM(decode)
    params = nn.unbox(lm1b.TransformerLM(CONFIG).init(jax.random.key(0), batches()[0][:1]))[
        "params"
    ]
    tokens = batches()[0]
    cache = model.init(jax.random.key(1), jnp.ones(tokens.shape, jnp.int32))["cache"]

    def decode_step(params, tokens, cache):
        logits, new = model.apply({"params": params, "cache": cache}, tokens, mutable=["cache"])
        return logits, new["cache"]

    plain = jax.jit(decode_step)
    ddp = fdp.ddp(
        decode_step,
        batch_argnums=(1, 2),
        replicated_leaves=lambda _, path: path.endswith("['cache_index']"),
    )
    want_cache = got_cache = cache
    for t in range(3):  # three tokens, one at a time
        want, want_cache = plain(params, tokens[:, t : t + 1], want_cache)
        got, got_cache = ddp(params, tokens[:, t : t + 1], got_cache)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(
        jax.device_get(got_cache), jax.device_get(want_cache), rtol=1e-5, atol=1e-6
    )
    flat = jax.tree_util.tree_flatten_with_path(got_cache)[0]
    indices = [int(x) for p, x in flat if jax.tree_util.keystr(p).endswith("['cache_index']")]
    assert indices and set(indices) == {3}, indices  # each layer's, and the positions'
