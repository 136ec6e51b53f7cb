"""fdp's step with tensor parallelism against plain jit (GSPMD), compiled for 8 x H100 (no GPU).

A GPT-style decoder with Megatron tensor parallelism over the mesh axis ``'model'``:
each attention layer's query/key/value kernel split by heads (columns) and its output
kernel by heads (rows), each MLP's first kernel by columns and its second by rows, the
vocabulary projection by columns (vocab-parallel logits); the token and position
embeddings and the layer norms are whole. On 4 x 2 and 2 x 4 meshes (data x model),
at ZeRO stages 0 and 3, two programs are compiled deviceless for 8 x H100 SXM
(:func:`fdp.observe._gpu.gpu_mesh`) from shapes alone:

- ``fdp``: ``fdp.train_step`` (manual over 'data' in ``shard_map``, 'model' left to
  XLA), its state placed with the model split (stage 3: fdp adds the data-axis split
  on a dimension the model split leaves);
- ``jit``: plain ``jax.jit`` of the same loss and Adam update, the batch split over
  'data', every leaf of the state with the same sharding as fdp's (stage 0: split over
  'model' only, replicated over 'data'; stage 3: GSPMD's FSDP x TP with fdp's layout,
  set through in/out shardings).

Read from each compiled, scheduled module: the collectives by kind and by mesh axis
(from their replica groups: 'data' is fdp's buckets, gathers and scatters; 'model'
is the tensor-parallel collectives XLA's partitioner inserts), their ring bytes per
device, fdp.observe._schedule's overlap estimate (exposed communication), and temp
and peak memory per device (peak = arguments + outputs - aliased + temp).

    python benchmarks/gpu_tensor_parallel.py --json benchmarks/results/gpu_tensor_parallel.json

``gpu_tensor_parallel_before_fix.json`` is the same script (stage 3 only) on fdp as of
commit 7c2b916, before its data-axis collectives kept the model split
(fdp.hooks._contract.where_it_lies). The script imports the installed ``fdp``: from a
checkout that is not the installed one, run it with ``PYTHONPATH=.``.
"""

import argparse
import collections
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fdp
from fdp.observe._gpu import gpu_mesh
from fdp.observe._hlo import collective_stats
from fdp.observe._schedule import read_schedule
from fdp.step.core._state import linen_layout

MiB = 1024 * 1024

# Megatron's layout, by parameter name: heads and the MLP's hidden units over 'model'.
MODEL_SPECS = {
    "qkv": P(None, None, "model", None),  # [3, dim, heads, head_dim]: by heads (columns)
    "out": P("model", None, None),  # [heads, head_dim, dim]: by heads (rows)
    "w1": P(None, "model"),  # [dim, 4 dim]: by columns
    "b1": P("model"),
    "w2": P("model", None),  # [4 dim, dim]: by rows
    "head": P(None, "model"),  # [dim, vocab]: vocab-parallel logits
}


def pin(x, rules, *names):
    """``x`` constrained to the logical ``names`` (Megatron's activation layout), if ``rules``.

    ``rules`` maps ``"batch"`` to the data axis under plain jit and to None under fdp,
    whose loss sees each device's rows (a spec naming the data axis is refused there).
    """
    if rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(*(dict(rules).get(n) for n in names)))


class Attention(nn.Module):
    dim: int
    heads: int
    rules: tuple | None = None

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(0.02)
        head_dim = self.dim // self.heads
        qkv = self.param("qkv", init, (3, self.dim, self.heads, head_dim))
        out = self.param("out", init, (self.heads, head_dim, self.dim))
        # One product for the three (Megatron's fused QKV): one all-reduce of the
        # input's gradient over 'model' per layer, not three.
        fused = jnp.einsum("bsd,tdhe->tbhse", x, qkv)
        q, k, v = (pin(fused[i], self.rules, "batch", "heads") for i in range(3))
        logits = jnp.einsum("bhqe,bhke->bhqk", q, k) / np.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        mixed = pin(jnp.einsum("bhqk,bhke->bhqe", weights, v), self.rules, "batch", "heads")
        return pin(jnp.einsum("bhqe,hed->bqd", mixed, out), self.rules, "batch")


class Mlp(nn.Module):
    dim: int
    rules: tuple | None = None

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(0.02)
        w1 = self.param("w1", init, (self.dim, 4 * self.dim))
        b1 = self.param("b1", nn.initializers.zeros_init(), (4 * self.dim,))
        w2 = self.param("w2", init, (4 * self.dim, self.dim))
        b2 = self.param("b2", nn.initializers.zeros_init(), (self.dim,))
        h = pin(nn.gelu(x @ w1 + b1), self.rules, "batch", None, "mlp")
        return pin(h @ w2 + b2, self.rules, "batch")


