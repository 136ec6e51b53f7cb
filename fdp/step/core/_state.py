"""What a step keeps between calls: ``fdp.TrainState``, per-device copies, hook state.

Before its first step a Linen state is prepared once (:func:`prepare_linen_state`):
placed on the mesh, stacked once per device where replicas may diverge, and given
the comm hook's state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fdp.bucketing import BucketPlan
from fdp.data._abstract import run_or_describe
from fdp.data._model_axes import has_model_axes, model_specs, place_kept
from fdp.data._placement import replicate
from fdp.step.layout._zero import is_placed, place
from fdp.step.options._config import StepConfig


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus ``comm_state`` and ``batch_stats``.

    ``comm_state`` holds the comm hook's state (PowerSGD's error feedback and Q
    matrices, iteration counters), one copy per device, stacked along a leading
    device axis sharded over the data axis. It is ``None`` until the first step
    initialises it from the parameters, and it travels with the rest of the
    state through ``jit``, donation and checkpoints.

    ``batch_stats`` holds Flax's mutable ``batch_stats`` collection (BatchNorm
    running statistics) when the model has one; the step then passes it to the
    loss function and keeps it in step across devices (``buffers=``).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)},
      ...                           tx=optax.sgd(0.1))
      >>> state.comm_state is None
      True
    """

    comm_state: Any = None
    batch_stats: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PerDevice:
    """A pytree kept once per device: every leaf has a leading device axis.

    fdp wraps ``batch_stats`` in it with ``buffers='local'``. Device ``i``'s
    copy is ``jax.tree.map(lambda x: x[i], per_device.value)``.
    """

    value: Any


def strip_device_axis(tree: Any) -> Any:
    """Inside shard_map: a per-device leaf ``[1, ...]`` as ``[...]``."""
    return jax.tree.map(lambda x: x[0], tree)


def add_device_axis(tree: Any) -> Any:
    """Inside shard_map: ``[...]`` as this device's ``[1, ...]`` block."""
    return jax.tree.map(lambda x: x[None], tree)


def has_leaves(tree: Any) -> bool:
    """Whether a pytree holds any array."""
    return bool(jax.tree.leaves(tree))


SIDE_FIELDS = ("comm_state", "batch_stats")


def split_side(state: Any) -> tuple[Any, dict[str, Any]]:
    """A Linen state without its side fields (hook state, batch statistics), and those."""
    side = {f: getattr(state, f) for f in SIDE_FIELDS if getattr(state, f, None) is not None}
    return (state.replace(**dict.fromkeys(side)) if side else state), side


def join_side(core: Any, side: dict[str, Any]) -> Any:
    """The inverse of :func:`split_side` (fields that are None stay as they are)."""
    present = {k: v for k, v in side.items() if v is not None}
    return core.replace(**present) if present else core


def _init_hook_state(config: StepConfig, buckets: BucketPlan, params: Any, stacked: bool) -> Any:
    def local(params: Any) -> Any:
        params = strip_device_axis(params) if stacked else params
        return add_device_axis(config.hook.init(params, buckets))

    spec = jax.P(config.axis_name)
    mapped = jax.shard_map(
        local,
        mesh=config.bound_mesh,
        in_specs=spec if stacked else jax.P(),
        out_specs=spec,
        axis_names=set(config.axis_names),
        check_vma=False,
    )
    return mapped(params)


_init_hook_state_jit = jax.jit(_init_hook_state, static_argnums=(0, 1, 3))


def init_hook_state(config: StepConfig, buckets: BucketPlan, params: Any, *, stacked: bool) -> Any:
    """The comm hook's state on every device, stacked along a leading device axis.

    Args:
      config: the bound step config.
      buckets: the step's bucket plan (it shapes the state).
      params: the parameters, replicated, or ``stacked`` with a device axis.
      stacked: whether ``params`` has a leading device axis.
    """
    return run_or_describe(
        _init_hook_state_jit, config, buckets, params, stacked, out_sharding=_device_axis(config)
    )


def _stack_per_device(config: StepConfig, tree: Any) -> Any:
    return jax.shard_map(
        add_device_axis,
        mesh=config.bound_mesh,
        in_specs=jax.P(),
        out_specs=jax.P(config.axis_name),
        axis_names=set(config.axis_names),
        check_vma=False,
    )(tree)


_stack_per_device_jit = jax.jit(_stack_per_device, static_argnums=0)


def stack_per_device(config: StepConfig, tree: Any) -> Any:
    """One copy of a replicated pytree per device, stacked on the data axis."""
    return run_or_describe(_stack_per_device_jit, config, tree, out_sharding=_device_axis(config))


def _device_axis(config: StepConfig) -> NamedSharding:
    """Where per-device copies live: stacked along a leading axis over the data axis."""
    return NamedSharding(config.bound_mesh, P(config.axis_name))


