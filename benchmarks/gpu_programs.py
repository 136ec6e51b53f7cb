"""fdp's step against plain jit + NamedSharding, compiled by XLA's GPU compiler (no GPU).

For each model (an MLP, a CNN, a GPT-style decoder) and each target (8 x H100 SXM,
8 x A100 SXM 80 GB), both programs are compiled deviceless (fdp.observe.gpu_mesh)
from shapes alone, and read from the compiled, scheduled module:

- collectives by kind (count, per-device bytes) and fdp's buckets among them;
- the two-stream overlap estimate of fdp.observe._schedule (matrix products at the
  target's peak, ring bytes over one NVLink direction): communication alone, the part
  the compute stream waits for (exposed), and the share hidden;
- temp and peak memory per device (peak = arguments + outputs - aliased + temp);
- the kernels one step launches (fusions, library calls, copies, collectives; a
  loop's body once per trip): what a step costs beyond its FLOPs where the GPU is
  not kept busy (``--devices 1``: nothing is communicated).

Nothing here is a timing: it is the structure and memory of the program XLA:GPU
would run. Ratios are fdp over plain jit in the same run. With accumulation, plain
jit accumulates too (a ``lax.scan`` over micro-batches; XLA reduces in every
iteration), so both hold a gradient accumulator; and a third program, ``"reduced"``,
is plain JAX's own way to reduce once per step: the replicated parameters cast to the
``reduced`` sharding type, so that their gradients come out ``unreduced``, summed
unreduced in the ``lax.scan`` and all-reduced once after it (:func:`reduced_grads`).
On a JAX without those types its row is ``None``.

    python benchmarks/gpu_programs.py --json benchmarks/results/gpu_programs.json
"""

import argparse
import json
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fdp
from fdp.observe._gpu import gpu_mesh
from fdp.observe._hlo import collective_stats, loop_collectives
from fdp.observe._schedule import _computations, _trip_count, read_schedule

MiB = 1024 * 1024


class MLP(nn.Module):
    width: int = 4096
    depth: int = 8

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(1000)(x)


