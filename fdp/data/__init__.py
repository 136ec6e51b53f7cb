"""Data on the mesh: placement, per-process sampling, uneven inputs, DataParallel apply."""
