"""PowerSGD's compression statistics against torch's counting rules and torch itself."""

import math

import jax
import jax.numpy as jnp
import pytest

import fdp
from fdp import hooks

# Flax layouts of torch's Linear(20, 24), Linear(24, 24), Linear(24, 6), Conv2d(4, 8, 3).
FLAX = {
    "a": {"kernel": (20, 24), "bias": (24,)},
    "b": {"kernel": (24, 24), "bias": (24,)},
    "c": {"kernel": (24, 6), "bias": (6,)},
    "conv": {"kernel": (3, 3, 4, 8), "bias": (8,)},
}
TORCH = [(24, 20), (24,), (24, 24), (24,), (6, 24), (6,), (8, 4, 3, 3), (8,)]


def plan():
    tree = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32), FLAX, is_leaf=lambda x: isinstance(x, tuple)
    )
    return fdp.plan_buckets(tree, bucket_cap_mb=100.0)


def torch_counts(shapes, rank, rate):
    """torch's powerSGD_hook counting, transcribed: view(shape[0], -1), _should_compress."""
    before = after = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        before += n * m
        after += (n + m) * r if (n + m) * r * rate < n * m else n * m
    return before, after


def test_counts_are_torchs_for_the_same_layers():
    cfg = hooks.PowerSGDConfig(matrix_approximation_rank=2, start_powersgd_iter=2)
    one = hooks.powersgd_compression_stats(plan(), cfg)
    assert one == (1550 / 394, 1550, 394)  # literal: 480+24+576+24+144+6+288+8 -> 88+...
    three = hooks.powersgd_compression_stats(plan(), cfg, iterations=3)
    assert three == (1550 / 394, 4650, 1182)  # torch's totals keep growing
    assert hooks.powersgd_compression_stats(plan(), cfg, iterations=0) == (0, 0, 0)
    torch_side = hooks.PowerSGDConfig(2, 2, orientation="torch")
    assert hooks.powersgd_compression_stats(plan(), torch_side) == one
    for rank in (1, 2, 4, 8):
        for rate in (0.0, 1.5, 2.0, 10.0):
            stats = hooks.powersgd_compression_stats(plan(), hooks.PowerSGDConfig(rank, 2, rate))
            before, after = torch_counts(TORCH, rank, rate)
            assert stats[1:] == (before, after), (rank, rate)


def test_batched_counts_a_square_per_bucket():
    (bucket,) = plan().buckets
    assert bucket.size == 1550  # side ceil(sqrt(1550)) = 40
    stats = hooks.powersgd_compression_stats(plan(), hooks.PowerSGDConfig(2, 2), batched=True)
    assert stats == (1550 / 160, 1550, 2 * 40 * 2)
    with pytest.raises(ValueError, match="iterations must be an integer >= 0"):
        hooks.powersgd_compression_stats(plan(), iterations=-1)


def test_matches_torchs_powersgd_state(tmp_path):
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(20, 24), torch.nn.Linear(24, 24)
            self.c, self.conv = torch.nn.Linear(24, 6), torch.nn.Conv2d(4, 8, 3)

        def forward(self, x, img):
            return self.c(self.b(self.a(x))).sum() + self.conv(img).sum()

    if dist.is_initialized():
        pytest.skip("a torch process group is already running")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        for rank, rate in [(1, 2.0), (2, 2.0), (4, 10.0), (1, 0.5)]:  # 0.5: vectors too
            net = Net()
            assert [tuple(p.shape) for p in net.parameters()] == TORCH
            state = powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                min_compression_rate=rate,
            )  # fmt: skip
            ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=100)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            for _ in range(5):
                ddp(torch.randn(3, 20), torch.randn(2, 4, 5, 5)).backward()
            cfg = hooks.PowerSGDConfig(rank, 2, rate)
            got = hooks.powersgd_compression_stats(plan(), cfg, iterations=5 - 2)
            assert got == pytest.approx(state.compression_stats()), (rank, rate)
    finally:
        dist.destroy_process_group()
