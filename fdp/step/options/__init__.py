"""A step's settings: the four policies, and `StepConfig`, their rules checked once."""
