"""Layers whose statistics span the data axis: torch's ``SyncBatchNorm`` for Linen and NNX."""
