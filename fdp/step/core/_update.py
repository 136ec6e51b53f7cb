"""The update: the optimizer applied to the reduced gradients, written once for both front ends.

A front end says how its state holds parameters and optimizer state and how its
optimizer steps (:class:`FrontEnd`: ``TrainState.apply_gradients`` in Linen,
``nnx.Optimizer.update`` in NNX); :func:`update` and :func:`sharded_update`
(ZeRO) are the rest, the same for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax

from fdp.step.core._plan import StepPlan
from fdp.step.grads._local_grads import Objective
from fdp.step.grads._usage import keep_from_flags, keep_untouched
from fdp.step.layout._padding import pad_tree, unpad_like
from fdp.step.layout._zero import constrain, constrain_replicated
from fdp.step.options._config import StepConfig


class Parts(NamedTuple):
    """A front end's state as the step's ``shard_map`` takes it (each a pytree, or None).

    Attributes:
      owner: what holds the parameters and optimizer state (a Linen
        ``TrainState`` without its side fields; the ``nnx.State`` of the
        model and optimizer).
      buffers: state the forward pass changes (Linen's ``batch_stats``).
      hook_state: the comm hook's state, one copy per device (stacked).
    """

    owner: Any
    buffers: Any = None
    hook_state: Any = None


class View(NamedTuple):
    """What the step reads from a front end's state, inside the trace.

    Attributes:
      owner: what :meth:`FrontEnd.apply` updates (a ``TrainState``; the
        ``(model, optimizer)`` pair).
      params: the parameters the gradients are taken of.
      buffers: state threaded through the micro-batches (or None).
      hook_state: the comm hook's state (this device's, inside ``shard_map``;
        stacked outside), or None when the hook keeps none.
      keys: random keys to fold per device before the loss (NNX's
        ``nnx.Rngs``), or None.
      extra: what the front end needs again in :meth:`FrontEnd.objective`
        and :meth:`FrontEnd.close`.
    """

    owner: Any
    params: Any
    buffers: Any
    hook_state: Any
    keys: Any = None
    extra: Any = None


class FrontEnd(Protocol):
    """How one front end's state is read, updated and written back (Linen, NNX).

    ``local`` says whether the call is inside the step's ``shard_map`` (stage 0:
    per-device copies are stripped to one and stacked again) or outside it on
    whole arrays (ZeRO's update).
    """

    def split(self, static: Any, state: Any) -> Parts:
        """The jitted step's state argument as :class:`Parts`."""
        ...

    def join(self, static: Any, parts: Parts) -> Any:
        """The inverse of :meth:`split`."""
        ...

    def specs(self, config: StepConfig, parts: Parts) -> Parts:
        """The ``shard_map`` specs of ``parts`` (stage 0)."""
        ...

    def open(self, config: StepConfig, static: Any, parts: Parts, *, local: bool) -> View:
        """What the step reads from ``parts``."""
        ...

    def objective(self, config: StepConfig, view: View, keys: Any) -> Objective:
        """The user's loss as the core's ``objective``, with per-device ``keys``."""
        ...

    def local_buffers(self, buffers: Any) -> Any:
        """Inside ``shard_map`` (ZeRO): this device's buffers from what came in."""
        ...

    def buffer_spec(self, config: StepConfig, buffers: Any) -> Any:
        """The ``shard_map`` spec of the buffers (ZeRO)."""
        ...

    def wrap_buffers(self, like: Any, buffers: Any) -> Any:
        """Inside ``shard_map`` (ZeRO): new buffers in the form ``like`` came in."""
        ...

    def set_buffers(self, owner: Any, buffers: Any) -> Any:
        """``owner`` holding the new buffers (NNX's are in the model)."""
        ...

    def params(self, owner: Any) -> Any:
        """The parameters' arrays."""
        ...

    def opt_state(self, owner: Any) -> Any:
        """The optimizer state's arrays."""
        ...

    def with_arrays(self, owner: Any, params: Any, opt_state: Any) -> Any:
        """``owner`` holding these parameters and optimizer state."""
        ...

    def apply(self, owner: Any, grads: Any) -> Any:
        """One optimizer step with ``grads``."""
        ...

    def count(self, owner: Any) -> Any:
        """The optimizer's step count (for a model averager)."""
        ...

    def close(
        self,
        config: StepConfig,
        view: View,
        owner: Any,
        buffers: Any,
        hook_state: Any,
        *,
        local: bool,
    ) -> Parts:
        """The new :class:`Parts` (the inverse of :meth:`open`)."""
        ...


def update(front: FrontEnd, owner: Any, grads: Any, keep: Sequence[Any] | None) -> Any:
    """``owner`` after the optimizer's step, leaves flagged in ``keep`` left as they were.

    A kept parameter keeps its optimizer state too (Adam's moments): every
    subtree with the parameters' structure is kept (:func:`keep_untouched`).
    """
    if keep is None:
        return front.apply(owner, grads)
    old = (front.params(owner), front.opt_state(owner))
    owner = front.apply(owner, grads)
    new = (front.params(owner), front.opt_state(owner))
    params, opt_state = keep_untouched(new, old, jax.tree.structure(old[0]), keep)
    return front.with_arrays(owner, params, opt_state)


def sharded_update(
    front: FrontEnd,
    owner: Any,
    grads: Any,
    flags: Any,
    *,
    config: StepConfig,
    plan: StepPlan,
) -> Any:
    """ZeRO's update, written on whole arrays: XLA runs it on each device's share.

    The optimizer state (and the parameters from stage 3) stay sharded over the
    data axis; at stages 1 and 2 the new parameters are gathered whole. Leaves
    of the optimizer state kept padded (:mod:`fdp.step.layout._padding`) are updated
    with parameters and gradients padded the same way, the padding cut after.

    Args:
      front: the front end.
      owner: its state, before the update.
      grads: the reduced gradients (whole, or each device's shares).
      flags: per tracked parameter, whether some device used it (or None).
      config: the bound step config.
      plan: the step plan.
    """
    mesh, axis = config.bound_mesh, config.shard_axis  # the data axis, or a host's devices
    n = config.num_shards
    # Each leaf's split over the model axes (tensor parallelism), kept under ZeRO's.
    laid, opt_laid = plan.buckets.leaf_layouts, plan.opt_layouts
    # Parameters and gradients padded as the optimizer state is (fdp.step.layout._padding),
    # the padding cut off the new parameters after.
    params = front.params(owner)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    owner = front.with_arrays(
        owner,
        constrain(pad_tree(params, n, laid), mesh, axis, laid),
        constrain(front.opt_state(owner), mesh, axis, opt_laid),
    )
    keep = None if flags is None else keep_from_flags(plan.usage, flags)
    owner = update(front, owner, constrain(pad_tree(grads, n, laid), mesh, axis, laid), keep)
    params = unpad_like(front.params(owner), shapes)
    return front.with_arrays(
        owner,
        constrain(params, mesh, axis, laid)
        if config.zero_stage >= 3
        else constrain_replicated(params, mesh, laid),
        constrain(front.opt_state(owner), mesh, axis, opt_laid),
    )