class Block(nn.Module):
    dim: int
    heads: int
    rules: tuple | None = None

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.dim, self.heads, self.rules)(nn.LayerNorm()(x))
        return x + Mlp(self.dim, self.rules)(nn.LayerNorm()(x))


class GPT(nn.Module):
    vocab: int
    dim: int
    depth: int
    heads: int
    rules: tuple | None = None  # activation constraints (``--constrain``), else none

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        for _ in range(self.depth):
            x = Block(self.dim, self.heads, self.rules)(x)
        head = self.param("head", nn.initializers.normal(0.02), (self.dim, self.vocab))
        return pin(nn.LayerNorm()(x) @ head, self.rules, "batch", None, "vocab")


def loss_for(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn


def model_spec(path, leaf):
    """A leaf's Megatron split over 'model' (the name of its parameter), else whole."""
    del leaf
    name = getattr(path[-1], "key", None)
    return MODEL_SPECS.get(name, P())


def tp_state(model, seq, mesh):
    """The abstract Adam state, every leaf placed with its split over 'model' alone.

    The optimizer's moments are found by their path ending in a parameter's path.
    """

    def make():
        params = model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))["params"]
        return fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-4))

    abstract = jax.eval_shape(make)

    def place(path, x):
        spec = model_spec(path, x) if len(x.shape) else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, abstract)


def token_batch(rows, seq, mesh):
    data = NamedSharding(mesh, P("data"))
    token = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=data)
    return {"x": token, "y": token}


def plain_jit(loss_fn, state, batch):
    """The same step as plain JAX writes it: jit with every state leaf's sharding given."""

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    shardings = jax.tree.map(lambda x: x.sharding, state)
    whole = NamedSharding(batch["x"].sharding.mesh, P())
    jitted = jax.jit(step, out_shardings=(shardings, whole), donate_argnums=0)
    with jax.set_mesh(whole.mesh):  # for the model's bare activation specs
        return jitted.lower(state, batch).compile()


def axis_of(groups, mesh):
    """Which mesh axes a collective's replica groups span: 'data', 'model', 'data+model'."""
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    names = mesh.axis_names
    if not groups or max(len(g) for g in groups) == ids.size:
        return "+".join(names)
    for i, name in enumerate(names):
        # The groups along axis i: device ids with every other coordinate fixed.
        along = {tuple(sorted(g)) for g in np.moveaxis(ids, i, -1).reshape(-1, ids.shape[i])}
        if {tuple(sorted(g)) for g in groups} == along:
            return name
    return "other"


def describe(compiled, mesh, target):
    stats = collective_stats(compiled)
    schedule = read_schedule(compiled, target)
    memory = compiled.memory_analysis()
    peak = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    by_axis = collections.defaultdict(lambda: {"count": 0, "bytes": 0, "sent_bytes": 0.0})
    for op in stats.ops:
        key = f"{op.kind} over {axis_of(op.groups, mesh)}"
        by_axis[key]["count"] += 1
        by_axis[key]["bytes"] += op.nbytes
        by_axis[key]["sent_bytes"] += op.sent_bytes
    # The schedule's collectives carry no replica groups: each is given the axis of the
    # collectives of its kind and size (ambiguous where those span several axes).
    axes_of = collections.defaultdict(set)
    for op in stats.ops:
        axes_of[op.kind, op.nbytes].add(axis_of(op.groups, mesh))
    exposed = collections.defaultdict(float)
    for c in schedule.collectives:
        axes = axes_of.get((c.kind, c.nbytes), set())
        exposed[next(iter(axes)) if len(axes) == 1 else "ambiguous"] += c.exposed_seconds * 1e3
    return {
        "collectives": dict(sorted(by_axis.items())),
        "exposed_ms_by_axis": dict(sorted(exposed.items())),
        "comm_ms": schedule.comm_seconds * 1e3,
        "exposed_ms": schedule.exposed_seconds * 1e3,
        "compute_ms": schedule.compute_seconds * 1e3,
        "hidden": schedule.hidden_fraction,
        "argument_mib": memory.argument_size_in_bytes / MiB,
        "temp_mib": memory.temp_size_in_bytes / MiB,
        "peak_mib": peak / MiB,
    }


