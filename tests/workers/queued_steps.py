"""Dispatches many steps on 2 CPU devices without the host waiting between them.

argv: how many steps, then "fdp" (fdp.train_step), "ddp" (fdp.ddp) or "jit" (plain jax.jit).
On jax 0.10.2 the plain jit loop aborts the process (XLA:CPU's rendezvous timeout).
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402

steps, kind = int(sys.argv[1]), sys.argv[2]


def apply_fn(params, x):
    return x @ params["w"]


def loss_fn(params, batch):
    return jnp.mean((apply_fn(params, batch["x"]) - batch["y"]) ** 2)


params = {"w": jnp.zeros((16, 4))}
batch = {"x": jnp.ones((64, 16)), "y": jnp.ones((64, 4))}
mesh = fdp.data_mesh()
if kind == "fdp":
    state = fdp.replicate(TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.01)))
    step = fdp.train_step(loss_fn)
    placed = fdp.shard_batch(batch)
    for _ in range(steps):
        state, metrics = step(state, placed)
    loss = metrics["loss"]
elif kind == "ddp":

    @fdp.ddp(batch_argnums=(1,))
    def ddp_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = fdp.reduce_gradients(grads)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

    for _ in range(steps):
        params, loss = ddp_step(params, batch)
else:
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    placed = jax.device_put(batch, rows)
    params = fdp.replicate(params)

    @jax.jit
    def jit_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

    for _ in range(steps):
        params, loss = jit_step(params, placed)
print(f"{kind}: {steps} steps, loss {float(loss):.6f}")
