"""The public API stays backward compatible with the one recorded in data_files/api_v0.json.

The snapshot holds every name in the ``__all__`` of fdp and its public subpackages, with
each function's and class's parameters (name, kind, default) and each class's public
methods, as they were before the step core was redesigned. Names and keyword-only
parameters with defaults may be added; nothing recorded may disappear or change.

Moved deliberately once since (issue 30): ``train_step``, ``nnx_train_step`` and
``grad_accumulator`` take grouped policies (``fdp.Reduction``, ``fdp.Accumulation``,
``fdp.Loss``, ``fdp.Sharding``, recorded here too) instead of flat keywords; the flat
keywords still work for one release through ``**deprecated`` (tests/step/test_policies.py).
``fdp.StatsSchedule`` (a NamedTuple, whose fields are positional) gained a third field
with a default, ``tokens_per_example`` (issue 33): two-argument calls are unchanged.

An enum (``fdp.DebugLevel``, ``fdp.collectives.ReduceOp``) is called through Python's
own ``EnumType.__call__``, whose signature Python 3.12 rewrote (``(*values)``), so an
enum keeps its recorded members rather than that signature.
"""

import enum
import importlib
import inspect
import json
import pathlib

import pytest

SNAPSHOT = json.loads((pathlib.Path(__file__).parent / "data_files" / "api_v0.json").read_text())
CASES = [(module, name) for module, names in SNAPSHOT.items() for name in names]


def parameters(obj):
    return [
        [p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
        for p in inspect.signature(obj).parameters.values()
    ]


def assert_compatible(old, new, where):
    """Every old parameter is still there, in order, with its kind and default."""
    names = [p[0] for p in new]
    missing = [p[0] for p in old if p[0] not in names]
    assert not missing, f"{where}: parameters removed: {missing}"
    assert [p for p in new if p[0] in {q[0] for q in old}] == old, f"{where}: parameters changed"
    for name, kind, default in new:
        if name not in {q[0] for q in old}:
            assert kind in ("KEYWORD_ONLY", "VAR_KEYWORD"), f"{where}: new parameter {name} {kind}"
            assert kind == "VAR_KEYWORD" or default is not None, f"{where}: {name} needs a default"


@pytest.mark.parametrize(("module", "name"), CASES, ids=[f"{m}.{n}" for m, n in CASES])
def test_each_recorded_name_keeps_its_signature(module, name):
    mod = importlib.import_module(module)
    assert name in mod.__all__, f"{module}.{name} left __all__"
    old, obj = SNAPSHOT[module][name], getattr(mod, name)
    if old["kind"] == "function":
        assert_compatible(old["params"], parameters(obj), f"{module}.{name}")
    elif old["kind"] == "class":
        assert inspect.isclass(obj), f"{module}.{name} is no longer a class"
        if issubclass(obj, enum.Enum):
            kept = [m.name for m in obj]
            assert [m for m in old["members"] if m not in kept] == [], f"{name}: members removed"
        elif old["init"] is not None:
            assert_compatible(old["init"], parameters(obj), f"{module}.{name}()")
        for method, params in old["methods"].items():
            assert callable(getattr(obj, method, None)), f"{module}.{name}.{method} removed"
            if params is not None:
                assert_compatible(params, parameters(getattr(obj, method)), f"{name}.{method}")


def test_steps_still_expose_plan_usage_and_config():
    """Attributes documented on the step objects (README, docs) rather than in signatures."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import fdp

    def loss(params, batch):
        return jnp.mean(batch["x"] @ params["w"])

    state = fdp.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
    step = fdp.train_step(loss, reduction=fdp.Reduction(bucket_cap_mb=1.0))
    step(fdp.replicate(state), fdp.shard_batch({"x": jnp.ones((8, 2))}))
    assert [b.nbytes for b in step.plan.buckets] == [8]
    assert step.usage.unused == () and step.config.bucket_cap_mb == 1.0

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    nnx_step = fdp.nnx_train_step(lambda m, b: jnp.mean(m(b["x"])))
    nnx_step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), {"x": jnp.ones((8, 2))})
    assert len(nnx_step.plan.buckets) == 1 and nnx_step.config.comm_hook.name == "allreduce"


def test_both_steps_take_the_same_arguments():
    """One list of arguments for both front ends: loss, where, four policies, the rest."""
    import inspect

    import fdp

    linen = list(inspect.signature(fdp.train_step).parameters)
    assert linen == list(inspect.signature(fdp.nnx_train_step).parameters)
    assert len(linen) <= 12 and linen[-1] == "deprecated"
    assert {"reduction", "accumulation", "loss", "sharding"} <= set(linen)
