"""Reductions on a 2-host x 4-device mesh: bytes by link, step time, held-out accuracy.

Used by ``benchmarks/comm_hooks.py --reductions``. Every reduction trains the
digits demo's MLP and a small CNN on scikit-learn's digits (offline) for the same
number of steps from the same start, on 8 simulated CPU devices seen as 2 hosts of
4 (``fdp.data_mesh(axis_name=fdp.HOST_AXES, hosts=2)``).

Bytes are read from the lowered program (StableHLO): each collective's per-device
bytes sent with ring algorithms (``Collective.sent_bytes``), charged to the
**outer** link (between hosts) when its replica group spans hosts, else to the
**inner** one. A flat all-reduce over all 8 devices is charged to the outer link
in full: its ring crosses hosts, so the slow link paces every one of its steps.
DiLoCo's parameter all-reduce runs once every H steps and is divided by H.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import fdp
from fdp.observe._hlo import collective_stats

sys.path.insert(0, os.path.dirname(__file__))
from _progress import progress


class DigitsMLP(nn.Module):
    """The demo's model (examples/train_digits.py)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


class DigitsCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], 8, 8, 1)
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1))))


MODELS = {"digits_mlp": DigitsMLP, "digits_cnn": DigitsCNN}


def reductions() -> dict[str, dict[str, Any]]:
    """Step keyword arguments of each reduction measured."""
    h = fdp.hooks
    return {
        "flat all-reduce": {"mesh": "flat"},
        "hierarchical": {"hierarchical": True},
        "hierarchical + bf16 outer": {"hierarchical": True, "comm_hook": "bf16_compress"},
        "hierarchical + int8 outer": {
            "hierarchical": True,
            "comm_hook": h.compressed_allreduce("int8", error_feedback=False),
        },
        "compressed int8": {"comm_hook": h.compressed_allreduce("int8")},
        "compressed int8 + EF": {"comm_hook": h.compressed_allreduce("int8", error_feedback=True)},
        "compressed bf16": {"comm_hook": h.compressed_allreduce("bfloat16")},
        "torch quantize_per_tensor": {"comm_hook": h.quantize_per_tensor()},
        "torch bf16_compress": {"comm_hook": h.bf16_compress()},
        "DiLoCo H=8": {"model_averager": h.diloco(8)},
        "DiLoCo H=32": {"model_averager": h.diloco(32)},
        "streaming DiLoCo H=32 P=2": {
            "model_averager": h.diloco(32, fragments=2),
            "bucket_cap_mb": 0.02,
            "first_bucket_cap_mb": 0.02,
        },
    }


def _hosts_of_group(group: list[int], per_host: int) -> set[int]:
    return {i // per_host for i in group}


def bytes_by_link(ops: list[Any], per_host: int, every: int = 1) -> dict[str, float]:
    """Per-device bytes sent per step on the inner and outer links (see module doc)."""
    out = {"inner": 0.0, "outer": 0.0}
    for op in ops:
        groups = op.groups
        spans = any(len(_hosts_of_group(list(g), per_host)) > 1 for g in groups)
        per_step = op.sent_bytes / (every if op.shapes != ((),) else 1)
        out["outer" if spans or not groups else "inner"] += per_step
    return out


def _digits(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return {"x": x_tr, "y": y_tr}, {"x": x_te, "y": y_te}


def measure(model_name: str, steps: int, batch: int, rounds: int) -> list[dict[str, Any]]:
    """Trains every reduction ``steps`` steps; bytes, step time, held-out accuracy."""
    train, test = _digits()
    model = MODELS[model_name]()
    params = model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]
    host_mesh = fdp.data_mesh(axis_name=fdp.HOST_AXES, hosts=2)
    flat_mesh = fdp.data_mesh()
    per_host = int(host_mesh.shape["device"])

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    @jax.jit
    def accuracy(p, x, y):
        return jnp.mean(jnp.argmax(model.apply({"params": p}, x), -1) == y)

    rng = np.random.default_rng(0)
    order = [rng.permutation(len(train["y"]))[:batch] for _ in range(steps)]
    rows = []
    runs = {}
    for name, kwargs in progress(reductions().items(), f"{model_name}: reductions"):
        kwargs = dict(kwargs)
        flat = kwargs.pop("mesh", None) == "flat"
        mesh, axes = (flat_mesh, "data") if flat else (host_mesh, fdp.HOST_AXES)
        step = fdp.train_step(loss_fn, mesh=mesh, axis_name=axes, **kwargs)
        state = fdp.replicate(
            fdp.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3)), mesh
        )
        batches = [
            fdp.shard_batch({k: v[idx] for k, v in train.items()}, mesh, axis_name=axes)
            for idx in order
        ]
        averager = kwargs.get("model_averager")
        # DiLoCo: every fragment's all-reduce (each inside a cond) runs once per H steps.
        every = averager.inner_steps if averager is not None else 1
        ops = collective_stats(step.lower(state, batches[0])).ops
        sent = bytes_by_link(ops, per_host, every)
        for b in batches:
            # Wait each step: hundreds of queued steps on 8 simulated devices can starve
            # XLA:CPU's collective rendezvous (it aborts after 40 s).
            state, _ = jax.block_until_ready(step(state, b))
        final = state.params
        if averager is not None:  # replicas diverge between syncs: evaluate device 0's
            final = jax.tree.map(lambda x: x[0], final)
        acc = float(accuracy(jax.device_get(final), test["x"], test["y"]))
        runs[name] = (step, state, batches[0])
        rows.append(
            {
                "model": model_name,
                "reduction": name,
                "inner_bytes": sent["inner"],
                "outer_bytes": sent["outer"],
                "accuracy": acc,
                "steps": steps,
            }
        )
    # Step time, interleaved: one round times every reduction once, in turn.
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (step, state, b) in runs.items():
            t0 = time.perf_counter()
            for _ in range(5):
                state, _ = step(state, b)
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - t0) / 5)
            runs[name] = (step, state, b)
    base = statistics.median(times["flat all-reduce"])
    flat_bytes = rows[0]["outer_bytes"]
    for row in rows:
        row["median_step_s"] = statistics.median(times[row["reduction"]])
        row["step_vs_flat"] = row["median_step_s"] / base
        row["outer_vs_flat"] = row["outer_bytes"] / flat_bytes
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'model':<12}{'reduction':<28}{'inner KiB':>10}{'outer KiB':>10}{'outer/flat':>11}"
        f"{'step/flat':>10}{'held-out acc':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:<12}{r['reduction']:<28}{r['inner_bytes'] / 1024:>10.1f}"
            f"{r['outer_bytes'] / 1024:>10.1f}{r['outer_vs_flat']:>11.3f}"
            f"{r['step_vs_flat']:>10.2f}{r['accuracy']:>13.3f}"
        )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Held-out accuracy against bytes sent between hosts per step (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["reduction"] for r in rows))
    markers = "osD^v<>pXh*P"
    fig, axes = plt.subplots(1, len(MODELS), figsize=(6 * len(MODELS) + 2.5, 4.5))
    for ax, model in zip(np.atleast_1d(axes), MODELS, strict=True):
        for r in [r for r in rows if r["model"] == model]:
            i = names.index(r["reduction"])
            ax.scatter(
                r["outer_bytes"] / 1024,
                r["accuracy"],
                marker=markers[i % len(markers)],
                s=60,
                color=plt.cm.tab20(i),
                label=r["reduction"],
            )
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("KiB sent between hosts per device per step (log)")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"{model}: {rows[0]['steps']} steps, 2 hosts x 4 devices")
        ax.grid(alpha=0.3)
    handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(path, dpi=110)
