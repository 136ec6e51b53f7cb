"""Data x tensor parallel training of a Megatron MLP on a (4 data x 2 model) mesh.

    tensor_parallel.py --out params.npz [--devices 8] [--zero-stage Z] [--hsdp]

Under `fdp launch --nproc-per-node 2` with 4 CPU devices each, every process holds 2
data rows x 2 model columns of the mesh and feeds its half of each global batch; alone
with 8 devices, one process feeds all of it. The parameters are placed with the model
split (first kernel by columns, second by rows) from values every process computes
alike; fdp keeps the split, and the run ends where the other one does.

With --hsdp the mesh is (2 host x 2 device x 2 model), each process one "host": ZeRO
shards over 'device' inside a process and replicates across them (HSDP), so the
replicas' all-reduce crosses processes (gloo) and the shards' collectives do not.
"""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--devices", type=int, default=4, help="CPU devices per process")
parser.add_argument("--zero-stage", type=int, default=0)
parser.add_argument("--hsdp", action="store_true", help="host x device x model, HSDP")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fdp  # noqa: E402

fdp.init(initialization_timeout=60)
rank, nproc = fdp.process_index(), fdp.process_count()
if args.hsdp:
    data: tuple[str, ...] = ("host", "device")
    mesh = jax.make_mesh((2, 2, 2), (*data, "model"), axis_types=(AxisType.Auto,) * 3)
    sharding = fdp.Sharding(zero_stage=args.zero_stage, shard_over="inner")
else:
    data = ("data",)
    mesh = jax.make_mesh((4, 2), (*data, "model"), axis_types=(AxisType.Auto,) * 2)
    sharding = fdp.Sharding(zero_stage=args.zero_stage)
rows = {d.process_index for d in mesh.devices[: mesh.devices.shape[0] // nproc].flat}
assert rows == {0}, f"process 0 holds the first data rows, got {rows}"


class Megatron(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(h)


model = Megatron()
specs = {
    "Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
    "Dense_1": {"kernel": P("model"), "bias": P()},
}
host = model.init(jax.random.key(0), np.zeros((1, 8), np.float32))["params"]


def place(x, spec):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


params = jax.tree.map(place, host, specs)
state = fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))


def loss_fn(params, batch):
    return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


axis_name = data if args.hsdp else "data"
step = fdp.train_step(loss_fn, mesh=mesh, axis_name=axis_name, sharding=sharding)
state = step.init(state)
rng = np.random.default_rng(0)
half = 32 // nproc
for _ in range(3):
    batch = {
        "x": rng.normal(size=(32, 8)).astype(np.float32),
        "y": rng.normal(size=(32, 4)).astype(np.float32),
    }
    local = {k: v[rank * half : (rank + 1) * half] for k, v in batch.items()}
    state, metrics = step(state, fdp.shard_batch(local, mesh, axis_name=axis_name))

kernel = state.params["Dense_0"]["kernel"]
print(
    f"rank {rank}: Dense_0 kernel {kernel.sharding.spec}, "
    f"{kernel.addressable_shards[0].data.shape} on each device",
    flush=True,
)
mu = state.opt_state[0].mu["Dense_0"]["kernel"]
print(
    f"rank {rank}: Dense_0 kernel's Adam mu {mu.sharding.spec}, "
    f"{mu.addressable_shards[0].data.shape} on each device",
    flush=True,
)
params = multihost_utils.process_allgather(state.params, tiled=True)
if rank == 0:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(args.out, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in flat})
print(f"done: loss {float(metrics['loss']):.6f}", flush=True)
