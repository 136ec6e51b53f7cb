"""The calling conventions: Linen `TrainState`, NNX objects, `fdp.ddp`, `fdp.grad_accumulator`."""
