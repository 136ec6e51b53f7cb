"""fdp.describe and fdp describe: the bucket table agrees with the plan and with the leaves."""

import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import cross_entropy, make_data, make_state

import fdp
from fdp import cli
from fdp.observe._demo_models import parameter_shapes


def leaf_bytes(tree):
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def table_rows(text):
    """The bucket rows of a describe table: (index, dtype, leaves, bytes, first, last)."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"(\d+)\s+(\S+)\s+(\d+)\s+([\d,]+)\s+(\S+)\s+(\S+)$", line)
        if m:
            rows.append((int(m[1]), m[2], int(m[3]), int(m[4].replace(",", "")), m[5], m[6]))
    return rows


def expected_rows(plan):
    return [
        (b.index, str(b.dtype), len(b.leaf_indices), b.nbytes, b.key_paths[0], b.key_paths[-1])
        for b in plan.buckets
    ]


@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer"])
def test_table_matches_the_plan_and_totals_equal_the_leaves(model):
    params = parameter_shapes(model)
    plan = fdp.plan_buckets(params, bucket_cap_mb=0.5, first_bucket_cap_mb=0.1)
    assert len(plan.buckets) > 1  # several buckets, so the rows mean something
    text = fdp.describe(params, bucket_cap_mb=0.5, first_bucket_cap_mb=0.1)
    assert fdp.describe(plan) == text
    assert table_rows(text) == expected_rows(plan)
    total = re.search(r"^total\s+(\d+)\s+([\d,]+)\s+(\d+) bucket\(s\)$", text, re.M)
    assert int(total[1]) == len(jax.tree.leaves(params))
    assert int(total[2].replace(",", "")) == leaf_bytes(params)
    assert int(total[3]) == len(plan.buckets)
    report = fdp.bucket_report(plan)
    assert report.nbytes == leaf_bytes(params) and report.excluded == ()


def test_mixed_dtypes_and_leaves_without_gradients():
    params = {
        "a": jnp.zeros((300,), jnp.bfloat16),
        "b": jnp.zeros((100,), jnp.float32),
        "count": jnp.zeros((7,), jnp.int32),
    }
    report = fdp.bucket_report(params)
    assert sorted(r.dtype for r in report.rows) == ["bfloat16", "float32"]
    assert report.nbytes == 600 + 400
    assert report.excluded == ("['count']",) and report.excluded_nbytes == 28
    assert report.nbytes + report.excluded_nbytes == leaf_bytes(params)
    assert "in no bucket: 1 leaf(s), 28 bytes (['count'])" in str(report)
    assert report.as_dict()["total_bytes"] == 1000


def test_a_step_is_described_by_its_own_plan():
    state = fdp.replicate(make_state("mlp", "sgd"))
    step = fdp.train_step(
        cross_entropy(state.apply_fn), bucket_cap_mb=0.002, first_bucket_cap_mb=0.0005
    )
    with pytest.raises(RuntimeError, match="has no bucket plan until it has been traced"):
        fdp.describe(step)
    step(state, fdp.shard_batch(make_data(0, 16)))
    text = fdp.describe(step)
    assert table_rows(text) == expected_rows(step.plan) and len(step.plan.buckets) == 3
    assert text.startswith("caps: first bucket 524 B, then 2,097 B\n")  # not 0.000499725 MiB


def test_cli_describe_prints_the_demo_models_buckets(capsys):
    assert cli.main(["describe", "--model", "mlp", "--bucket-cap-mb", "0.25"]) == 0
    out = capsys.readouterr().out
    params = parameter_shapes("mlp")
    plan = fdp.plan_buckets(params, bucket_cap_mb=0.25)
    assert out.startswith("model 'mlp' (float32), buckets in reduce order\n")
    assert table_rows(out) == expected_rows(plan)
    # The digits demo's MLP: 64*256 + 256 + 256*256 + 256 + 256*10 + 10 floats.
    assert f"{4 * 85002:,}" in out and leaf_bytes(params) == 4 * 85002

    assert cli.main(["describe", "--model", "transformer", "--dtype", "bfloat16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    shapes = parameter_shapes("transformer", jnp.bfloat16)
    assert data["total_bytes"] == leaf_bytes(shapes)
    assert {b["dtype"] for b in data["buckets"]} == {"bfloat16"}

    assert cli.main(["describe", "--bucket-cap-mb", "0"]) == 2
    assert "bucket_cap_mb must be a positive number of MiB, got 0.0" in capsys.readouterr().err


def init_params():  # what `fdp describe --model test_describe:init_params` calls
    return {"params": {"w": jnp.zeros((64, 64)), "b": jnp.zeros(64, jnp.bfloat16)}}


def test_cli_describe_takes_your_own_model_as_module_function(capsys, monkeypatch):
    monkeypatch.chdir(pathlib.Path(__file__).parent)  # found as python -m finds modules
    assert cli.main(["describe", "--model", "test_describe:init_params"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model 'test_describe:init_params' (bfloat16, float32), buckets in")
    assert table_rows(out) == [
        (0, "float32", 1, 64 * 64 * 4, "['w']", "['w']"),
        (1, "bfloat16", 1, 64 * 2, "['b']", "['b']"),
    ]
    for model, message in [
        ("nope", "model must be one of ['cnn', 'mlp', 'transformer'] or module:function"),
        ("no_such_module:f", "cannot import module 'no_such_module'"),
        ("test_describe:missing", "'test_describe' has no attribute 'missing'"),
        ("test_describe:json", "'json' is a module, not a function"),
    ]:
        assert cli.main(["describe", "--model", model]) == 2
        assert message in capsys.readouterr().err


def test_what_is_not_parameters_is_named():
    with pytest.raises(TypeError, match=r"pytree of parameters .*; got int 123\."):
        fdp.describe(123)
    with pytest.raises(TypeError, match=r"got a dict whose leaf \['a'\] is str 'x'\."):
        fdp.describe({"a": "x"})


def test_numbers_inside_a_tree_are_leaves_too():
    text = fdp.describe({"w": jnp.ones((3, 3)), "temperature": 1.0, "steps": 3})
    assert "['temperature']" in text and "in no bucket: 1 leaf(s), 8 bytes (['steps'])" in text
