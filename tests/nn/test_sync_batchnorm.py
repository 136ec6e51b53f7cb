"""fdp.SyncBatchNorm against torch's (Sync)BatchNorm formulas, in NumPy and in torch.

torch's SyncBatchNorm over N ranks computes what its BatchNorm computes on the
concatenated batch (torch's test_DistributedDataParallel_SyncBatchNorm_*_Running_Value
asserts it): normalise with the biased variance, move the running variance towards
the unbiased one, ``running = (1 - momentum) * running + momentum * batch``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fdp

RNG = np.random.default_rng(0)
X16 = RNG.normal(size=(16, 3)).astype(np.float32)


def torch_running(x, steps=1, momentum=0.1):
    """torch's running statistics after `steps` training calls on x (NumPy)."""
    mean, var = np.zeros(x.shape[-1]), np.ones(x.shape[-1])
    flat = x.reshape(-1, x.shape[-1])
    for t in range(1, steps + 1):
        factor = 1.0 / t if momentum is None else momentum
        mean = (1 - factor) * mean + factor * flat.mean(0)
        var = (1 - factor) * var + factor * flat.var(0, ddof=1)
    return mean, var


def test_the_issues_reproduction_now_matches_torch():
    bn = fdp.SyncBatchNorm(use_running_average=False, momentum=0.1)
    v = bn.init(jax.random.key(0), X16)
    y, u = bn.apply(v, X16, mutable=["batch_stats"])
    mean, var = torch_running(X16)
    np.testing.assert_allclose(u["batch_stats"]["mean"], mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(u["batch_stats"]["var"], var, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y, (X16 - X16.mean(0)) / np.sqrt(X16.var(0) + 1e-5), atol=1e-5)
    # Flax's BatchNorm moves towards the biased variance: 15/16 of torch's step.
    flax_bn = nn.BatchNorm(use_running_average=False, momentum=0.9)
    _, f = flax_bn.apply(flax_bn.init(jax.random.key(0), X16), X16, mutable=["batch_stats"])
    ratio = (f["batch_stats"]["var"] - 0.9) / (u["batch_stats"]["var"] - 0.9)
    np.testing.assert_allclose(ratio, 15 / 16, rtol=1e-5)


def test_against_torch_itself():
    torch = pytest.importorskip("torch")
    x = RNG.normal(size=(6, 4, 5, 3)).astype(np.float32)  # NHWC
    ours = fdp.SyncBatchNorm(momentum=None)  # torch's cumulative average
    v = ours.init(jax.random.key(0), x, False)
    theirs = torch.nn.BatchNorm2d(3, momentum=None)
    tx = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())  # NCHW
    for scale in (1.0, 2.0):  # two training steps
        y, u = ours.apply(v, x * scale, False, mutable=["batch_stats"])
        v = {"params": v["params"], "batch_stats": u["batch_stats"]}
        ty = theirs(tx * scale).detach().numpy().transpose(0, 2, 3, 1)
        np.testing.assert_allclose(y, ty, atol=2e-6)
    stats = v["batch_stats"]
    np.testing.assert_allclose(stats["mean"], theirs.running_mean.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(stats["var"], theirs.running_var.numpy(), rtol=1e-6, atol=1e-7)
    assert int(stats["num_batches_tracked"]) == int(theirs.num_batches_tracked)
    theirs.eval()
    eval_y = ours.apply(v, x, use_running_average=True)
    ty = theirs(tx).detach().numpy().transpose(0, 2, 3, 1)
    np.testing.assert_allclose(eval_y, ty, atol=2e-6)


class Net(nn.Module):
    convert: bool = False  # nn.BatchNorm under fdp.sync_batchnorm instead of fdp's layer

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="dense")(x)
        if self.convert:
            h = nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn")(h)
        else:
            h = fdp.SyncBatchNorm(use_running_average=False, name="bn")(h)
        return nn.Dense(1, name="out")(h)[:, 0]


def train_one_step(convert, batch, mask):
    model = Net(convert)
    variables = model.init(jax.random.key(0), batch["x"][:2])

    def loss_fn(params, b, batch_stats):
        def run():
            return model.apply(
                {"params": params, "batch_stats": batch_stats}, b["x"], mutable=["batch_stats"]
            )

        if convert:
            with fdp.sync_batchnorm():
                pred, updates = run()
        else:
            pred, updates = run()
        return (pred - b["y"]) ** 2, updates["batch_stats"]

    state = fdp.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.sgd(0.1),
        batch_stats=variables["batch_stats"],
    )
    step = fdp.train_step(loss_fn, per_example=True)
    state, _ = step(fdp.replicate(state), fdp.shard_batch(batch), mask=fdp.shard_batch(mask))
    return variables, state


@pytest.mark.parametrize("convert", [False, True])
def test_statistics_span_the_devices_and_leave_out_joins_padding(convert):
    # Devices 2 and 5 are out of data; device 1 holds one real example.
    lengths = [2, 1, 0, 2, 2, 0, 2, 2]
    streams = [
        [{"x": RNG.normal(size=(n, 3)).astype(np.float32), "y": np.zeros(n, np.float32)}]
        if n
        else []
        for n in lengths
    ]
    like = {"x": np.zeros((1, 3), np.float32), "y": np.zeros(1, np.float32)}
    ((batch, mask),) = list(fdp.join(*streams, batch_size=2, like=like))
    batch["x"][mask == 0] = 1e3  # padding that would wreck the statistics if it entered
    variables, state = train_one_step(convert, batch, mask)
    dense = variables["params"]["dense"]
    real = batch["x"][mask > 0] @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])
    mean, var = torch_running(real)  # torch's BatchNorm1d on the 11 real rows
    stats = state.batch_stats["bn"]
    np.testing.assert_allclose(stats["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["var"], var, rtol=1e-5, atol=1e-6)


def test_nnx_layer_and_conversion():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(3, 4, rngs=rngs)
            self.norms = nnx.List([nnx.BatchNorm(4, momentum=0.9, rngs=rngs)])

        def __call__(self, x):
            return self.norms[0](self.dense(x))

    model = fdp.convert_sync_batchnorm(Model(nnx.Rngs(0)))
    assert isinstance(model.norms[0], fdp.NNXSyncBatchNorm)
    assert model.norms[0].momentum == pytest.approx(0.1)
    kernel, bias = np.asarray(model.dense.kernel[...]), np.asarray(model.dense.bias[...])
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    step = fdp.nnx_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2))
    step(model, optimizer, fdp.shard_batch({"x": X16}))
    mean, var = torch_running(X16 @ kernel + bias)
    np.testing.assert_allclose(model.norms[0].mean[...], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.norms[0].var[...], var, rtol=1e-5, atol=1e-6)


def test_momentum_is_torchs():
    with pytest.raises(ValueError, match=r"momentum is torch's.*got momentum=1.5"):
        fdp.SyncBatchNorm(use_running_average=False, momentum=1.5).init(jax.random.key(0), X16)
    with pytest.raises(ValueError, match="momentum is torch's"):
        fdp.NNXSyncBatchNorm(3, momentum=-0.1)
