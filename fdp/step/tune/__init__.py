"""Choosing `bucket_cap_mb` and `layout` by timing built steps (`fdp.tune`, `"auto"`)."""
