"""Bytes each device sends per step inside hosts and across them, by ZeRO stage and mode.

On 8 simulated CPU devices as 2 hosts x 4 (``fdp.data_mesh(axis_name=fdp.HOST_AXES,
hosts=2)``), an MLP of 86,544 float32 parameters (Adam), each step compiled and its
collectives read from the compiled HLO (``fdp.collective_stats``: ring-algorithm
bytes sent per device). A collective "crosses hosts" when one of its replica groups
holds devices of both hosts; XLA's partitioner's mesh-spelled groups (the update's
parameter gathers at stages 1-2) are inside a host when they hold 4 devices.

    python benchmarks/hsdp_bytes.py
"""

from __future__ import annotations

from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import fdp  # noqa: E402
from fdp.step.options._policies import ShardOver  # noqa: E402

AXES = fdp.HOST_AXES
MODES: list[tuple[int, ShardOver]] = [
    (0, "all"),
    (1, "all"),
    (1, "inner"),
    (2, "all"),
    (2, "inner"),
    (3, "all"),
    (3, "inner"),
]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (256, 256):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(16)(x)


def loss_fn(params: Any, batch: Any) -> Any:
    logits: Any = MLP().apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def crosses_hosts(op: Any, per_host: int) -> bool:
    """Whether a replica group of ``op`` holds devices of two hosts."""
    return any(len({d // per_host for d in g}) > 1 for g in op.groups)


def main() -> None:
    mesh = fdp.data_mesh(axis_name=AXES, hosts=2)
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 64)))["params"]
    rng = np.random.default_rng(1)
    data = {"x": rng.normal(size=(64, 64)).astype(np.float32), "y": rng.integers(0, 16, 64)}
    batch = fdp.shard_batch(data, mesh, axis_name=AXES)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"{nbytes:,} B of parameters; bytes each device sends per step (compiled, CPU)")
    print("| stage | shard_over | across hosts | inside hosts |")
    print("|---|---|---|---|")
    for stage, over in MODES:
        sharding = fdp.Sharding(zero_stage=stage, shard_over=over) if stage else None
        step = fdp.train_step(loss_fn, mesh=mesh, axis_name=AXES, sharding=sharding)
        state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
        ops = fdp.collective_stats(step.lower(fdp.replicate(state, mesh), batch).compile()).ops
        across = sum(op.sent_bytes for op in ops if crosses_hosts(op, 4))
        inside = sum(op.sent_bytes for op in ops if not crosses_hosts(op, 4))
        print(f"| {stage} | {over} | {across:,.0f} | {inside:,.0f} |")


if __name__ == "__main__":
    main()
