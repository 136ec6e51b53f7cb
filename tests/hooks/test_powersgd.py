"""PowerSGD and batched PowerSGD against a numpy transcription of torch's hooks."""

import math

import jax
import numpy as np
from _hook_harness import N, bucket_flat, make_grads, run_hook, split_flat
from jax.sharding import PartitionSpec as P

import fdp
from fdp import hooks
from fdp.hooks._powersgd import PowerSGDConfig, compressed_leaves, same_shape_groups

CFG = PowerSGDConfig(2, 2, 2.0)


def plan_of(grads):
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), grads)
    return fdp.plan_buckets(local, bucket_cap_mb=100.0)


def np_orth(m, eps=0.0):
    m = np.array(m, np.float64)
    if m.shape[1] > 2:
        return np.linalg.qr(m)[0]
    for i in range(m.shape[1]):
        m[:, i] /= np.linalg.norm(m[:, i]) + eps
        for j in range(i + 1, m.shape[1]):
            m[:, j] -= np.dot(m[:, i], m[:, j]) * m[:, i]
    return m


def np_powersgd(flat, bucket, chosen, stored_qs, torch_orientation=False):
    """One compressed step on every device's flat buffer (error already added).

    torch_orientation: compress each matrix transposed, (out, in), as torch does.
    """
    leaves = split_flat(flat, bucket)
    out = [leaf.mean(0) for leaf in leaves]
    new_qs = []
    for k, i in enumerate(chosen):
        shape = bucket.shapes[i]
        mats = leaves[i].reshape(N, math.prod(shape[:-1]), shape[-1]).astype(np.float64)
        if torch_orientation:
            mats = mats.transpose(0, 2, 1)
        q = np_orth(stored_qs[k])
        p = np_orth(sum(m @ q for m in mats))
        q = sum(m.T @ p for m in mats) / N
        approx = (p @ q.T).T if torch_orientation else p @ q.T
        out[i] = approx.reshape(shape)
        new_qs.append(q)
    result = np.concatenate([o.reshape(-1) for o in out])
    return out, flat - result[None], new_qs


