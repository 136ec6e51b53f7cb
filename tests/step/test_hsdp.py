"""Hybrid sharding (HSDP): ZeRO stages 1-3 inside each host, replicated across hosts.

8 simulated devices as 2 "hosts" x 4. The reference is stage 0 (DDP) on the same
mesh; `shard_over="all"` (ZeRO over both axes together) is checked beside it. The
program is read from the compiled HLO's replica groups.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, cross_entropy, make_data
from flax import nnx
from flax.training.train_state import TrainState

import fdp
from fdp.hooks import allreduce, reduce_with_hook
from fdp.observe._hlo import collective_stats
from fdp.step.layout._hybrid import hybrid
from fdp.step.options._policies import ShardOver

AXES = fdp.HOST_AXES
STEPS = 3
INSIDE = [[0, 1, 2, 3], [4, 5, 6, 7]]  # each host's devices
ACROSS = [[0, 4], [1, 5], [2, 6], [3, 7]]  # one device of each host
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    # A small threshold, so that the global norm (over shares) really clips.
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
}
MODES: list[tuple[int, ShardOver]] = [(s, o) for s in (1, 2, 3) for o in ("inner", "all")]


def host_mesh():
    return fdp.data_mesh(axis_name=AXES, hosts=2)


def batches(num=STEPS, rows=32, seed=1):
    data = make_data(seed, rows * num)
    return [{k: v[i * rows : (i + 1) * rows] for k, v in data.items()} for i in range(num)]


def linen_state(opt, classes=10, cls=TrainState):
    model = MLP(classes=classes)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    return cls.create(apply_fn=model.apply, params=params, tx=OPTIMIZERS[opt]())


def train(mesh, state, data, stage=0, over: ShardOver = "all", *, classes=10, **kwargs):
    sharding = fdp.Sharding(zero_stage=stage, shard_over=over) if stage else None
    step = fdp.train_step(
        cross_entropy(MLP(classes=classes).apply),
        mesh=mesh,
        axis_name=AXES,
        sharding=sharding,
        **kwargs,
    )
    state, metrics = fdp.replicate(state, mesh), {}
    for batch in data:
        state, metrics = step(state, fdp.shard_batch(batch, mesh, axis_name=AXES))
    return state, step, metrics


def close(got, want, atol=1e-6):
    chex.assert_trees_all_close(jax.device_get(got), jax.device_get(want), atol=atol, rtol=1e-6)


def close_padded(got, want, over: ShardOver):
    """Optimizer state kept padded (fdp.step.layout._padding) equal to ``want`` where it is not
    padding, zeros in the padding; the one leaf 4 (or 8) does not divide, the head's bias
    of 10, is padded for the devices the state is sharded over: 12 inside a host, 16 over all.
    """
    got, want = jax.device_get(got), jax.device_get(want)
    padded = [
        g.shape
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        if g.shape != w.shape
    ]
    assert padded and set(padded) == {(12,) if over == "inner" else (16,)}, padded

    def cut(g, w):
        region = tuple(slice(0, s) for s in np.shape(w))
        rest = np.array(g)
        rest[region] = 0
        assert not rest.any()  # the padding stays zero
        return np.asarray(g)[region]

    close(jax.tree.map(cut, got, want), want)


@pytest.mark.parametrize(
    "opt", [pytest.param(o, marks=[] if o == "adam" else pytest.mark.slow) for o in OPTIMIZERS]
)
def test_linen_stages_1_to_3_equal_stage_0_sharded_inside_hosts_or_over_all(opt):
    mesh, data = host_mesh(), batches()
    want, _, want_metrics = train(mesh, linen_state(opt), data)
    for stage, over in MODES:
        got, _, metrics = train(mesh, linen_state(opt), data, stage, over)
        close(got.params, want.params)
        close_padded(got.opt_state, want.opt_state, over)
        np.testing.assert_allclose(float(metrics["loss"]), float(want_metrics["loss"]), rtol=1e-6)
        # The first layer's momentum (SGD) or mu and nu (Adam): [64, 32] each.
        kernels = [x for x in jax.tree.leaves(got.opt_state) if x.shape == (64, 32)]
        share = kernels[0].addressable_shards[0].data.shape
        assert share == ((16, 32) if over == "inner" else (8, 32)), (stage, over)


@pytest.mark.slow
def test_kept_gathered_flat_buckets_and_accumulation_under_hsdp():
    """Stage 3 gathering every bucket at the start (inside the host), flat buckets, and
    micro-batches with per-use gathers: all equal to stage 0."""
    mesh, data = host_mesh(), batches()
    want, _, _ = train(mesh, linen_state("adam"), data)
    kept = fdp.Sharding(zero_stage=3, shard_over="inner", reshard_after_forward=False)
    variants = [
        {"sharding": kept},
        {"reduction": fdp.Reduction(layout="flat")},
        {"accumulation": fdp.Accumulation(steps=2)},
    ]
    for kwargs in variants:
        sharding = kwargs.pop("sharding", fdp.Sharding(zero_stage=3, shard_over="inner"))
        step = fdp.train_step(
            cross_entropy(MLP().apply), mesh=mesh, axis_name=AXES, sharding=sharding, **kwargs
        )
        state = fdp.replicate(linen_state("adam"), mesh)
        for batch in data:
            state, _ = step(state, fdp.shard_batch(batch, mesh, axis_name=AXES))
        close(state.params, want.params)


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 16, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.head(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def nnx_train(mesh, data, stage=0, over: ShardOver = "all"):
    model = NNXNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, OPTIMIZERS["clip+adam"](), wrt=nnx.Param)

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    sharding = fdp.Sharding(zero_stage=stage, shard_over=over) if stage else None
    step = fdp.nnx_train_step(loss_fn, mesh=mesh, axis_name=AXES, sharding=sharding)
    for batch in data:
        step(model, optimizer, fdp.shard_batch(batch, mesh, axis_name=AXES))
    return model, optimizer


def test_nnx_stages_1_to_3_equal_stage_0_sharded_inside_hosts_or_over_all():
    mesh, data = host_mesh(), batches()
    want_model, want_opt = nnx_train(mesh, data)
    for stage, over in MODES:
        model, optimizer = nnx_train(mesh, data, stage, over)
        close(nnx.state(model), nnx.state(want_model))
        close_padded(nnx.state(optimizer.opt_state), nnx.state(want_opt.opt_state), over)
        mu = optimizer.opt_state[1][0].mu["l1"]["kernel"][...]
        share = mu.addressable_shards[0].data.shape
        assert share == ((16, 32) if over == "inner" else (8, 32)), (stage, over)


def _groups(op):
    return [list(g) for g in op.groups]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_compiled_program_scatters_inside_hosts_and_sends_a_quarter_across(stage):
    # 16 classes: every leaf has a dimension 4 divides: every gradient is scattered.
    mesh = host_mesh()
    state = fdp.replicate(linen_state("adam", classes=16), mesh)
    batch = fdp.shard_batch(batches(1)[0], mesh, axis_name=AXES)
    step = fdp.train_step(
        cross_entropy(MLP(classes=16).apply),
        mesh=mesh,
        axis_name=AXES,
        sharding=fdp.Sharding(zero_stage=stage, shard_over="inner"),
        reduction=fdp.Reduction(bucket_cap_mb=1e9),  # one bucket: one hop across hosts
    )
    ops = collective_stats(step.lower(state, batch).compile()).ops
    by_kind = {k: [op for op in ops if op.kind == k] for k in {op.kind for op in ops}}
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    # Gradients: one reduce-scatter per leaf, each inside a host.
    scatters = by_kind["reduce-scatter"]
    assert len(scatters) == len(jax.tree.leaves(state.params))
    assert all(_groups(op) == INSIDE for op in scatters)
    # The shares cross hosts in one all-reduce of a quarter of the gradient's bytes.
    (hop,) = [op for op in by_kind["all-reduce"] if _groups(op) == ACROSS]
    assert hop.nbytes == param_bytes // 4
    # Nothing else of size crosses all 8 devices: the loss (a scalar) only.
    assert all(op.nbytes <= 8 for op in by_kind["all-reduce"] if op is not hop)
    # Parameters are gathered inside hosts: at stages 1-2 by the update (XLA's
    # mesh-group spelling), at stage 3 where they are used.
    gathers = by_kind["all-gather"]
    assert gathers and all(op.group_size == 4 for op in gathers)
    if stage == 3:
        assert all(_groups(op) == INSIDE for op in gathers)
        # Every leaf for the forward pass; again for the backward pass, the kernels
        # that pass a cotangent on (not the first layer's, not the biases).
        again = sum(state.params[f"Dense_{i}"]["kernel"].nbytes for i in (1, 2))
        assert sum(op.nbytes for op in gathers) == param_bytes + again


def _held(tree):
    """Bytes one device holds of the non-scalar leaves of ``tree``."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if np.ndim(x) > 0)


