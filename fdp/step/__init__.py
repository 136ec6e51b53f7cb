"""The train step: per-device gradients, bucketed reduction, update (Linen and NNX)."""