def test_rank_equal_to_the_smaller_side_reproduces_the_exact_mean():
    grads = make_grads(0, {"w": (48, 12), "b": (12,)})
    hook = hooks.powersgd(
        matrix_approximation_rank=12,
        start_powersgd_iter=0,
        min_compression_rate=0.0,
        use_error_feedback=False,
        warm_start=False,
    )
    plan = plan_of(grads)
    assert compressed_leaves(plan.buckets[0], PowerSGDConfig(12, 0, 0.0, False, False)) == (0,)
    (out,), _ = run_hook(hook, [grads], plan)
    np.testing.assert_allclose(out["w"][0], grads["w"].mean(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["b"][0], grads["b"].mean(0), rtol=1e-6)
    np.testing.assert_array_equal(out["w"][3], out["w"][0])


def test_plain_all_reduce_before_start_then_error_feedback():
    shapes = {"w": (32, 16), "b": (16,)}
    steps = [make_grads(s, shapes) for s in range(3)]
    hook = hooks.powersgd(matrix_approximation_rank=1, start_powersgd_iter=2)
    outs, states = run_hook(hook, steps, plan_of(steps[0]))
    for t in (0, 1):  # iterations before start_powersgd_iter: the exact mean
        np.testing.assert_allclose(outs[t]["w"][0], steps[t]["w"].mean(0), rtol=1e-6)
        assert not states[t]["error"][0].any()
        assert (states[t]["iter"] == t + 1).all()
    # First compressed step: the output plus the device-mean of the carried error
    # is the exact mean gradient, and the compression did change the output.
    error = states[2]["error"][0]  # [N, size], flat in bucket order (w, b)
    (bucket,) = plan_of(steps[0]).buckets
    mean_error = split_flat(error.mean(0), bucket)
    np.testing.assert_allclose(
        outs[2]["w"][0] + mean_error[0], steps[2]["w"].mean(0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        outs[2]["b"][0] + mean_error[1], steps[2]["b"].mean(0), rtol=1e-5, atol=1e-6
    )
    assert not np.allclose(outs[2]["w"][0], steps[2]["w"].mean(0), atol=1e-3)


def test_warm_start_reuses_q():
    shapes = {"w": (24, 20), "v": (20, 6), "b": (6,)}
    steps = [make_grads(10 + s, shapes) for s in range(4)]
    plan = plan_of(steps[0])
    (bucket,) = plan.buckets
    chosen = compressed_leaves(bucket, PowerSGDConfig(2, 2, 2.0))
    assert [bucket.key_paths[i] for i in chosen] == ["['w']", "['v']"]
    runs = {
        warm: run_hook(
            hooks.powersgd(matrix_approximation_rank=2, start_powersgd_iter=2, warm_start=warm),
            steps,
            plan,
        )
        for warm in (True, False)
    }
    (warm_outs, warm_states), (cold_outs, cold_states) = runs[True], runs[False]
    # Step 2 is the first compressed step: both draw the same random Q (the two
    # compiled programs may round differently in the last bit).
    np.testing.assert_allclose(warm_outs[2]["w"], cold_outs[2]["w"], rtol=1e-6, atol=1e-7)
    # Step 3: warm start carries Q over, exactly as numpy does with the stored Q...
    flat = bucket_flat(steps[3], bucket) + warm_states[2]["error"][0]
    stored = [q[0] for q in warm_states[2]["q"][0]]
    want, want_error, want_qs = np_powersgd(flat, bucket, chosen, stored)
    for i, name in enumerate(("w", "v", "b")):  # bucket order
        np.testing.assert_allclose(warm_outs[3][name][0], want[i], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(warm_states[3]["error"][0], want_error, rtol=1e-4, atol=1e-5)
    for got_q, want_q in zip(warm_states[3]["q"][0], want_qs, strict=True):
        np.testing.assert_allclose(got_q[0], want_q, rtol=1e-4, atol=1e-5)
    # ...while without it nothing is carried and step 3 draws a new Q.
    assert all(not q.any() for q in cold_states[3]["q"][0])
    assert not np.allclose(cold_outs[3]["w"][0], warm_outs[3]["w"][0], atol=1e-3)


def test_torch_orientation_compresses_the_transposed_matrix():
    shapes = {"w": (24, 20), "v": (20, 6), "b": (6,)}
    steps = [make_grads(20 + s, shapes) for s in range(4)]
    plan = plan_of(steps[0])
    (bucket,) = plan.buckets
    chosen = compressed_leaves(bucket, PowerSGDConfig(2, 2, 2.0))
    runs = {
        side: run_hook(
            hooks.powersgd(matrix_approximation_rank=2, start_powersgd_iter=2, orientation=side),
            steps,
            plan,
        )
        for side in ("kernel", "torch")
    }
    outs, states = runs["torch"]
    # Q lives on the input side in torch's orientation: (in, r) for an (in, out) kernel.
    assert [q.shape[1:] for q in states[3]["q"][0]] == [(24, 2), (20, 2)]
    flat = bucket_flat(steps[3], bucket) + states[2]["error"][0]
    stored = [q[0] for q in states[2]["q"][0]]
    want, want_error, _ = np_powersgd(flat, bucket, chosen, stored, torch_orientation=True)
    for i, name in enumerate(("w", "v", "b")):
        np.testing.assert_allclose(outs[3][name][0], want[i], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(states[3]["error"][0], want_error, rtol=1e-4, atol=1e-5)
    # The orientation changes the result (P is orthogonalised on the other side).
    assert not np.allclose(runs["kernel"][0][3]["w"][0], outs[3]["w"][0], atol=1e-4)


def test_min_compression_rate_decides_which_leaves_are_compressed():
    shapes = {"big": (64, 64), "thin": (64, 2), "vec": (64,), "conv": (3, 3, 4, 8)}
    grads = make_grads(3, shapes)
    plan = plan_of(grads)
    (bucket,) = plan.buckets
    names = [p.strip("[]'") for p in bucket.key_paths]
    for rate, compressed in [(2.0, {"big", "conv"}), (10.0, {"big"}), (100.0, set())]:
        chosen = compressed_leaves(bucket, PowerSGDConfig(1, 2, rate))
        assert {names[i] for i in chosen} == compressed
        hook = hooks.powersgd(
            start_powersgd_iter=0,
            min_compression_rate=rate,
            use_error_feedback=False,
            warm_start=False,
        )
        (out,), _ = run_hook(hook, [grads], plan)
        for name in shapes:
            exact = np.allclose(out[name][0], grads[name].mean(0), rtol=1e-6, atol=1e-7)
            assert exact == (name not in compressed), (rate, name)


def np_batched(flat, side, stored_q):
    mats = flat.reshape(N, side, side).astype(np.float64)
    q = np_orth(stored_q)
    p = np_orth(sum(m @ q for m in mats))
    q = sum(m.T @ p for m in mats) / N
    approx = (p @ q.T).reshape(-1)
    return approx, flat - approx[None], q


def test_batched_powersgd_matches_numpy():
    shapes = {"w": (10, 9), "b": (9,)}  # 99 elements -> a 10 x 10 matrix
    steps = [make_grads(20 + s, shapes) for s in range(4)]
    plan = plan_of(steps[0])
    (bucket,) = plan.buckets
    hook = hooks.batched_powersgd(matrix_approximation_rank=2, start_powersgd_iter=2)
    outs, states = run_hook(hook, steps, plan)
    np.testing.assert_allclose(outs[1]["w"][0], steps[1]["w"].mean(0), rtol=1e-6)
    assert states[3]["error"][0].shape == (N, 100)
    flat = np.pad(bucket_flat(steps[3], bucket), ((0, 0), (0, 1))) + states[2]["error"][0]
    approx, error, q = np_batched(flat, 10, states[2]["q"][0][0])
    got = np.concatenate([outs[3]["w"][0].reshape(-1), outs[3]["b"][0]])
    np.testing.assert_allclose(got, approx[:99], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(states[3]["error"][0], error, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(states[3]["q"][0][0], q, rtol=1e-4, atol=1e-5)


def test_batched_powersgd_at_full_rank_is_the_exact_mean():
    grads = make_grads(5, {"w": (4, 4)})
    hook = hooks.batched_powersgd(
        matrix_approximation_rank=4,
        start_powersgd_iter=0,
        use_error_feedback=False,
        warm_start=False,
    )
    (out,), _ = run_hook(hook, [grads], plan_of(grads))
    np.testing.assert_allclose(out["w"][0], grads["w"].mean(0), rtol=1e-4, atol=1e-5)


def test_batch_tensors_with_same_shape_matches_unbatched_and_numpy():
    # Three (24, 20) matrices batched together, one (20, 6) alone, a vector plain.
    shapes = {"a": (24, 20), "v": (20, 6), "c": (24, 20), "b": (6,), "d": (24, 20)}
    steps = [make_grads(30 + s, shapes) for s in range(4)]
    plan = plan_of(steps[0])
    (bucket,) = plan.buckets
    chosen = compressed_leaves(bucket, CFG)
    paths = [bucket.key_paths[i].strip("[]'") for i in chosen]
    groups = same_shape_groups([bucket.shapes[i] for i in chosen])
    assert sorted(sorted(paths[k] for k in g) for g in groups) == [["a", "c", "d"], ["v"]]
    runs = {
        batch: run_hook(
            hooks.powersgd(
                matrix_approximation_rank=2,
                start_powersgd_iter=2,
                batch_tensors_with_same_shape=batch,
            ),
            steps,
            plan,
        )
        for batch in (False, True)
    }
    (outs, states), (plain_outs, plain_states) = runs[True], runs[False]
    for t in (2, 3):  # equal to the unbatched results up to rounding (each keeps its Q)
        for name in shapes:
            np.testing.assert_allclose(outs[t][name], plain_outs[t][name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(states[t]["error"][0], plain_states[t]["error"][0], atol=1e-5)
    # Step 3 against numpy from the stored Qs, which keep the unbatched layout.
    assert [q.shape[1:] for q in states[3]["q"][0]] == [
        (6, 2) if p == "v" else (20, 2) for p in paths
    ]
    flat = bucket_flat(steps[3], bucket) + states[2]["error"][0]
    stored = [q[0] for q in states[2]["q"][0]]
    want, want_error, _ = np_powersgd(flat, bucket, chosen, stored)
    for i, path in enumerate(bucket.key_paths):
        name = path.strip("[]'")
        np.testing.assert_allclose(outs[3][name][0], want[i], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(states[3]["error"][0], want_error, rtol=1e-4, atol=1e-5)
    hook = hooks.powersgd(batch_tensors_with_same_shape=True)
    assert hook.name == "powersgd(rank=1, start=1000, batch_tensors_with_same_shape)"
    # The three (24, 20) matrices really go through the power iteration as one stack.
    local = jax.tree.map(lambda x: x[0], steps[0])
    for batch in (False, True):
        h = hooks.powersgd(
            start_powersgd_iter=0,
            use_error_feedback=False,
            warm_start=False,
            batch_tensors_with_same_shape=batch,
        )

        def body(g, h=h):
            return hooks.reduce_with_hook(h, h.init(g, plan), g, plan=plan)[0]

        f = jax.shard_map(body, mesh=fdp.data_mesh(), in_specs=P(), out_specs=P(), check_vma=False)
        assert ("f32[3,24,20]" in str(jax.make_jaxpr(f)(local))) == batch