def test_each_device_holds_a_quarter_of_the_optimizer_state_inside_hosts():
    mesh, data = host_mesh(), batches(1)
    held = {}
    modes: list[tuple[int, ShardOver]] = [(0, "all"), (1, "inner"), (3, "inner"), (3, "all")]
    for stage, over in modes:
        state, _, _ = train(mesh, linen_state("adam", classes=16), data, stage, over, classes=16)
        held[stage, over] = (_held(state.params), _held(state.opt_state))
    params, opt = held[0, "all"]
    assert held[1, "inner"] == (params, opt // 4)
    assert held[3, "inner"] == (params // 4, opt // 4)
    assert held[3, "all"] == (params // 8, opt // 8)


def test_describe_names_the_devices_of_a_host():
    mesh, data = host_mesh(), batches(1)
    _, step, _ = train(mesh, linen_state("adam"), data, 2, "inner")
    text = fdp.describe(step)
    assert "ZeRO stage 2 over 4 device(s)" in text
    assert step.config.describe()["shard_over"] == "inner"
    assert step.config.hook.name == "hybrid(allreduce)"


def test_a_compression_hook_runs_on_the_hop_between_hosts_only():
    mesh = host_mesh()
    state = fdp.replicate(linen_state("sgd"), mesh)
    batch = fdp.shard_batch(batches(1)[0], mesh, axis_name=AXES)
    step = fdp.train_step(
        cross_entropy(MLP().apply),
        mesh=mesh,
        axis_name=AXES,
        sharding=fdp.Sharding(zero_stage=2, shard_over="inner"),
        reduction=fdp.Reduction(comm_hook="bf16_compress", bucket_cap_mb=1e9),
    )
    # Lowered: XLA:CPU promotes bf16 collectives to f32 when it compiles.
    ops = collective_stats(step.lower(state, batch)).ops
    (hop,) = [op for op in ops if op.kind == "all-reduce" and _groups(op) == ACROSS]
    assert hop.dtypes == ("bf16",)
    inside = [op for op in ops if op.kind == "reduce-scatter"]
    assert inside and all(op.dtypes == ("f32",) and _groups(op) == INSIDE for op in inside)
    new, _ = step(state, batch)
    want, _, _ = train(mesh, linen_state("sgd"), batches(1))
    close(new.params, want.params, atol=2e-3)


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_a_stateful_int8_hook_across_hosts_keeps_state_sized_to_the_shares(stage):
    mesh, data = host_mesh(), batches()
    hook = fdp.hooks.compressed_allreduce("int8", error_feedback=True)
    state, step, _ = train(
        mesh,
        linen_state("sgd", cls=fdp.TrainState),
        data,
        stage,
        "inner",
        reduction=fdp.Reduction(comm_hook=hook, bucket_cap_mb=1e9),
    )
    ((residual,),) = [jax.tree.leaves(state.comm_state)]
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    whole = 10 * 4  # the head's bias (10 entries) is no host's share
    # One float32 residual per device: its share of the one bucket.
    assert residual.shape == (8, (param_bytes - whole) // 4 // 4)
    ops = collective_stats(step.lower(state, fdp.shard_batch(data[0], mesh, axis_name=AXES))).ops
    encoded = [op for op in ops if op.kind == "all-to-all" and op.dtypes == ("s8",)]
    assert encoded and all(_groups(op) == ACROSS for op in encoded)
    want, _, _ = train(mesh, linen_state("sgd"), data)
    got = np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(state.params))])
    ref = np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(want.params))])
    assert 0 < np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.01


