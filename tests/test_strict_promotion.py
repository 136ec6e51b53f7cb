"""fdp's own code never relies on implicit dtype promotion.

Every fdp code path runs here under ``jax.numpy_dtype_promotion("strict")``, where
an implicit promotion between arrays of different dtypes is an error. Strict
promotion cannot be global in this suite: flax's ``nn.avg_pool`` and optax's Adam
bias correction (``decay ** count`` with an int32 count, optax 0.2.8) rely on it
themselves, so the models and optimizers here avoid those two.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_data
from flax import nnx

import fdp

STRICT = jax.numpy_dtype_promotion("strict")


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
        self.param("spare", nn.initializers.zeros, (3,))  # never reaches the loss
        return nn.Dense(10)(nn.relu(x))


def linen_run(steps=2, per_example=False, **kwargs):
    model = BNNet()
    variables = model.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)))
    state = fdp.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)),
        batch_stats=variables["batch_stats"],
    )

    def loss_fn(params, batch, stats):
        logits, upd = model.apply(
            {"params": params, "batch_stats": stats}, batch["x"], mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return (loss if per_example else loss.mean()), upd["batch_stats"]

    step = fdp.train_step(loss_fn, per_example=per_example, **kwargs)
    state = fdp.replicate(state)
    for s in range(steps):
        if per_example:  # 13 rows: padded to 16 and masked by the step
            state, metrics = step(state, make_data(s, 13))
        else:
            state, metrics = step(state, fdp.shard_batch(make_data(s, 16)))
    return jax.block_until_ready((state, metrics))


CASES = {
    "default": {},
    "flat": {"layout": "flat", "bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.001},
    "accumulate": {"accumulate_steps": 2, "accum_dtype": jnp.float32},
    "per_example": {"per_example": True},
    "buffers_mean": {"buffers": "mean"},
    "buffers_local": {"buffers": "local"},
    "unused": {"find_unused_parameters": True},
    "bf16": {"comm_hook": "bf16_compress"},
    "fp16": {"comm_hook": "fp16_compress"},
    "quantize": {"comm_hook": "quantize_per_channel"},
    "powersgd": {"comm_hook": fdp.hooks.powersgd(start_powersgd_iter=2)},
    "batched_powersgd": {"comm_hook": fdp.hooks.batched_powersgd(start_powersgd_iter=2)},
    "powersgd_batched_shapes": {
        "comm_hook": fdp.hooks.powersgd(start_powersgd_iter=2, batch_tensors_with_same_shape=True)
    },
    "noop": {"comm_hook": "noop"},
    "local_sgd": {
        "comm_hook": fdp.hooks.post_local_sgd(1, subgroup_size=4),
        "model_averager": fdp.hooks.PeriodicModelAverager(period=2, warmup_steps=1),
    },
    "hierarchical_sgd": {
        "comm_hook": fdp.hooks.post_local_sgd(1, subgroup_size=2),
        "model_averager": fdp.hooks.HierarchicalModelAverager({1: 4, 2: 8}, warmup_steps=1),
    },
}


@pytest.mark.filterwarnings("ignore:These parameters do not take part")
@pytest.mark.parametrize("name", list(CASES))
def test_linen_step_paths(name):
    kwargs = dict(CASES[name])
    per_example = kwargs.pop("per_example", False)
    with STRICT:
        _, metrics = linen_run(steps=3, per_example=per_example, **kwargs)
    assert np.isfinite(float(metrics["loss"]))


def test_nnx_step_with_batchnorm_dropout_and_accumulation():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(64, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.l2 = nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.bn(self.l1(x.reshape(x.shape[0], -1))))))

    with STRICT:
        model = Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

        def loss_fn(m, b):
            logits = m(b["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

        step = fdp.nnx_train_step(loss_fn, accumulate_steps=2, comm_hook="bf16_compress")
        metrics = step(model, opt, fdp.shard_batch(make_data(0, 16)))
    assert np.isfinite(float(metrics["loss"]))


def test_grad_accumulator_and_reduce_gradients():
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,), jnp.bfloat16)}
    state = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))

    def loss_fn(p, batch):
        return jnp.mean((batch["x"] @ p["w"] + p["b"].astype(jnp.float32)) ** 2)

    with STRICT:
        acc = fdp.grad_accumulator(loss_fn, per_example=False)
        state = fdp.replicate(state)
        grads = acc.init(state)
        for s in range(2):
            batch = fdp.shard_batch({"x": np.full((8, 4), s + 1.0, np.float32)})
            grads, _ = acc.accumulate(state, grads, batch)
        state, metrics = acc.sync(state, grads)
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "product", "premul_sum"])
def test_collectives(op):
    mesh = fdp.data_mesh()
    x = fdp.shard_batch(np.arange(1.0, 9.0, dtype=np.float32), mesh)
    factor = 0.5 if op == "premul_sum" else None

    def body(x):
        return fdp.collectives.all_reduce(x, op, axis_name="data", factor=factor)

    with STRICT:
        out = jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P())(x)
        gathered = jax.shard_map(
            lambda x: fdp.collectives.all_gather(x, axis_name="data"),
            mesh=mesh,
            in_specs=jax.P("data"),
            out_specs=jax.P("data"),
        )(x)
    assert np.all(np.isfinite(np.asarray(out))) and gathered.size == 64


def test_the_control_a_promoting_loss_fails_here():
    params = {"w": jnp.ones(2)}
    state = fdp.replicate(fdp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)))

    def promoting(p, batch):  # int32 batch times float32 weights: an implicit promotion
        return jnp.mean(batch["k"] @ p["w"])

    # jax.dtypes.TypePromotionError is public only from JAX 0.10.2; on 0.10.0 it is the same
    # ValueError subclass under jax._src, so match the class by its message instead.
    with STRICT, pytest.raises(ValueError, match="no available implicit dtype promotion path"):
        fdp.train_step(promoting)(state, fdp.shard_batch({"k": np.ones((8, 2), np.int32)}))