class CNN(nn.Module):
    """A VGG-style network: eight 3x3 convolutions (256-2048 channels), two 4096 layers."""

    @nn.compact
    def __call__(self, x):
        for features in (256, 512, 1024, 2048):
            x = nn.relu(nn.Conv(features, (3, 3))(x))
            x = nn.relu(nn.Conv(features, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.mean(axis=(1, 2))
        x = nn.relu(nn.Dense(4096)(nn.relu(nn.Dense(4096)(x))))
        return nn.Dense(1000)(x)


class Block(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(h)))


class GPT(nn.Module):
    vocab: int = 32000
    dim: int = 768
    depth: int = 12
    heads: int = 12

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        for _ in range(self.depth):
            x = Block(self.dim, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def models(scale):
    """name -> (model, example input shape, input dtype, per-device rows, classes)."""
    return {
        "mlp": (MLP(), (4096,), jnp.float32, 256 // scale, 1000),
        "cnn": (CNN(), (64, 64, 3), jnp.float32, 32 // scale, 1000),
        "gpt": (GPT(), (1024,), jnp.int32, 8 // scale, 32000),
    }


def loss_for(model, tokens):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        labels = batch["y"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    del tokens
    return loss_fn


def abstract_state(model, shape, dtype, mesh):
    def make():
        params = model.init(jax.random.key(0), jnp.zeros((1, *shape), dtype))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-4))

    return fdp.replicate(jax.eval_shape(make), mesh)


def abstract_batch(shape, dtype, rows, classes, mesh, tokens):
    data = NamedSharding(mesh, P("data"))
    label_shape = (rows, *shape) if tokens else (rows,)
    return {
        "x": jax.ShapeDtypeStruct((rows, *shape), dtype, sharding=data),
        "y": jax.ShapeDtypeStruct(label_shape, jnp.int32, sharding=data),
    }


def plain_jit(loss_fn, state, batch, mesh, accumulate=1):
    """Data parallelism as plain JAX writes it: jit, replicated state, sharded batch.

    With ``accumulate`` > 1 the gradients of that many micro-batches are summed in a
    ``lax.scan`` (each device's micro-batch is a slice of its own rows); XLA's
    partitioner then reduces inside every iteration.
    """
    whole = NamedSharding(mesh, P())

    def grads_of(params, batch):
        if accumulate == 1:
            return jax.value_and_grad(loss_fn)(params, batch)
        n = mesh.shape["data"]

        def micro(x):  # [n*b, ...] -> [K, n*b/K, ...], device d's rows stay on d
            x = x.reshape(n, accumulate, x.shape[0] // (n * accumulate), *x.shape[1:])
            x = jnp.swapaxes(x, 0, 1).reshape(accumulate, -1, *x.shape[3:])
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "data")))

        def body(carry, mb):
            loss, grads = jax.value_and_grad(loss_fn)(params, mb)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(body, zero, jax.tree.map(micro, batch))
        return loss / accumulate, jax.tree.map(lambda g: g / accumulate, grads)

    def step(state, batch):
        loss, grads = grads_of(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    out = (jax.tree.map(lambda _: whole, state), whole)
    return jax.jit(step, out_shardings=out, donate_argnums=0).lower(state, batch).compile()


def reduced_available():
    """Whether this JAX has the ``reduced``/``unreduced`` sharding types and their API."""
    try:
        P(reduced={"data"}), P(unreduced={"data"})
    except TypeError:
        return False
    return all(hasattr(jax, name) for name in ("reshard", "shard_map", "set_mesh"))


def reduced_grads(loss_fn, mesh, accumulate):
    """Plain JAX's one all-reduce per step: (params, batch) -> (mean loss, mean grads).

    ``mesh`` has an Explicit ``'data'`` axis and is the current mesh (``jax.set_mesh``)
    when the function is traced. The replicated parameters are cast to ``reduced``
    over ``'data'``, so the gradient of each micro-batch comes out ``unreduced`` (each
    device's partial sum, no collective); the ``lax.scan`` adds those, and the one
    reduction is the cast back to replicated after the loop. The loss of a micro-batch
    runs per device in ``shard_map`` (reduced parameters in, unreduced gradients out):
    there JAX casts a reduced parameter to varying where it meets the device's rows
    (a Flax bias or scale added to the activations), which in the global view it
    refuses without a reshard written into the model.
    """
    n = mesh.shape["data"]
    reduced, unreduced = P(reduced={"data"}), P(unreduced={"data"})

    def local(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return loss[None], grads

    per_device = jax.shard_map(
        local, in_specs=(reduced, P("data")), out_specs=(P("data"), unreduced)
    )

    def micro(x):  # [n*b, ...] -> [K, n*b/K, ...], device d's rows stay on d
        x = x.reshape(
            n, accumulate, x.shape[0] // (n * accumulate), *x.shape[1:], out_sharding=P("data")
        )
        x = jnp.swapaxes(x, 0, 1)
        return x.reshape(accumulate, -1, *x.shape[3:], out_sharding=P(None, "data"))

    def grads_of(params, batch):
        params = jax.reshard(params, reduced)

        def body(carry, mb):
            return jax.tree.map(jnp.add, carry, per_device(params, mb)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype, out_sharding=unreduced), params)
        zero = (jnp.zeros((n,), out_sharding=P("data")), zeros)
        (loss, grads), _ = jax.lax.scan(body, zero, jax.tree.map(micro, batch))
        grads = jax.reshard(grads, P())  # unreduced -> replicated: the all-reduce
        return loss.mean() / accumulate, jax.tree.map(lambda g: g / (n * accumulate), grads)

    return grads_of


def reduced_pattern(loss_fn, state, batch, mesh, accumulate):
    """The step of :func:`reduced_grads` compiled for ``mesh``'s devices (None without it)."""
    if not reduced_available():
        return None
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * mesh.devices.ndim)
    state, batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)
        ),
        (state, batch),
    )
    grads_of = reduced_grads(loss_fn, mesh, accumulate)

    def step(state, batch):
        loss, grads = grads_of(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    with jax.set_mesh(mesh):
        return jax.jit(step, donate_argnums=0).lower(state, batch).compile()


_KERNEL = re.compile(
    r"= \S+ (fusion|custom-call|copy|dot|convolution|all-reduce-start|"
    r"all-gather-start|reduce-scatter|all-reduce|all-gather)\("
)


def launches(compiled):
    """Kernels one step launches: fusions, library calls, copies and collectives, each
    loop's body counted once per trip (a host-bound step's cost grows with them)."""
    comps, entry = _computations(compiled.as_text())

    def count(name):
        n = 0
        for line in comps.get(name, []):
            n += bool(_KERNEL.search(line))
            body = re.search(r" while\(.*body=%([\w.-]+)", line)
            if body:
                n += _trip_count(line) * count(body[1])
        return n

    return count(entry)


def describe(compiled, target, plan=None):
    stats = collective_stats(compiled)
    schedule = read_schedule(compiled, target)
    memory = compiled.memory_analysis()
    peak = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    row = {
        "collectives": stats.summary(),
        "collectives_in_loops": len(loop_collectives(compiled).ops),
        "comm_ms": schedule.comm_seconds * 1e3,
        "exposed_ms": schedule.exposed_seconds * 1e3,
        "compute_ms": schedule.compute_seconds * 1e3,
        "hidden": schedule.hidden_fraction,
        "temp_mib": memory.temp_size_in_bytes / MiB,
        "peak_mib": peak / MiB,
        "launches": launches(compiled),
    }
    if plan is not None:
        row["plan_buckets"] = len(plan.buckets)
        row["bucket_collectives"] = [list(c.buckets) for c in schedule.collectives if c.buckets]
    return row


def run(args):
    rows = []
    for target in args.targets.split(","):
        mesh = gpu_mesh(target, args.devices)
        for name in args.models.split(","):
            model, shape, dtype, per_device, classes = models(args.scale)[name]
            tokens = name == "gpt"
            state = abstract_state(model, shape, dtype, mesh)
            batch = abstract_batch(shape, dtype, per_device * args.devices, classes, mesh, tokens)
            loss_fn = loss_for(model, tokens)
            params = sum(x.size for x in jax.tree.leaves(state.params))
            for accumulate in args.accumulate:
                t0 = time.perf_counter()
                base = describe(plain_jit(loss_fn, state, batch, mesh, accumulate), target)
                t1 = time.perf_counter()
                step = fdp.train_step(
                    loss_fn, mesh=mesh, accumulation=fdp.Accumulation(steps=accumulate)
                )
                compiled = step.lower(state, batch).compile()
                ours = describe(compiled, target, step.plan)
                t2 = time.perf_counter()
                row = {
                    "target": target,
                    "model": name,
                    "parameters": params,
                    "accumulate_steps": accumulate,
                    "fdp": ours,
                    "jit": base,
                    "compile_s": {"jit": t1 - t0, "fdp": t2 - t1},
                }
                if accumulate > 1 and args.devices > 1:  # on one device nothing is reduced
                    reduced = reduced_pattern(loss_fn, state, batch, mesh, accumulate)
                    row["reduced"] = None if reduced is None else describe(reduced, target)
                    if reduced is not None:
                        row["compile_s"]["reduced"] = time.perf_counter() - t2
                rows.append(row)
                print_row(row)
    return rows


def print_row(r):
    f, j = r["fdp"], r["jit"]
    count = sum(v["count"] for v in f["collectives"].values())
    jcount = sum(v["count"] for v in j["collectives"].values())
    print(
        f"{r['target']:11} {r['model']:4} {r['parameters'] / 1e6:7.1f}M "
        f"acc={r['accumulate_steps']} "
        f"| buckets {f['plan_buckets']:3} collectives fdp {count:3} jit {jcount:3} "
        f"| exposed ms fdp {f['exposed_ms']:7.3f} jit {j['exposed_ms']:7.3f} "
        f"(comm {f['comm_ms']:.3f}/{j['comm_ms']:.3f}, compute {f['compute_ms']:.3f}) "
        f"| loops with collectives jit {j['collectives_in_loops']} fdp {f['collectives_in_loops']} "
        f"| temp MiB fdp {f['temp_mib']:8.1f} jit {j['temp_mib']:8.1f} "
        f"({f['temp_mib'] / max(j['temp_mib'], 1e-9):.3f}x) "
        f"| peak MiB {f['peak_mib']:8.1f} / {j['peak_mib']:8.1f} "
        f"| kernels fdp {f['launches']} jit {j['launches']}",
        flush=True,
    )
    if "reduced" not in r:
        return
    u = r["reduced"]
    if u is None:
        print(f"{'':31} reduced/unreduced: n/a (jax {jax.__version__})", flush=True)
        return
    ucount = sum(v["count"] for v in u["collectives"].values())
    print(
        f"{'':31} reduced/unreduced: collectives {ucount:3} "
        f"| exposed ms {u['exposed_ms']:7.3f} "
        f"(comm {u['comm_ms']:.3f}, compute {u['compute_ms']:.3f}) "
        f"| loops with collectives {u['collectives_in_loops']} "
        f"| temp MiB {u['temp_mib']:8.1f} (fdp {f['temp_mib'] / max(u['temp_mib'], 1e-9):.3f}x) "
        f"| peak MiB {u['peak_mib']:8.1f}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="h100_sxm,a100_sxm_80")
    parser.add_argument("--models", default="mlp,cnn,gpt")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--scale", type=int, default=1, help="divide per-device batches by this")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
