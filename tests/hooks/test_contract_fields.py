"""What a hook and a bucket carry as plain fields: the reduce-scatter form, the bucket order."""

import jax
import numpy as np
import pytest
from _hook_harness import N, make_grads, run_hook

import fdp
from fdp import hooks
from fdp.hooks._contract import stateless_init
from fdp.step.options._config import StepConfig


def _mean(state, bucket):
    return hooks.allreduce().reduce(state, bucket)


def test_the_reduce_scatter_form_is_a_field_of_the_hook():
    plain = hooks.CommHook("mine", stateless_init, _mean)  # the five-field constructor
    scatter = hooks.allreduce().reduce_scatter
    given = hooks.with_reduce_scatter(plain, scatter)
    assert plain.reduce_scatter is None, "with_reduce_scatter changed the hook it was given"
    assert given.reduce_scatter is scatter and given[:5] == plain[:5]
    assert given != plain and given == hooks.CommHook(
        "mine", stateless_init, _mean, reduce_scatter=scatter
    )
    assert hash(given) == hash(hooks.with_reduce_scatter(plain, scatter))
    with pytest.raises(TypeError):
        hooks.CommHook("mine", stateless_init, _mean, True, True, scatter)  # keyword-only


def test_wrappers_keep_or_drop_the_form_as_they_can_run_it():
    assert hooks.bf16_compress_wrapper(hooks.allreduce()).reduce_scatter is not None
    assert hooks.bf16_compress_wrapper(hooks.powersgd()).reduce_scatter is None
    # reduce_dtype's hook has none: ZeRO stages 2 and 3 refuse reduce_dtype.
    config = StepConfig(reduction=fdp.Reduction(reduce_dtype="float32"))
    assert config.hook.reduce_scatter is None


def test_each_bucket_comes_after_the_previous_one_and_knows_the_largest():
    """GradBucket.after: the previous bucket's reduced gradients (what a hook with side
    effects, the CPU backend's shared-memory sum, orders its call after)."""
    seen = []

    def reduce(state, bucket):
        result, state = _mean(state, bucket)
        after = None if bucket.after is None else [np.shape(a) for a in bucket.after]
        seen.append((bucket.index, after, bucket.largest_nbytes))
        return result, state

    grads = make_grads(0, {"a": (5, 3), "b": (7,), "c": (4, 4), "d": (6,)})
    plan = fdp.plan_buckets(
        jax.tree.map(lambda x: x[0], grads), bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5
    )
    assert len(plan.buckets) == 4
    outs, _ = run_hook(hooks.CommHook("recording", stateless_init, reduce), [grads], plan)
    largest = max(b.nbytes for b in plan.buckets)
    leaf_shapes = [np.shape(x)[1:] for x in jax.tree.leaves(grads)]
    expected = [(0, None, largest)] + [
        (b.index, [leaf_shapes[i] for i in plan.buckets[b.index - 1].leaf_indices], largest)
        for b in plan.buckets[1:]
    ]
    assert seen == expected
    mean = jax.tree.map(lambda g: np.broadcast_to(g.mean(0), g.shape), grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), outs[0], mean)
    assert jax.tree.leaves(outs[0])[0].shape[0] == N