def test_the_hybrid_hook_alone_gives_the_whole_mean():
    """Its `reduce` (any comm hook's contract): inside, across, then gathered inside."""
    mesh = host_mesh()
    grads = {
        "w": jnp.arange(8 * 12 * 3, dtype=jnp.float32).reshape(8, 12, 3),
        "b": jnp.ones((8, 3)),
    }
    grads["b"] = grads["b"] * jnp.arange(8.0)[:, None]

    def local(g):
        g = jax.tree.map(lambda x: x[0], g)
        out, _ = reduce_with_hook(hybrid(allreduce(), inner_size=4), (), g, axis_name=AXES)
        return out

    mapped = jax.shard_map(local, mesh=mesh, in_specs=jax.P(AXES), out_specs=jax.P())
    got = mapped(grads)
    close(got, jax.tree.map(lambda x: x.mean(0), grads))


def test_bad_settings_are_named_with_their_fix():
    with pytest.raises(ValueError, match=r"shard_over must be one of \('all', 'inner'\)"):
        fdp.Sharding(zero_stage=1, shard_over="outer")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="with zero_stage=0 nothing is sharded"):
        fdp.Sharding(shard_over="inner")
    inner = fdp.Sharding(zero_stage=3, shard_over="inner")
    with pytest.raises(ValueError, match=r"needs a host x device data axis.*HOST_AXES"):
        fdp.train_step(lambda p, b: 0.0, sharding=inner)
    with pytest.raises(ValueError, match="comm_hook='bf16_compress'"):
        fdp.train_step(
            lambda p, b: 0.0,
            axis_name=AXES,
            sharding=fdp.Sharding(zero_stage=1, shard_over="inner"),
            reduction=fdp.Reduction(reduce_dtype="bfloat16"),
        )
    with pytest.raises(ValueError, match=r"shard_over='inner'\)"):
        fdp.train_step(
            lambda p, b: 0.0,
            axis_name=AXES,
            sharding=fdp.Sharding(zero_stage=2),
            reduction=fdp.Reduction(hierarchical=True),
        )
    # Two levels is what shard_over='inner' does: hierarchical=True may say so too.
    fdp.train_step(
        lambda p, b: 0.0, axis_name=AXES, sharding=inner, reduction=fdp.Reduction(hierarchical=True)
    )
    # Any hook whose replicas agree crosses hosts, even one without a reduce-scatter.
    fdp.train_step(
        lambda p, b: 0.0,
        axis_name=AXES,
        sharding=inner,
        reduction=fdp.Reduction(comm_hook="powersgd"),
    )
