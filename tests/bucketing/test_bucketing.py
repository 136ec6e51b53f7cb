"""Bucket assignment (DDP's exact rules) and the flat-buffer round trip."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fdp.bucketing import (
    MiB,
    assign_buckets,
    flatten_buckets,
    plan_buckets,
    unflatten_buckets,
)

# ddp-reference.md section 3: leaves in definition order.
REFERENCE_LEAVES = [
    ((1024, 1024), jnp.float32),
    ((1024,), jnp.float32),
    ((512, 512), jnp.float16),
    ((512,), jnp.float32),
    ((300000,), jnp.float32),
    ((10,), jnp.float32),
    ((2048, 256), jnp.float32),
    ((7,), jnp.bfloat16),
    ((1000, 1000), jnp.float32),
    ((1000,), jnp.float32),
]
REFERENCE_BUCKETS = {
    1.0: [[9, 8], [7], [6], [5, 4], [3, 1, 0], [2]],
    4.0: [[9, 8], [7], [6, 5, 4, 3, 1, 0], [2]],
    25.0: [[9, 8], [7], [6, 5, 4, 3, 1, 0], [2]],
}


def reference_tree():
    return [jax.ShapeDtypeStruct(s, d) for s, d in REFERENCE_LEAVES]


@pytest.mark.parametrize("cap_mb", sorted(REFERENCE_BUCKETS))
def test_reference_test_vector(cap_mb):
    plan = plan_buckets(reference_tree(), bucket_cap_mb=cap_mb, first_bucket_cap_mb=1.0)
    assert plan.as_lists() == REFERENCE_BUCKETS[cap_mb]
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))
    for bucket in plan.buckets:
        assert {np.dtype(REFERENCE_LEAVES[i][1]) for i in bucket.leaf_indices} == {bucket.dtype}


def test_bucket_metadata_describes_the_flat_layout():
    plan = plan_buckets(reference_tree(), bucket_cap_mb=4.0)
    big = plan.buckets[2]
    assert big.leaf_indices == (6, 5, 4, 3, 1, 0)
    assert big.shapes == ((2048, 256), (10,), (300000,), (512,), (1024,), (1024, 1024))
    assert big.sizes == (2048 * 256, 10, 300000, 512, 1024, 1024 * 1024)
    assert big.offsets == tuple(np.cumsum((0, *big.sizes[:-1])).tolist())
    assert big.nbytes == 4 * sum(big.sizes)
    assert big.key_paths == ("[6]", "[5]", "[4]", "[3]", "[1]", "[0]")
    assert plan.nbytes == sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in REFERENCE_LEAVES)


def test_first_cap_not_smaller_than_cap_uses_only_the_cap():
    sizes, dtypes = [MiB] * 4, ["f32"] * 4
    assert assign_buckets(sizes, dtypes, [2 * MiB], order=[3, 2, 1, 0]) == [[3, 2], [1, 0]]
    tree = [jnp.zeros(MiB // 4)] * 4  # 1 MiB each
    plan = plan_buckets(tree, bucket_cap_mb=2.0, first_bucket_cap_mb=8.0)
    assert plan.as_lists() == [[3, 2], [1, 0]]
    assert plan.first_bucket_cap_bytes == plan.bucket_cap_bytes == 2 * MiB


def test_bucket_closes_when_size_reaches_cap_exactly():
    tree = [jnp.zeros(256)] * 3  # 1 KiB each
    plan = plan_buckets(tree, bucket_cap_mb=2 / 1024, first_bucket_cap_mb=1 / 1024)
    assert plan.as_lists() == [[2], [1, 0]]


def test_plan_is_hashable_and_a_static_jit_argument():
    params = {"a": jnp.ones((3, 2)), "b": jnp.ones(4)}
    p1 = plan_buckets(params, bucket_cap_mb=1.0)
    p2 = plan_buckets(params, bucket_cap_mb=1.0)
    assert p1 == p2 and hash(p1) == hash(p2)

    @jax.jit
    def total(tree, plan=p1):
        return sum(b.sum() for b in flatten_buckets(plan, tree))

    f = jax.jit(
        lambda tree, plan: sum(b.sum() for b in flatten_buckets(plan, tree)), static_argnums=1
    )
    assert float(f(params, p1)) == 10.0 == float(total(params))


def test_round_trip_is_exact_with_mixed_dtypes_and_integer_leaves():
    rng = np.random.default_rng(0)
    tree = {
        "dense": {
            "kernel": rng.normal(size=(7, 5)).astype(np.float32),
            "bias": rng.normal(size=(5,)).astype(np.float32),
        },
        "half": rng.normal(size=(3, 3)).astype(jnp.bfloat16),
        "scalar": np.float32(rng.normal()),
        "step": np.arange(4, dtype=np.int32),
        "mask": np.array([True, False]),
    }
    plan = plan_buckets(tree, bucket_cap_mb=60 / MiB, first_bucket_cap_mb=20 / MiB)
    assert len(plan.buckets) > 2
    assert plan.excluded_key_paths == ("['mask']", "['step']")
    buffers = flatten_buckets(plan, tree)
    assert all(b.ndim == 1 for b in buffers)
    back = unflatten_buckets(plan, buffers, fill=tree)
    chex.assert_trees_all_equal(back, jax.tree.map(jnp.asarray, tree))
    no_fill = unflatten_buckets(plan, buffers)
    assert no_fill["step"].dtype == jax.dtypes.float0


def test_custom_order_and_exclude():
    tree = [jnp.zeros(4)] * 4
    plan = plan_buckets(tree, order=[0, 1, 2, 3], exclude=[2])
    assert plan.as_lists() == [[0, 1, 3]]
    assert plan.excluded == (2,)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bucket_cap_mb": 0},
        {"bucket_cap_mb": -1.0},
        {"first_bucket_cap_mb": 0.0},
        {"bucket_cap_mb": float("nan")},
    ],
)
def test_non_positive_caps_are_rejected(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name} must be a positive number of MiB"):
        plan_buckets([jnp.zeros(3)], **kwargs)


def test_bad_order_is_rejected():
    with pytest.raises(ValueError, match="leaves \\[1\\] are missing"):
        plan_buckets([jnp.zeros(3), jnp.zeros(3)], order=[0])
    with pytest.raises(ValueError, match="names leaf 0 twice"):
        plan_buckets([jnp.zeros(3), jnp.zeros(3)], order=[0, 0, 1])
    with pytest.raises(ValueError, match="exclude must hold leaf indices in \\[0, 2\\)"):
        plan_buckets([jnp.zeros(3), jnp.zeros(3)], exclude=[5])


def test_flatten_rejects_a_tree_that_does_not_match():
    plan = plan_buckets({"a": jnp.zeros(3)})
    with pytest.raises(ValueError, match="structure the bucket plan was built for"):
        flatten_buckets(plan, {"b": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"\['a'\] is float32\[4\].*expects float32\[3\]"):
        flatten_buckets(plan, {"a": jnp.zeros(4)})
    with pytest.raises(ValueError, match="one buffer per bucket: expected 1, got 2"):
        unflatten_buckets(plan, [jnp.zeros(3), jnp.zeros(3)])
    with pytest.raises(ValueError, match=r"bucket 0 must be float32\[3\]"):
        unflatten_buckets(plan, [jnp.zeros(3, jnp.bfloat16)])


def test_huge_and_numpy_caps_are_numbers():
    """1e308 MiB overflowed int(); np.float32(25) was 'not a number'."""
    leaves = [jnp.zeros(3), jnp.zeros(5)]
    huge = plan_buckets(leaves, bucket_cap_mb=1e308, first_bucket_cap_mb=1e308)
    assert len(huge.buckets) == 1
    assert plan_buckets(leaves, bucket_cap_mb=np.float32(25)) == plan_buckets(
        leaves, bucket_cap_mb=25.0
    )
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB"):
        plan_buckets(leaves, bucket_cap_mb=float("inf"))
