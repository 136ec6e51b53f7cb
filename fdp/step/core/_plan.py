"""``StepPlan``: everything static a step compiles for, computed once per input shape."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fdp.backends import FoldCount, count_in_jaxpr
from fdp.bucketing import BucketPlan, plan_for
from fdp.data._model_axes import Specs
from fdp.step.core._state import hook_is_stateful
from fdp.step.grads import _finite as finite
from fdp.step.grads._constraints import check_no_data_constraints, communicates_over
from fdp.step.grads._local_grads import accum_dtype_for
from fdp.step.grads._ready import ready_order_of
from fdp.step.grads._scanned import scanned_leaves
from fdp.step.grads._usage import ParamUsage, key_paths_of, trace_loss, usage_of, warn_if_unused
from fdp.step.options._config import StepConfig


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    """The static part of a step for one shape of its inputs.

    A plan is a hashable value: the jitted step takes it as a static argument,
    and the INFO log, the DETAIL check and :func:`fdp.describe` read it, never
    the step object. Build it with :func:`prepare`.

    Attributes:
      buckets: the bucket plan over one device's parameters (with
        ``find_unused_parameters``, the unused ones are in no bucket).
      usage: how each parameter leaf takes part in the loss (from its jaxpr).
      rows: the global batch size the step runs on (padding included).
      folds: what ``fold_dots`` does with the loss's dense products (None when
        it is off), read from the loss's jaxpr.
      scanned: parameter leaves a ``scan`` iterates over (layer stacks), whose
        gradients stages 0-2 reduce inside the backward loop
        (:mod:`fdp.step.grads._scanned`); empty where the config does not, or where
        ``FDP_CHECK_FINITE`` tests each device's own gradients.
      last_in_loop: the last micro-batch and the bucket reductions run in a loop
        of one trip, and the step's shard_map without replication typing
        (:attr:`fdp.step.options._config.StepConfig.reduces_with_last_micro_batch`, where
        every parameter accumulates in its own floating dtype, the loss runs no
        collective over the data axis, and ``FDP_CHECK_FINITE`` is off).
      opt_layouts: per leaf of the optimizer state, its split over the mesh's
        model axes (empty: none); the parameters' are ``buckets.leaf_layouts``.
        ZeRO's update keeps both inside the step, where arrays carry no
        sharding to read them from.
    """

    buckets: BucketPlan
    usage: ParamUsage
    rows: int
    folds: FoldCount | None = None
    scanned: tuple[int, ...] = ()
    last_in_loop: bool = False
    opt_layouts: Specs = ()

    def _key(self) -> tuple:
        return (
            self.buckets,
            self.usage,
            self.rows,
            self.folds,
            self.scanned,
            self.last_in_loop,
            self.opt_layouts,
        )

    def with_opt_layouts(self, layouts: Specs) -> StepPlan:
        """This plan with the optimizer state's model-axis layouts (unchanged without any)."""
        if not any(len(spec) for spec in layouts):
            return self
        return dataclasses.replace(self, opt_layouts=tuple(layouts))

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, StepPlan) and self._key() == other._key())

    def __hash__(self) -> int:
        # jit hashes its static arguments on every call: compute it once.
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash(self._key())
            object.__setattr__(self, "_hash", value)
            return value


def _abstract(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), x.dtype) for x in leaves)


def _structs(key: tuple[Any, tuple]) -> Any:
    treedef, leaves = key
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in leaves])


def prepare(
    config: StepConfig,
    loss: Callable[..., Any],
    rows: int,
    params: Any,
    *args: Any,
    layouts: Specs = (),
) -> StepPlan:
    """Plans a step: the loss's parameter usage and the buckets, for these input shapes.

    Memoised on the config, the loss and the shapes and dtypes of its inputs, so
    the loss is traced for its usage once per shape, not at every trace of the
    step. Only shapes and dtypes are read.

    Args:
      config: a bound :class:`StepConfig`.
      loss: ``loss(params, *args)`` returning the loss or a tuple starting with it
        (hashable: a function, or a frozen dataclass holding one).
      rows: the global batch size the step runs on.
      params: one device's parameters (arrays or ``jax.ShapeDtypeStruct``).
      *args: the loss's other inputs on one device (a micro-batch, buffers, a key).
      layouts: per parameter leaf, its split over the mesh's non-data axes
        (:func:`fdp.data._model_axes.model_specs`); the buckets never mix two.

    Returns:
      The :class:`StepPlan`. Unused parameters are warned about the first time.
    """
    return _prepare(config, loss, rows, _abstract(params), _abstract(args), tuple(layouts))


@functools.lru_cache(maxsize=128)
def _prepare(
    config: StepConfig,
    loss: Callable[..., Any],
    rows: int,
    params: tuple,
    args: tuple,
    layouts: Specs,
) -> StepPlan:
    param_structs = _structs(params)
    # One trace of the loss per input shape: the parameters' usage and their ready order.
    closed = trace_loss(
        loss,
        param_structs,
        *_structs(args),
        axis_env=[(n, int(config.bound_mesh.shape[n])) for n in config.axis_names],
        mesh=config.bound_mesh,
    )
    check_no_data_constraints(closed.jaxpr, config.axis_names)
    paths = key_paths_of(param_structs)
    usage = usage_of(closed, paths)
    # Points at the user's call of the step: prepare <- the step's __call__ <- user.
    warn_if_unused(usage, config.find_unused_parameters, stacklevel=4)
    exclude = usage.unused if config.find_unused_parameters else ()
    caps = (config.bucket_cap_mb, config.first_bucket_cap_mb)
    buckets = plan_for(param_structs, *caps, exclude, layouts=layouts)
    # DDP rebuilds its buckets in the order gradients became ready; fdp reads that order
    # from the loss's program. A hook with state between steps (PowerSGD, DiLoCo) keeps
    # the first plan: its state may be made before any batch is seen (init, a checkpoint
    # template), from the parameters alone.
    if not hook_is_stateful(config, buckets):
        order = ready_order_of(closed.jaxpr, len(paths))
        buckets = plan_for(param_structs, *caps, exclude, order=order, layouts=layouts)
    folds = count_in_jaxpr(closed.jaxpr) if config.fold_dots else None
    # FDP_CHECK_FINITE names the device whose own gradients are not finite: a gradient
    # reduced in the loop is every device's by then.
    in_loop = config.reduces_scanned_in_loop and not finite.enabled()
    scanned = scanned_leaves(closed.jaxpr, len(paths)) if in_loop else ()
    last_in_loop = _last_in_loop(config, param_structs, closed.jaxpr)
    return StepPlan(buckets, usage, rows, folds, scanned, last_in_loop)


def _last_in_loop(config: StepConfig, params: Any, jaxpr: Any) -> bool:
    """Whether the last micro-batch and the reductions share a loop of one trip.

    That step runs without replication typing, which would change the gradient of
    a loss that communicates over the data axis (the transpose of a psum is a psum
    there), and reduces in the loop, where ``FDP_CHECK_FINITE`` could no longer
    name the device whose own gradients are not finite. The accumulators take the
    gradients' place, so they must be in the parameters' dtypes.
    """
    if not config.reduces_with_last_micro_batch or finite.enabled():
        return False
    own = all(
        jnp.issubdtype(x.dtype, jnp.floating)
        and accum_dtype_for(x.dtype, config.accum_dtype) == x.dtype
        for x in jax.tree.leaves(params)
    )
    return own and not communicates_over(jaxpr, config.axis_names)
