"""fdp.DistributedSampler against torch's DistributedSampler rules.

The expected index lists are what torch.utils.data.DistributedSampler gives with
shuffle=False (torch 2.x): padding repeats indices from the start, drop_last cuts
the tail, and rank r takes every num_replicas-th index from position r.
"""

import numpy as np
import pytest

import fdp


@pytest.mark.parametrize(
    ("size", "replicas", "drop_last", "expected"),
    [
        (10, 3, False, [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]),
        (10, 3, True, [[0, 3, 6], [1, 4, 7], [2, 5, 8]]),
        (12, 4, False, [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]),
        (2, 5, False, [[0], [1], [0], [1], [0]]),  # padding longer than the dataset
        (3, 4, True, [[], [], [], []]),
    ],
)
def test_unshuffled_indices_match_torch(size, replicas, drop_last, expected):
    got = [
        list(fdp.DistributedSampler(size, replicas, r, shuffle=False, drop_last=drop_last))
        for r in range(replicas)
    ]
    assert got == expected
    assert {
        len(fdp.DistributedSampler(size, replicas, r, drop_last=drop_last)) for r in range(replicas)
    } == {len(expected[0])}


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_shards_partition_one_permutation_per_epoch(drop_last):
    size, replicas = 103, 4
    samplers = [
        fdp.DistributedSampler(size, replicas, r, seed=7, drop_last=drop_last)
        for r in range(replicas)
    ]
    orders = []
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        shards = [s.indices() for s in samplers]
        assert len({len(x) for x in shards}) == 1
        interleaved = np.stack(shards, 1).ravel()  # undo the striding
        perm = np.random.default_rng(7 + epoch).permutation(size)
        total = len(shards[0]) * replicas
        np.testing.assert_array_equal(
            interleaved, np.resize(perm, total) if not drop_last else perm[:total]
        )
        orders.append(interleaved)
    assert not np.array_equal(orders[0], orders[1])  # a new order every epoch
    again = fdp.DistributedSampler(size, replicas, 2, seed=7, drop_last=drop_last)
    again.set_epoch(1)
    np.testing.assert_array_equal(again.indices(), samplers[2].indices())  # reproducible


def test_batches_resume_inside_an_epoch():
    s = fdp.DistributedSampler(40, 2, 1, seed=3)
    s.set_epoch(2)
    full = list(s.batches(6))
    assert s.num_batches(6) == len(full) == 3 and s.num_batches(6, drop_last=False) == 4
    assert [b.tolist() for b in s.batches(6, start=1)] == [b.tolist() for b in full[1:]]
    np.testing.assert_array_equal(np.concatenate(full), s.indices()[:18])
    assert [len(b) for b in s.batches(6, drop_last=False)] == [6, 6, 6, 2]


def test_defaults_come_from_the_processes():
    s = fdp.DistributedSampler(5)
    assert (s.num_replicas, s.rank, s.shuffle, s.drop_last) == (1, 0, True, False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(dataset_size=10, num_replicas=2, rank=2),
            r"rank must be in 0..num_replicas-1, got rank=2",
        ),
        (
            dict(dataset_size=10, num_replicas=0, rank=0),
            "num_replicas must be an integer >= 1, got num_replicas=0",
        ),
        (dict(dataset_size=-1, num_replicas=1, rank=0), "dataset_size must be an integer >= 0"),
        (dict(dataset_size=10, num_replicas=1, rank=0, seed=1.5), "seed must be an integer"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fdp.DistributedSampler(**kwargs)
