"""fdp.DistributedSampler against torch's DistributedSampler.

The expected index lists are what torch.utils.data.DistributedSampler gives (torch
2.13): padding repeats indices from the start, drop_last cuts the tail, rank r takes
every num_replicas-th index from position r, and the shuffled order is torch.randperm's
with a generator seeded seed + epoch. The literals were read from torch; the tests
that run torch itself skip when it is not installed.
"""

import numpy as np
import pytest

import fdp
from fdp.data._randperm import torch_randperm


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


# (dataset_size, num_replicas, rank, seed, epoch, drop_last) -> torch's indices
TORCH_SHUFFLED = [
    ((10, 2, 0, 0, 0, False), [4, 7, 3, 0, 6]),
    ((10, 2, 1, 0, 0, False), [1, 5, 9, 8, 2]),
    ((10, 3, 1, 0, 1, False), [6, 0, 3, 5]),
    ((10, 3, 2, 5, 0, True), [9, 5, 8]),
    ((7, 4, 3, 1, 2, False), [6, 5]),
    ((2, 5, 4, 0, 0, False), [0]),
]


@pytest.mark.parametrize(("args", "expected"), TORCH_SHUFFLED)
def test_shuffled_order_is_torchs(args, expected):
    size, replicas, rank, seed, epoch, drop_last = args
    s = fdp.DistributedSampler(size, replicas, rank, seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    assert list(s) == expected


def test_torch_randperm_reproduced_in_numpy():
    # torch.randperm(n, generator=torch.Generator().manual_seed(seed)), read from torch 2.13
    assert torch_randperm(10, 0).tolist() == [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]
    assert torch_randperm(103, 7)[:12].tolist() == [44, 23, 22, 89, 17, 30, 93, 78, 16, 94, 53, 14]
    assert torch_randperm(103, 8)[:12].tolist() == [83, 47, 45, 32, 29, 37, 27, 58, 10, 60, 66, 9]
    assert torch_randperm(1, 3).tolist() == [0] and torch_randperm(0, 3).tolist() == []


def test_against_torch_itself():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    for n, seed in [(1, 0), (2, 1), (103, 7), (1000, 2**32 + 5), (4096, 12345)]:
        g = torch.Generator()
        g.manual_seed(seed)
        assert torch_randperm(n, seed).tolist() == torch.randperm(n, generator=g).tolist()
    for size, replicas, drop_last in [(103, 4, False), (103, 4, True), (5, 8, False)]:
        for rank in range(replicas):
            theirs = DistributedSampler(range(size), replicas, rank, seed=3, drop_last=drop_last)
            ours = fdp.DistributedSampler(size, replicas, rank, seed=3, drop_last=drop_last)
            for epoch in (0, 1):
                theirs.set_epoch(epoch)
                ours.set_epoch(epoch)
                assert list(ours) == list(theirs)
                assert len(ours) == len(theirs)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("permutation", ["torch", "numpy"])
def test_shuffled_shards_partition_one_permutation_per_epoch(drop_last, permutation):
    size, replicas = 103, 4
    samplers = [
        fdp.DistributedSampler(
            size, replicas, r, seed=7, drop_last=drop_last, permutation=permutation
        )
        for r in range(replicas)
    ]
    orders = []
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        shards = [s.indices() for s in samplers]
        assert len({len(x) for x in shards}) == 1
        interleaved = np.stack(shards, 1).ravel()  # undo the striding
        if permutation == "numpy":  # fdp's order before it followed torch's
            perm = np.random.default_rng(7 + epoch).permutation(size)
        else:
            perm = torch_randperm(size, 7 + epoch)
        total = len(shards[0]) * replicas
        np.testing.assert_array_equal(
            interleaved, np.resize(perm, total) if not drop_last else perm[:total]
        )
        orders.append(interleaved)
    assert not np.array_equal(orders[0], orders[1])  # a new order every epoch
    again = fdp.DistributedSampler(
        size, replicas, 2, seed=7, drop_last=drop_last, permutation=permutation
    )
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
        (
            dict(dataset_size=10, num_replicas=1, rank=0, permutation="jax"),
            r"permutation must be one of \('torch', 'numpy'\), got permutation='jax'",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fdp.DistributedSampler(**kwargs)
