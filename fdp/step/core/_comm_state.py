"""``fdp.NNXCommState``: an NNX step's comm-hook state, held by the user and passed explicitly.

A stateful comm hook (PowerSGD's error feedback and low-rank factors, int8 error
feedback, a step counter) keeps arrays between steps. The Linen front end carries
them in a field of the state it is given and returns (``fdp.TrainState.comm_state``).
An NNX step updates its objects in place, so its hook state is an NNX object of its
own, beside the model and the optimizer, in the way ``nnx.Optimizer`` sits beside
the model: made by ``step.init``, passed to every step call, updated there in place,
and saved and restored with the rest.

fdp 0.1 set an attribute, ``fdp_comm_state``, on the user's ``nnx.Optimizer`` instead:
a channel no call shows, which changed the optimizer's ``nnx.state`` and graph. That
spelling still works for this release (:data:`LEGACY_ATTR`), with a
``DeprecationWarning``; a checkpoint written that way restores into ``(model,
optimizer, comm_state)`` (``runtime/_ckpt_legacy.py`` moves it).

This module imports nothing of fdp: the checkpoint code (a lower layer than the
step) names the class to move fdp 0.1's layout.
"""

from __future__ import annotations

from flax import nnx

# Where fdp 0.1 kept the hook state: an attribute it set on the user's optimizer.
LEGACY_ATTR = "fdp_comm_state"


class HookState(nnx.Variable):
    """A comm hook's state: one copy per device, stacked along a leading device axis."""


class NNXCommState(nnx.Pytree):
    """A comm hook's state for :func:`fdp.nnx_train_step`, beside the model and optimizer.

    ``comm_state = step.init(model, optimizer)`` makes it; every step takes it
    as ``step(model, optimizer, batch, comm_state=comm_state)`` and updates it
    in place, as it updates the model and the optimizer. Checkpoint it with
    them: ``ckpt.save(n, (model, optimizer, comm_state))`` and
    ``ckpt.restore((model, optimizer, comm_state))``.

    It is an ``nnx.Pytree`` like ``nnx.Optimizer``: ``nnx.state``,
    ``nnx.split``/``nnx.merge`` and ``nnx.jit`` see its arrays, and nothing
    else holds them. ``comm_state.comm_state`` is a :class:`HookState`
    variable (the hook's arrays, one copy per device, stacked along a leading
    device axis sharded over the data axis, as in ``fdp.TrainState.comm_state``),
    or ``None`` while the hook keeps no state or before the first step fills
    it. An empty ``NNXCommState()`` passed to a step is filled at its first
    call; ``step.init`` returns it filled, a template to restore into.

    Example:
      >>> import optax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import fdp
      >>> model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> hook = fdp.hooks.powersgd(matrix_approximation_rank=1)
      >>> step = fdp.nnx_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2),
      ...                           reduction=fdp.Reduction(comm_hook=hook))
      >>> comm_state = step.init(model, optimizer)
      >>> metrics = step(model, optimizer, fdp.shard_batch({"x": jnp.ones((8, 64))}),
      ...                comm_state=comm_state)
      >>> comm_state.comm_state.get_value()["iter"].tolist()  # the hook's count, per device
      [1, 1, 1, 1, 1, 1, 1, 1]
      >>> hasattr(optimizer, "fdp_comm_state")  # nothing is added to the optimizer
      False
    """

    def __init__(self) -> None:
        # Data, not static: the arrays a step fills in later are the object's state.
        self.comm_state: HookState | None = nnx.data(None)
