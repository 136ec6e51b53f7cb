"""The GPU compile tier: fdp's step compiled by XLA's GPU compiler for 8 x H100, no GPU.

What the tier pins, read from the compiled, scheduled GPU program: every ZeRO stage
lowers from shapes alone (nothing runs); each bucket of the plan is exactly one
collective of the step's reduction (an all-reduce, or a reduce-scatter under ZeRO)
named by its bucket, for the default and bf16 hooks, with and without accumulation;
stage 3 gathers each bucket's parameters in one all-gather; accumulation keeps every
collective out of the micro-batch loop and overlaps the reductions with the last
micro-batch's backward products.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp
from fdp import _compat
from fdp.observe import _gpu
from fdp.observe._hlo import collective_stats, loop_collectives
from fdp.observe._schedule import read_schedule

pytestmark = pytest.mark.gpu_compile

CAPS = {"bucket_cap_mb": 0.25, "first_bucket_cap_mb": 0.25}  # 4 buckets for the MLP below
REDUCTION = {0: "all-reduce", 1: "reduce-scatter", 2: "reduce-scatter", 3: "reduce-scatter"}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(16)(x)


def loss_fn(params, batch):
    logits = MLP().apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def abstract_inputs(mesh, rows=64):
    def make():
        params = MLP().init(jax.random.key(0), jnp.zeros((1, 256)))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    state = fdp.replicate(jax.eval_shape(make), mesh)  # shapes only: nothing is placed
    data = NamedSharding(mesh, P("data"))
    batch = {
        "x": jax.ShapeDtypeStruct((rows, 256), jnp.float32, sharding=data),
        "y": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=data),
    }
    return state, batch


def compile_step(mesh, kept_gathered=False, **settings):
    if kept_gathered:  # stage 3 with reshard_after_forward=False: one gather per bucket
        stage = settings.pop("zero_stage", 0)
        settings["sharding"] = fdp.Sharding(zero_stage=stage, reshard_after_forward=False)
    step = fdp.train_step(loss_fn, mesh=mesh, **CAPS, **settings)
    compiled = step.lower(*abstract_inputs(mesh)).compile()
    return step, compiled


@pytest.mark.parametrize("accumulate_steps", [1, 4])
@pytest.mark.parametrize("comm_hook", [None, "bf16_compress"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_each_bucket_is_one_collective_of_the_gpu_program(
    gpu_mesh, zero_stage, comm_hook, accumulate_steps
):
    step, compiled = compile_step(
        gpu_mesh,
        zero_stage=zero_stage,
        comm_hook=comm_hook,
        accumulate_steps=accumulate_steps,
        kept_gathered=True,  # per-use gathers reduce-scatter per leaf, in the backward pass
    )
    plan = step.plan
    assert step.config.bound_layout == "flat"  # the GPU default
    assert len(plan.buckets) == 4
    ops = collective_stats(compiled).ops
    kind = REDUCTION[zero_stage]
    reductions = [op.buckets for op in ops if op.kind == kind and op.buckets]
    # One collective per bucket, each naming its bucket alone: none merged, none split.
    assert sorted(reductions) == [(b.index,) for b in plan.buckets]
    if zero_stage == 3:  # the parameters are gathered one bucket at a time
        gathers = [op.buckets for op in ops if op.kind == "all-gather" and op.buckets]
        assert sorted(gathers) == [(b.index,) for b in plan.buckets]
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes > 0


def test_a_bucket_is_one_all_reduce_of_its_gradients_where_they_lie(gpu_mesh):
    step, compiled = compile_step(gpu_mesh)
    assert step.config.groups_buckets  # GPU, flat layout, the mean all-reduce hook
    ops = collective_stats(compiled).ops
    reductions = {op.buckets: op for op in ops if op.buckets}
    assert sorted(reductions) == [(b.index,) for b in step.plan.buckets]
    last = step.plan.buckets[-1].index
    for bucket in step.plan.buckets:  # the gradients themselves, not a packed flat buffer
        # The last bucket's all-reduce carries the loss too (a scalar), as plain jit's
        # partitioner merges the loss with a gradient: no all-reduce of its own.
        loss = [()] if bucket.index == last else []
        assert sorted(reductions[(bucket.index,)].shapes) == sorted([*bucket.shapes, *loss])
    assert [op for op in ops if op.kind == "all-reduce" and not op.buckets] == []
    # Packing (the bf16 hook's flat buffer) is what the grouping saves: one buffer each.
    _, packed = compile_step(gpu_mesh, comm_hook="bf16_compress")
    packed_ops = [op for op in collective_stats(packed).ops if op.buckets]
    assert all(len(op.shapes) == 1 for op in packed_ops)


def test_accumulation_overlaps_the_last_micro_batch_and_loops_without_collectives(gpu_mesh):
    step, compiled = compile_step(gpu_mesh, accumulate_steps=4)
    assert loop_collectives(compiled).ops == ()  # no_sync: nothing crosses devices in the loop
    schedule = read_schedule(compiled, "h100_sxm")
    reductions = [c for c in schedule.collectives if c.kind == "all-reduce" and c.buckets]
    assert len(reductions) == len(step.plan.buckets) == 4
    # Backward products of the last micro-batch run while some bucket is in flight.
    assert any(c.flops_in_flight > 0 for c in reductions)


def test_the_last_micro_batch_adds_into_the_accumulator_in_place(gpu_mesh):
    # The last micro-batch and the bucket reductions run in a loop of one trip, where
    # the accumulator is the loop's parameter: each weight-gradient product adds into
    # it in place and the all-reduce reduces it there. The accumulators then take the
    # place of the gradients of a step without accumulation, and the temp memory is
    # that step's (within 1%). After the loop XLA gave each product and each sum a
    # buffer of their own: 1.49x here.
    _, one = compile_step(gpu_mesh)
    _, four = compile_step(gpu_mesh, accumulate_steps=4)
    assert (
        four.memory_analysis().temp_size_in_bytes <= 1.01 * one.memory_analysis().temp_size_in_bytes
    )


def test_one_gpu_accumulates_in_one_loop_as_plain_jit_scans(gpu_mesh):
    # On one GPU fdp reduces nothing, so nothing could overlap the last micro-batch:
    # every micro-batch runs in the one loop of K trips (held after it, with a barrier
    # and a loop of one trip, the step cost 1.013-1.053x plain jit on one H100/H200).
    mesh = _gpu.gpu_mesh("h100_sxm", 1)
    step, compiled = compile_step(mesh, accumulate_steps=4)
    assert not step.config.holds_last_micro_batch and not step.step_plan.last_in_loop
    assert re.findall(r'"known_trip_count":\{"n":"(\d+)"', compiled.as_text()) == ["4"]
    eight, _ = compile_step(gpu_mesh, accumulate_steps=4)
    assert eight.config.holds_last_micro_batch  # where there is something to overlap


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"accumulate_steps": 4}, True),
        ({"accumulate_steps": 1}, False),
        ({"accumulate_steps": 4, "comm_hook": "bf16_compress"}, False),  # packs its buckets
        ({"accumulate_steps": 4, "zero_stage": 1}, False),
        (
            {
                "accumulation": fdp.Accumulation(steps=4),
                "sharding": fdp.Sharding(param_dtype=jnp.bfloat16),
            },
            False,
        ),
    ],
)
def test_which_gpu_steps_reduce_in_the_loop_of_the_last_micro_batch(gpu_mesh, settings, expected):
    step = fdp.train_step(loss_fn, mesh=gpu_mesh, **settings)
    lowered = step.lower(*abstract_inputs(gpu_mesh))
    assert step.config.reduces_with_last_micro_batch is expected
    assert step.step_plan.last_in_loop is expected
    assert (_compat.XLA_KEEP_ONE_TRIP_LOOP in lowered.as_text()) is expected
    assert not loop_collectives(lowered).ops  # a loop of one trip repeats nothing


def test_stage_3_keeps_parameters_sharded_between_steps(gpu_mesh):
    step, compiled = compile_step(gpu_mesh, zero_stage=3)
    shardings = jax.tree.leaves(compiled.output_shardings[0].params)
    kernels = [s for s in shardings if s.spec != P()]
    assert kernels, "stage 3 returns some parameter sharded over the data axis"
    assert step.memory_table() is not None


def test_targets_and_meshes_are_checked():
    with pytest.raises(ValueError, match="target must be one of"):
        _gpu.gpu_target("h200_nvl")
    with pytest.raises(ValueError, match="shape must have one size per axis"):
        _gpu.gpu_mesh("h100_sxm", 8, axis_name=("host", "device"), shape=(2, 3))
    assert _gpu.compiler_packages()[0].startswith("jax-cuda12-plugin==")
    assert "A100" in _gpu.gpu_target("a100_sxm_80").config_text()


class Decoder(nn.Module):
    """A 6-layer GPT-style decoder (benchmarks/gpu_programs.py's, narrower)."""

    depth: int = 6
    width: int = 512
    vocab: int = 8192

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=8)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def test_buckets_leave_in_ready_order_while_most_of_the_backward_pass_is_to_run(gpu_mesh):
    def loss(params, batch):
        logits = Decoder().apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def make():
        params = Decoder().init(jax.random.key(0), jnp.zeros((1, 512), jnp.int32))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    state = fdp.replicate(jax.eval_shape(make), gpu_mesh)
    rows = NamedSharding(gpu_mesh, P("data"))
    tokens = jax.ShapeDtypeStruct((64, 512), jnp.int32, sharding=rows)
    step = fdp.train_step(loss, mesh=gpu_mesh)
    compiled = step.lower(state, {"x": tokens, "y": tokens}).compile()
    schedule = read_schedule(compiled, "h100_sxm")
    reductions = [c for c in schedule.collectives if c.kind == "all-reduce" and c.buckets]
    # Bucket 0 holds the head (its gradient is ready first), the last bucket the embedding.
    assert "['Dense_12']['kernel']" in step.plan.buckets[0].key_paths  # the head
    assert "['Embed_0']['embedding']" in step.plan.buckets[-1].key_paths
    assert [c.buckets for c in reductions] == [(b.index,) for b in step.plan.buckets]
    # Backward products are two thirds of the step's: the first bucket leaves with more
    # than a third of all products (over half the backward pass) still to run.
    assert reductions[0].flops_after_start > 1 / 3


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_an_nnx_step_with_dropout_compiles_from_shapes_alone(gpu_mesh, zero_stage):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(256, 256, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.out = nnx.Linear(256, 16, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(nnx.relu(self.hidden(x))))

    def make():
        model = Net(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(make)  # nothing allocated
    rows = NamedSharding(gpu_mesh, P("data"))
    batch = {
        "x": jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=rows),
        "y": jax.ShapeDtypeStruct((64,), jnp.int32, sharding=rows),
    }

    def loss(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    # Stage 3 kept gathered: one named reduction per bucket, as at stage 0.
    kept = fdp.Sharding(zero_stage=zero_stage, reshard_after_forward=False)
    step = fdp.nnx_train_step(loss, mesh=gpu_mesh, sharding=kept)
    ops = collective_stats(step.lower(model, optimizer, batch).compile()).ops
    kind = REDUCTION[zero_stage]
    assert sorted(op.buckets for op in ops if op.kind == kind and op.buckets) == [
        (b.index,) for b in step.plan.buckets
    ]
    if zero_stage == 3:  # gathered per use: each leaf's gradient leaves as a reduce-scatter
        step = fdp.nnx_train_step(loss, mesh=gpu_mesh, sharding=fdp.Sharding(zero_stage=3))
        ops = collective_stats(step.lower(model, optimizer, batch).compile()).ops
        assert sum(op.kind == "reduce-scatter" for op in ops) >= len(step.plan.buckets)
        # The whole net is under one group's cap: the forward pass's last uses, kept
        # gathered for the backward pass (as FSDP2's root module), so gathered once.
        assert sum(op.kind == "all-gather" for op in ops) == len(step.plan.buckets)


def test_fdp_describe_reads_the_gpu_program(gpu_mesh, capsys):
    from fdp.cli import main

    args = ["describe", "--model", "transformer", "--gpu", "a100_sxm_80"]
    assert main([*args, "--bucket-cap-mb", "0.5", "--first-bucket-cap-mb", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "compiled for NVIDIA A100-SXM4-80GB (deviceless" in out
    assert "buckets: 5 in the plan; 5 collective(s) carry exactly one" in out
    assert "memory per GPU: temp" in out
    assert main(["describe", "--model", "mypkg:params", "--gpu", "h100_sxm"]) == 2
    assert "compiles a built-in model's step" in capsys.readouterr().err


@pytest.mark.timeout(1200)  # a loaded 2-core machine took over 300 s to compile it
def test_stage_3_per_use_gathers_in_groups_one_group_ahead_in_both_passes(gpu_mesh):
    model = Decoder(depth=3, width=256, vocab=1024)  # small: the per-use step compiles slowly

    def loss(params, batch):
        logits = jnp.asarray(model.apply({"params": params}, batch["x"]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def make():
        params = model.init(jax.random.key(0), jnp.zeros((1, 128), jnp.int32))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    # Groups of about 1 MiB of parameters (a 256 x 1024 kernel): 12 of them here.
    step = fdp.train_step(
        loss,
        mesh=gpu_mesh,
        sharding=fdp.Sharding(zero_stage=3),
        reduction=fdp.Reduction(bucket_cap_mb=1),
    )
    state = step.abstract_init(make)
    tokens = jax.ShapeDtypeStruct((16, 128), jnp.int32, sharding=NamedSharding(gpu_mesh, P("data")))
    compiled = step.lower(state, {"x": tokens, "y": tokens}).compile()
    ops = read_schedule(compiled, "h100_sxm").collectives
    leaves = len(jax.tree.leaves(state.params))  # 53, each split over the 8 GPUs
    forward = [c.products_in_flight for c in ops if c.kind == "all-gather" and not c.backward]
    backward = [c.products_in_flight for c in ops if c.kind == "all-gather" and c.backward]
    scatters = [c for c in ops if c.kind == "reduce-scatter"]
    # One collective per group, not per leaf: a group's gathers (and its gradients'
    # reduce-scatters) are tied to one value and tagged with one combiner key, and XLA
    # merges them. Per use, this step had 53 forward gathers, 26 backward, 53 scatters.
    assert 8 <= len(forward) <= leaves // 3, sorted(forward)
    assert 8 <= len(backward) <= leaves // 3, sorted(backward)
    assert 8 <= len(scatters) <= leaves // 3, len(scatters)
    # Each group's gathers may start while the group before it computes, in the forward
    # pass, and while the group after it computes, in the backward pass. Per use (each
    # tied to its own use) 2 of the 26 backward gathers had a gemm in flight; here 8 of
    # 10 (a bias's gather is not needed in the backward pass), and 10 of 12 forward ones.
    assert sum(n > 0 for n in forward) >= 0.6 * len(forward), sorted(forward)
    assert sum(n > 0 for n in backward) >= 0.6 * len(backward), sorted(backward)
    assert max(backward) >= 3, sorted(backward)


def test_prefetch_off_gathers_each_use_on_its_own(gpu_mesh):
    gathers = {}
    for prefetch in (True, False):
        sharding = fdp.Sharding(zero_stage=3, prefetch=prefetch)
        step, compiled = compile_step(gpu_mesh, sharding=sharding)
        assert step.config.prefetch_groups == int(prefetch)
        gathers[prefetch] = [op for op in collective_stats(compiled).ops if op.kind == "all-gather"]
    # Groups of about bucket_cap_mb (0.25 MiB: a kernel and the bias before it): one
    # all-gather of several operands each. Off: one leaf per all-gather, as on CPU.
    assert any(len(op.dtypes) > 1 for op in gathers[True])
    assert all(len(op.dtypes) == 1 for op in gathers[False])
    assert len(gathers[False]) > len(gathers[True])


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(x.shape[-1])(x)), None


class _Stack(nn.Module):
    """Four layers under ``nn.scan(nn.remat(...))`` between two plain ones."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64)(x)
        layers = nn.scan(
            nn.remat(_Layer), variable_axes={"params": 0}, split_rngs={"params": True}, length=4
        )
        return nn.Dense(8)(layers()(x, None)[0])


def _stack_step(gpu_mesh):
    """A stage-3 step of :class:`_Stack` for 8 compile-only H100s, and its lowered program."""
    model = _Stack()

    def loss(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    def make():
        params = model.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    step = fdp.train_step(loss, mesh=gpu_mesh, sharding=fdp.Sharding(zero_stage=3))
    rows = NamedSharding(gpu_mesh, P("data"))
    batch = {
        "x": jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=rows),
        "y": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=rows),
    }
    return step, step.lower(step.abstract_init(make), batch)


@pytest.mark.timeout(1200)
def test_stage_3_gathers_a_scanned_stack_per_layer_with_prefetch_on(gpu_mesh):
    # Prefetch anchors a gather to an activation some uses back; the loop body is
    # another trace, so its activations anchor only the body's gathers (an anchor
    # leaking out of the body was an escaped tracer).
    step, lowered = _stack_step(gpu_mesh)
    compiled = lowered.compile()
    assert step.config.prefetch_groups > 0
    assert loop_collectives(compiled).count("all-gather") >= 2  # forward and backward loops


@pytest.mark.timeout(1200)
def test_stage_3_keeps_a_scanned_stacks_reduce_scatters_in_their_loop_trip(gpu_mesh):
    # XLA:GPU's pipeliner would move each trip's reduce-scatter into the next trip and
    # keep the layer's whole gradient (and a copy) alive across the boundary: 11% of the
    # peak of issue 31's scanned GPT at width 1728 (1031.9 against 919.1 MiB).
    step, lowered = _stack_step(gpu_mesh)
    options = step.config.compiler_options
    device = gpu_mesh.devices.flat[0]
    # This XLA's name of the switch (jax 0.10: a bool; 0.12: a pipelining mode).
    off = _compat.known_compile_options(device, {_compat.GPU_PIPELINED_REDUCE_SCATTER: False})
    on = _compat.known_compile_options(device, {_compat.GPU_PIPELINED_REDUCE_SCATTER: True})
    assert off and options is not None and off.items() <= options.items()
    pipelined = {**options, **on}
    ours = lowered.compile().memory_analysis().temp_size_in_bytes
    theirs = lowered.compile(pipelined).memory_analysis().temp_size_in_bytes
    assert ours < theirs


class _Megatron(nn.Module):
    """An MLP split over 'model' as Megatron splits it: columns, then rows."""

    @nn.compact
    def __call__(self, x):
        split = nn.with_partitioning
        h = nn.Dense(512, kernel_init=split(nn.initializers.lecun_normal(), (None, "model")))(x)
        return nn.Dense(256, kernel_init=split(nn.initializers.lecun_normal(), ("model", None)))(
            nn.relu(h)
        )


def _megatron_step(shape, model=None, **settings):
    """A step of ``model`` (:class:`_Megatron`) on a data x model mesh of 8 compile-only H100s.

    Returns the step, its abstract state and a batch of shapes, all on that mesh.
    """
    mesh = _gpu.gpu_mesh("h100_sxm", 8, axis_name=("data", "model"), shape=shape)
    model = _Megatron() if model is None else model

    def loss(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    def make():
        params = model.init(jax.random.key(0), jnp.zeros((1, 256)))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    step = fdp.train_step(loss, mesh=mesh, **CAPS, **settings)
    data = NamedSharding(mesh, P("data"))
    batch = {
        "x": jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=data),
        "y": jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=data),
    }
    return step, step.abstract_init(make), batch


def test_stage_3_ties_its_gathers_without_an_all_reduce_over_the_model_axis():
    """Per use, a gather waits for the activations before it, read whole by a barrier.

    A tie that read one element of an activation split over 'model' cost a scalar
    all-reduce over 'model' at every use (18 in benchmarks/gpu_tensor_parallel.py's
    decoder), which plain jit's program does not have.
    """
    if (status := _gpu.gpu_compiler_status()) is not None:
        pytest.skip(status)
    step, state, batch = _megatron_step((4, 2), zero_stage=3)
    assert state.params["Dense_0"]["kernel"].value.sharding.spec == P("data", "model")
    ops = collective_stats(step.lower(state, batch).compile()).ops
    over_model = {(0, 1), (2, 3), (4, 5), (6, 7)}  # device ids along 'model' of (4, 2)
    on_model = [op for op in ops if op.kind == "all-reduce" and set(op.groups) == over_model]
    assert on_model, "the row-split layer's all-reduces over 'model' (XLA's), forward and back"
    assert [op.nbytes for op in on_model if op.nbytes <= 8] == []
    assert any(op.kind == "all-gather" for op in ops)


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)], ids=["4x2", "2x4"])
def test_a_model_split_bucket_is_one_all_reduce_of_its_blocks(shape):
    """Stage 0 on a mesh with a model axis: one all-reduce over 'data' per bucket.

    Left to XLA's partitioner, a model-split bucket's all-reduce came out as one
    untagged all-reduce per leaf (34 over 'data' for the 13 buckets of
    benchmarks/gpu_tensor_parallel.py's decoder); on each device's block, tagged with
    the bucket's key, XLA merges the bucket's into one.
    """
    if (status := _gpu.gpu_compiler_status()) is not None:
        pytest.skip(status)
    step, state, batch = _megatron_step(shape)
    mesh = step.config.bound_mesh
    ops = collective_stats(step.lower(state, batch).compile()).ops
    layouts = {b.layout for b in step.plan.buckets}
    assert P(None, "model") in layouts and P("model") in layouts, step.plan.buckets
    rows = {tuple(int(d.id) for d in row) for row in mesh.devices.T}  # along 'data'
    over_data = [op for op in ops if op.kind == "all-reduce" and set(op.groups) == rows]
    assert sorted(op.buckets for op in over_data) == [(b.index,) for b in step.plan.buckets]
    assert step.config.groups_buckets


@pytest.mark.parametrize("hook", ["bf16_compress", "quantize_per_tensor"])
def test_a_compressing_hook_on_a_model_split_mesh_sends_nothing_over_the_model_axis(hook):
    """The casting and quantizing hooks run on each device's blocks of a bucket.

    Left to XLA's partitioner, bf16 compression reduce-scattered and all-gathered the
    model-split gradients over 'model' (a reduce-scatter of 8 KiB and three
    all-gathers on 4 x 2) and quantization all-gathered them there; now the step's
    collectives over 'model' are the default hook's: the tensor-parallel layers' own
    (on jax 0.12 XLA sends one of them, the replicated bias's gradient gathered from
    its model-split pieces, in bfloat16 under bf16 compression: half the bytes).
    """
    if (status := _gpu.gpu_compiler_status()) is not None:
        pytest.skip(status)

    def over_model(**settings):
        step, state, batch = _megatron_step((4, 2), **settings)
        ops = collective_stats(step.lower(state, batch).compile()).ops
        columns = {tuple(int(d.id) for d in row) for row in step.config.bound_mesh.devices}
        return sorted((op.kind, op.nbytes) for op in ops if set(op.groups) == columns)

    hooked = {"quantize_per_tensor": fdp.hooks.quantize_per_tensor()}.get(hook, hook)
    got, default = over_model(comm_hook=hooked), over_model()
    assert [kind for kind, _ in got] == [kind for kind, _ in default], (got, default)
    assert all(a <= b for (_, a), (_, b) in zip(got, default, strict=True)), (got, default)


class _MegatronLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + _Megatron()(x), None


class _ScannedMegatron(nn.Module):
    """Four :class:`_Megatron` blocks in one ``nn.scan``: stacked kernels split over 'model'."""

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            _MegatronLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=4,
            metadata_params={nn.PARTITION_NAME: None},
        )
        return layers()(x, None)[0]


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_a_scanned_stack_is_reduce_scattered_on_its_model_blocks_in_the_loop(zero_stage):
    """Stages 1-2 reduce-scatter each layer's gradient in the backward loop, on its block.

    Left to XLA's partitioner, each layer's model-split kernel gradients were first
    all-gathered whole over 'model' (two 512 x 256 kernels per layer), then
    reduce-scattered. XLA's own tensor-parallel collectives of the activations stay.
    """
    if (status := _gpu.gpu_compiler_status()) is not None:
        pytest.skip(status)
    step, state, batch = _megatron_step((4, 2), zero_stage=zero_stage, model=_ScannedMegatron())
    assert step.config.reduces_scanned_in_loop
    compiled = step.lower(state, batch).compile()
    ops = collective_stats(compiled).ops
    over_model = {(0, 1), (2, 3), (4, 5), (6, 7)}  # device ids along 'model' of (4, 2)
    kernels = {(256, 512), (512, 256)}  # a layer's kernels, whole
    gathered = [op for op in ops if op.kind == "all-gather" and set(op.groups) == over_model]
    assert gathered, "XLA's all-gathers of activations over 'model'"
    assert [op for op in gathered if kernels & set(op.shapes)] == []
    in_loop = [op for op in loop_collectives(compiled).ops if op.kind == "reduce-scatter"]
    assert in_loop, "each layer's gradient reduce-scattered inside the backward loop"