def run(args):
    model = GPT(args.vocab, args.width, args.depth, args.heads)
    loss_fn = loss_for(model)
    if args.constrain:  # the same model, its activations pinned; 'batch' is fdp's
        tp = (("heads", "model"), ("mlp", "model"), ("vocab", "model"))
        loss_fn = loss_for(model.clone(rules=(("batch", None), *tp)))
        jit_loss_fn = loss_for(model.clone(rules=(("batch", "data"), *tp)))
    else:
        jit_loss_fn = loss_fn
    rows = []
    for shape in args.meshes:
        mesh = gpu_mesh(args.target, 8, shape=shape, axis_name=("data", "model"))
        placed = tp_state(model, args.seq, mesh)
        batch = token_batch(args.batch, args.seq, mesh)
        count = sum(x.size for x in jax.tree.leaves(placed.params))
        for stage in args.stages:
            # --kept: stage 3 gathers every bucket once, at the start (as GSPMD does here).
            sharding = fdp.Sharding(zero_stage=stage, reshard_after_forward=not args.kept)
            reduction = fdp.Reduction(bucket_cap_mb=args.bucket_cap_mb)
            step = fdp.train_step(loss_fn, mesh=mesh, sharding=sharding, reduction=reduction)
            state = linen_layout(step.config, placed)  # fdp's layout, as its step keeps it
            t0 = time.perf_counter()
            base = describe(plain_jit(jit_loss_fn, state, batch), mesh, args.target)
            t1 = time.perf_counter()
            ours = describe(step.lower(state, batch).compile(), mesh, args.target)
            t2 = time.perf_counter()
            row = {
                "target": args.target,
                "mesh": "x".join(map(str, shape)),
                "zero_stage": stage,
                "reshard_after_forward": not args.kept,
                "parameters": count,
                "layouts": {  # the first block's and the top-level leaves' (fdp's = jit's)
                    name: str(x.sharding.spec)
                    for path, x in jax.tree_util.tree_leaves_with_path(state.params)
                    if "Block_" not in (name := jax.tree_util.keystr(path)) or "Block_0" in name
                },
                "fdp": ours,
                "jit": base,
                "compile_s": {"jit": t1 - t0, "fdp": t2 - t1},
            }
            rows.append(row)
            print_row(row)
    return rows


def print_row(r):
    f, j = r["fdp"], r["jit"]
    print(
        f"{r['target']} mesh {r['mesh']} (data x model) stage {r['zero_stage']}"
        f"{'' if r['reshard_after_forward'] else ' kept gathered'} "
        f"{r['parameters'] / 1e6:.1f}M params "
        f"| peak MiB fdp {f['peak_mib']:.1f} jit {j['peak_mib']:.1f} "
        f"({f['peak_mib'] / j['peak_mib']:.3f}x) "
        f"| temp MiB fdp {f['temp_mib']:.1f} jit {j['temp_mib']:.1f} "
        f"| exposed ms fdp {f['exposed_ms']:.3f} jit {j['exposed_ms']:.3f} "
        f"(comm {f['comm_ms']:.3f} / {j['comm_ms']:.3f}, "
        f"compute {f['compute_ms']:.3f} / {j['compute_ms']:.3f}) "
        f"| compile s {r['compile_s']['fdp']:.0f} / {r['compile_s']['jit']:.0f}",
        flush=True,
    )
    by_axis = {
        k: (f["exposed_ms_by_axis"].get(k, 0), j["exposed_ms_by_axis"].get(k, 0))
        for k in sorted(set(f["exposed_ms_by_axis"]) | set(j["exposed_ms_by_axis"]))
    }
    print(
        "    exposed ms by axis, fdp / jit: "
        + ", ".join(f"{k} {a:.3f} / {b:.3f}" for k, (a, b) in by_axis.items()),
        flush=True,
    )
    kinds = sorted(set(f["collectives"]) | set(j["collectives"]))
    for kind in kinds:
        a = f["collectives"].get(kind, {"count": 0, "bytes": 0})
        b = j["collectives"].get(kind, {"count": 0, "bytes": 0})
        print(
            f"    {kind:34} fdp {a['count']:4} ops {a['bytes'] / MiB:9.1f} MiB "
            f"| jit {b['count']:4} ops {b['bytes'] / MiB:9.1f} MiB",
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100_sxm")
    parser.add_argument(
        "--meshes", nargs="+", default=["4x2", "2x4"], help="data x model shapes of 8 GPUs"
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    parser.add_argument(
        "--constrain",
        action="store_true",
        help="pin the activations to Megatron's layout (with_sharding_constraint)",
    )
    parser.add_argument(
        "--kept", action="store_true", help="stage 3 with reshard_after_forward=False"
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="fdp's bucket cap")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    args.meshes = [tuple(int(n) for n in m.split("x")) for m in args.meshes]
    rows = run(args)
    if args.json:
        keys = ("depth", "width", "heads", "vocab", "seq", "batch", "constrain", "kept")
        config = {k: getattr(args, k) for k in keys}
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "model": config, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
