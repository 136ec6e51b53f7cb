"""DistributedSampler.position / set_position: resuming mid-epoch on another world size."""

import numpy as np
import pytest

import fdp


def read(samplers, batch_size, batches=None):
    """The indices all readers read, batch by batch, in global order."""
    out = []
    per = [list(s.batches(batch_size)) for s in samplers]
    for b in range(len(per[0]) if batches is None else batches):
        out.extend(np.concatenate([p[b] for p in per]).tolist())
    return out


@pytest.mark.parametrize(("before", "after"), [(2, 1), (4, 2), (1, 4), (2, 3), (8, 4)])
@pytest.mark.parametrize("stop", [0, 1, 3])
def test_a_resumed_epoch_reads_every_example_once(before, after, stop):
    n, global_batch = 96, 24
    first = [fdp.DistributedSampler(n, before, r, seed=3) for r in range(before)]
    for s in first:
        s.set_epoch(2)
    seen = read(first, global_batch // before, stop)
    position = first[0].position(stop, global_batch // before)
    assert all(s.position(stop, global_batch // before) == position for s in first)
    second = [fdp.DistributedSampler(n, after, r, seed=3) for r in range(after)]
    for s in second:
        s.set_position(position)
    seen += read(second, global_batch // after)
    assert sorted(seen) == list(range(n))  # nothing skipped, nothing twice
    whole = fdp.DistributedSampler(n, 1, 0, seed=3)
    whole.set_epoch(2)
    order = whole.indices()
    # Every global batch holds the examples an uninterrupted one-reader run reads in it.
    for b in range(n // global_batch):
        assert sorted(seen[b * global_batch : (b + 1) * global_batch]) == sorted(
            order[b * global_batch : (b + 1) * global_batch]
        )
    for s in second:  # the next epoch is whole again
        s.set_epoch(3)
    assert sorted(read(second, global_batch // after)) == list(range(n))


def test_an_uneven_rest_is_padded_or_cut_by_torchs_rules():
    s = fdp.DistributedSampler(10, 1, 0, shuffle=False)
    s.set_position({"epoch": 0, "consumed": 3, "dataset_size": 10, "seed": 0})
    assert list(s) == [3, 4, 5, 6, 7, 8, 9]
    pad = [fdp.DistributedSampler(10, 2, r, shuffle=False) for r in range(2)]
    cut = [fdp.DistributedSampler(10, 2, r, shuffle=False, drop_last=True) for r in range(2)]
    for x in pad + cut:
        x.set_position(s.position(0, 1))
    assert [list(x) for x in pad] == [[3, 5, 7, 9], [4, 6, 8, 3]]
    assert [list(x) for x in cut] == [[3, 5, 7], [4, 6, 8]]
    assert len(pad[0]) == 4 and pad[0].num_batches(2) == 2


@pytest.mark.parametrize(
    ("position", "match"),
    [
        ({"epoch": 1}, r"position must be a value of DistributedSampler.position\(\)"),
        (
            {"epoch": 1, "consumed": 4, "dataset_size": 11, "seed": 0},
            r"saved with dataset_size=11, but this sampler has dataset_size=10",
        ),
        (
            {"epoch": 1, "consumed": 4, "dataset_size": 10, "seed": 5},
            r"saved with seed=5.*Build the sampler with seed=5",
        ),
    ],
)
def test_a_position_from_another_order_is_refused(position, match):
    with pytest.raises(ValueError, match=match):
        fdp.DistributedSampler(10, 2, 0).set_position(position)