def unstacked(tree: Any) -> Any:
    """Shapes of one device's copy of a pytree stacked along a leading device axis."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype), tree)


@functools.lru_cache(maxsize=64)
def hook_is_stateful(config: StepConfig, buckets: BucketPlan) -> bool:
    """Whether the comm hook keeps state between steps (its ``init`` returns arrays)."""
    params = jax.tree.unflatten(buckets.treedef, buckets.leaf_structs())
    return has_leaves(jax.eval_shape(lambda p: config.hook.init(p, buckets), params))


def _stacked(config: StepConfig, state: Any) -> bool:
    return config.per_device_state and jnp.ndim(state.step) > 0


def _wants_local_stats(config: StepConfig, state: Any) -> bool:
    stats = getattr(state, "batch_stats", None)
    local = config.buffers == "local" and stats is not None and not config.per_device_state
    return local and not isinstance(stats, PerDevice)


def on_mesh(tree: Any, mesh: Any) -> bool:
    """Whether every leaf of ``tree`` is a ``jax.Array`` on ``mesh`` (any spec)."""
    return all(
        isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
        for x in jax.tree.leaves(tree)
    )


def replicate_over_data(config: StepConfig, tree: Any) -> Any:
    """``tree`` replicated over the data axis, split over the mesh's other axes as it was.

    Each leaf keeps its split over the non-data axes (tensor parallelism),
    whether it was placed so or declares it through Flax's partitioning
    metadata (:mod:`fdp.data._model_axes`); a tree with none is
    :func:`fdp.replicate`'d.
    """
    mesh = config.bound_mesh
    specs = model_specs(tree, mesh, config.axis_name)
    if not has_model_axes(specs):
        return replicate(tree, mesh)
    return place_kept(tree, mesh, specs)


def replicated_over_data(config: StepConfig, tree: Any) -> bool:
    """Whether every leaf of ``tree`` lies as :func:`replicate_over_data` would place it."""
    mesh = config.bound_mesh
    specs = model_specs(tree, mesh, config.axis_name)
    return all(
        isinstance(x, jax.Array) and x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
        for x, spec in zip(jax.tree.leaves(tree), specs, strict=True)
    )


def zero_placed(config: StepConfig, params: Any, opt_state: Any) -> bool:
    """Whether parameters and optimizer state already have their ZeRO shardings (cheap)."""
    mesh, axis = config.bound_mesh, config.shard_axis
    if not is_placed(opt_state, mesh, axis, pad=True):
        return False
    return config.zero_stage < 3 or is_placed(params, mesh, axis)


def place_zero(config: StepConfig, params: Any, opt_state: Any) -> tuple[Any, Any]:
    """Parameters (sharded at stage 3, else whole) and sharded optimizer state."""
    mesh, axis = config.bound_mesh, config.shard_axis
    return (
        place(params, mesh, axis, sharded=config.zero_stage >= 3),
        place(opt_state, mesh, axis, pad=True),
    )


def place_zero_core(config: StepConfig, core: Any) -> Any:
    """A Linen state on the mesh with its parameters and optimizer state given ZeRO's layout."""
    params, opt_state = place_zero(config, core.params, core.opt_state)
    return core.replace(params=params, opt_state=opt_state)


def linen_layout(config: StepConfig, state: Any) -> Any:
    """An abstract Linen state (shape structs) placed as :func:`prepare_linen_state` places it.

    Before any per-device copies or hook state are added (the step adds those
    to the state it is given); the side fields (``batch_stats``) replicated, as
    the step's outputs are.
    """
    core, side = split_side(state)
    core = replicate_over_data(config, core)
    if config.zero_stage:
        core = place_zero_core(config, core)
    return join_side(core, replicate(side, config.bound_mesh) if side else side)


def linen_state_ready(config: StepConfig, state: Any, stateful_hook: bool) -> bool:
    """Whether a Linen state that went through a step needs no more preparing (cheap)."""
    if config.per_device_state and not _stacked(config, state):
        return False
    if config.zero_stage and not zero_placed(config, state.params, state.opt_state):
        return False
    if _wants_local_stats(config, state):
        return False
    return not stateful_hook or getattr(state, "comm_state", None) is not None


def prepare_linen_state(config: StepConfig, state: Any, buckets: BucketPlan) -> Any:
    """A Linen ``TrainState`` ready for the step: what is missing is added, once.

    The replicated part goes on the mesh (the step's outputs live there; inputs
    placed elsewhere would compile the step a second time). With a hook whose
    replicas diverge every leaf gains a leading device axis; with
    ``buffers='local'`` ``batch_stats`` is kept once per device
    (:class:`PerDevice`); a stateful hook's ``comm_state`` is filled. With ZeRO
    the optimizer state (and at stage 3 the parameters) is sharded.

    Raises:
      TypeError: the hook keeps state and ``state`` has no ``comm_state`` field.
    """
    if config.zero_stage:
        if not zero_placed(config, state.params, state.opt_state):
            core, side = split_side(state)
            if not on_mesh(core, config.bound_mesh):
                core = replicate_over_data(config, core)
            state = join_side(place_zero_core(config, core), side)
    elif not _stacked(config, state):
        core, side = split_side(state)
        if not replicated_over_data(config, core):
            core = replicate_over_data(config, core)
        if config.per_device_state:
            core = stack_per_device(config, core)
        state = join_side(core, side)
    if _wants_local_stats(config, state):
        state = state.replace(batch_stats=PerDevice(stack_per_device(config, state.batch_stats)))
    if hook_is_stateful(config, buckets) and getattr(state, "comm_state", None) is None:
        if not hasattr(state, "comm_state"):
            raise TypeError(
                f"comm hook {config.comm_hook.name!r} keeps state between steps; use "
                "fdp.TrainState (flax's TrainState with a comm_state field) instead of "
                f"{type(state).__module__}.{type(state).__qualname__}."
            )
        comm = init_hook_state(config, buckets, state.params, stacked=config.per_device_state)
        state = state.replace(comm_state=comm)
    return state
