"""The compiled programs of 18 fdp step configurations: collectives and memory.

For each configuration (hooks, layouts, accumulation, buffers, per-example losses,
unused parameters, NNX...) on 8 simulated devices: the collectives of the lowered and
the compiled program and the compiled temp/argument/output/alias bytes. Run it on two
trees and compare the JSON to show a change leaves the compiled programs as they were:

    PYTHONPATH=/path/to/old/tree python benchmarks/compiled_programs.py --json old.json
    python benchmarks/compiled_programs.py --json new.json --compare old.json
"""

import json

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import fdp  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for f in (256, 128):
            x = nn.relu(nn.Dense(f)(x))
        return nn.Dense(10)(x)


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class Unused(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32)(x.reshape(x.shape[0], -1))
        _ = nn.Dense(7, name="head")
        return nn.Dense(10)(h)


def data(n=32):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
        "y": rng.integers(0, 10, size=(n,)).astype(np.int32),
    }


def linen_case(name, model, tx, step_kwargs, bn=False, rng=False, per_example=False):
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
    state = fdp.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables.get("batch_stats"),
    )

    def loss_fn(params, batch, *rest):
        if bn:
            stats = rest[0]
            logits, upd = model.apply(
                {"params": params, "batch_stats": stats}, batch["x"], mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return (loss if per_example else loss.mean()), upd["batch_stats"]
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return loss if per_example else loss.mean()

    step = fdp.train_step(loss_fn, per_example=per_example, **step_kwargs)
    batch = fdp.shard_batch(data())
    key = jax.random.key(1) if rng else None
    lowered = step.lower(fdp.replicate(state), batch, key)
    return summarize(name, lowered)


def nnx_case(name, step_kwargs):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(64, 64, rngs=rngs)
            self.bn = nnx.BatchNorm(64, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.l2 = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.bn(self.l1(x.reshape(x.shape[0], -1))))))

    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss_fn(m, batch):
        logits = m(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = fdp.nnx_train_step(loss_fn, **step_kwargs)
    lowered = step.lower(model, opt, fdp.shard_batch(data()))
    return summarize(name, lowered)


def summarize(name, lowered):
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    return {
        "case": name,
        "lowered": fdp.collective_stats(lowered).summary(),
        "compiled": fdp.collective_stats(compiled).summary(),
        "in_loop": fdp.loop_collectives(compiled).summary(),
        "temp": int(mem.temp_size_in_bytes),
        "args": int(mem.argument_size_in_bytes),
        "out": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
    }


def main():
    sgd = optax.sgd(0.1, momentum=0.9)
    adam = optax.adam(1e-3)
    cases = [
        linen_case("mlp-sgd", MLP(), sgd, {}),
        linen_case(
            "mlp-adam-tiny", MLP(), adam, {"bucket_cap_mb": 1e-3, "first_bucket_cap_mb": 1e-3}
        ),
        linen_case("mlp-flat", MLP(), adam, {"layout": "flat", "bucket_cap_mb": 0.05}),
        linen_case("mlp-acc4", MLP(), adam, {"accumulate_steps": 4}),
        linen_case("mlp-bf16", MLP(), adam, {"comm_hook": "bf16_compress"}),
        linen_case("mlp-quant", MLP(), adam, {"comm_hook": "quantize_per_tensor"}),
        linen_case(
            "mlp-powersgd", MLP(), adam, {"comm_hook": fdp.hooks.powersgd(start_powersgd_iter=2)}
        ),
        linen_case("mlp-noop", MLP(), sgd, {"comm_hook": "noop"}),
        linen_case(
            "mlp-localsgd",
            MLP(),
            sgd,
            {
                "comm_hook": fdp.hooks.post_local_sgd(2, subgroup_size=4),
                "model_averager": fdp.hooks.PeriodicModelAverager(period=2, warmup_steps=2),
            },
        ),
        linen_case("bn-broadcast", BNNet(), adam, {}, bn=True),
        linen_case("bn-mean", BNNet(), adam, {"buffers": "mean"}, bn=True),
        linen_case("bn-local", BNNet(), adam, {"buffers": "local"}, bn=True),
        linen_case("bn-per-example", BNNet(), adam, {}, bn=True, per_example=True),
        linen_case("unused", Unused(), adam, {"find_unused_parameters": True}),
        linen_case("mlp-rng", MLP(), sgd, {}, rng=True),
        nnx_case("nnx", {}),
        nnx_case("nnx-acc2", {"accumulate_steps": 2}),
        nnx_case("nnx-flat", {"layout": "flat"}),
    ]
    return cases


FIELDS = ("lowered", "compiled", "in_loop", "temp", "args", "out", "alias")


if __name__ == "__main__":
    import argparse
    import warnings

    warnings.simplefilter("ignore")  # the unused-parameter case warns, by design
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--compare", help="a JSON written by an earlier run, to diff against")
    args = parser.parse_args()
    cases = main()
    old = {}
    if args.compare:
        with open(args.compare) as f:
            old = {c["case"]: c for c in json.load(f)}
    print(f"{'case':16s} {'collectives (compiled)':48s} {'temp B':>9s}  vs old")
    for c in cases:
        summary = ", ".join(f"{k} x{v['count']} {v['bytes']}B" for k, v in c["compiled"].items())
        same = ""
        if c["case"] in old:
            diff = [f for f in FIELDS if old[c["case"]][f] != c[f]]
            same = "identical" if not diff else "DIFFERS: " + ", ".join(diff)
        print(f"{c['case']:16s} {summary:48s} {c['temp']:9d}  {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cases, f, indent=1)
