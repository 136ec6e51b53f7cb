"""DiLoCo (Douillard et al. 2023) and streaming DiLoCo (Douillard et al. 2025).

Each device takes ``inner_steps`` optimizer steps on its own data with no
communication; then the pseudo-gradient ``anchor - params`` (how far the device
moved from where all devices last agreed) is averaged over the data axis and
applied to the anchor by an outer optax optimizer (SGD with Nesterov momentum
by default), and every device continues from the new anchor. One all-reduce of
the parameters every ``inner_steps`` steps replaces one per step.

Streaming DiLoCo splits the parameters into ``fragments`` groups of buckets and
syncs one of them every ``inner_steps / fragments`` steps, so the bytes per sync
(and the peak bandwidth) shrink by ``fragments``; each fragment still syncs
every ``inner_steps`` steps.

The anchor and the outer optimizer's state live in the comm state
(``TrainState.comm_state``), so checkpoints carry them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fdp._validate import check_int
from fdp.bucketing import BucketPlan
from fdp.collectives import vary
from fdp.collectives._axis import AxisName
from fdp.hooks._contract import CommHook, GradBucket, HookState
from fdp.hooks._local_sgd import ModelAverager


def _local_reduce(state: HookState, bucket: GradBucket) -> tuple[Any, HookState]:
    return list(bucket.gradients), state  # inner steps: no communication


def fragment_of_leaves(plan: BucketPlan, fragments: int) -> tuple[int | None, ...]:
    """The fragment of every leaf: buckets in reduce order cut into ``fragments`` runs.

    Leaves in no bucket (integer leaves, excluded ones) get None: they are not synced.

    Raises:
      ValueError: fewer buckets than fragments.
    """
    count = len(plan.buckets)
    if fragments > count:
        raise ValueError(
            f"fragments={fragments} needs at least as many buckets; the model has {count}. "
            "Lower fragments, or lower bucket_cap_mb to cut more buckets."
        )
    out: list[int | None] = [None] * len(plan.leaf_shapes)
    for bucket in plan.buckets:
        for leaf in bucket.leaf_indices:
            out[leaf] = bucket.index * fragments // count
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class DiLoCo(ModelAverager):
    """DiLoCo's outer loop, as a model averager: ``train_step(model_averager=DiLoCo(...))``.

    Build it with :func:`diloco`. It brings its own comm hook (no gradient
    communication), so the step's ``comm_hook`` must be left as default.

    Attributes:
      inner_steps: ``H``, local steps between syncs of each fragment.
      outer_optimizer: the optax optimizer applied to the averaged
        pseudo-gradient.
      fragments: ``P``, parameter fragments synced in turn (1: plain DiLoCo).
    """

    inner_steps: int
    outer_optimizer: optax.GradientTransformation
    fragments: int = 1

    @property
    def hook(self) -> CommHook:
        """The comm hook the step runs: local gradients, state = anchor and outer state."""
        return CommHook(
            f"diloco({self.describe()})", self._init, _local_reduce, replicated_output=False
        )

    def describe(self) -> str:
        """The settings, for logs and the hook's name."""
        return f"inner_steps={self.inner_steps}, fragments={self.fragments}"

    def _init(self, params: Any, plan: BucketPlan) -> HookState:
        leaves, treedef = jax.tree.flatten(params)
        anchor = [jnp.zeros(jnp.shape(x), x.dtype) + x for x in leaves]
        frag = fragment_of_leaves(plan, self.fragments)
        outer = tuple(
            self.outer_optimizer.init([a for a, f in zip(anchor, frag, strict=True) if f == p])
            for p in range(self.fragments)
        )
        return {"anchor": jax.tree.unflatten(treedef, anchor), "outer": outer}

    def offset(self, fragment: int) -> int:
        """Steps into each period at which ``fragment`` syncs (0 for the first)."""
        return fragment * self.inner_steps // self.fragments

    def due(self, step: jax.Array, fragment: int) -> jax.Array:
        """Whether ``fragment`` syncs after step ``step`` (counted from 0)."""
        done = step + 1 - self.offset(fragment)
        return (done >= 0) & (done % self.inner_steps == 0)

    def average(self, params: Any, step: jax.Array, axis_name: AxisName) -> Any:
        raise TypeError("DiLoCo keeps state; the step calls DiLoCo.sync.")

    def sync(
        self, params: Any, step: jax.Array, axis_name: AxisName, state: HookState, plan: BucketPlan
    ) -> tuple[Any, HookState]:
        """After the inner update of step ``step``: the outer step of each fragment due."""
        leaves, treedef = jax.tree.flatten(params)
        anchor = jax.tree.leaves(state["anchor"])
        frag = fragment_of_leaves(plan, self.fragments)
        outer = list(state["outer"])
        for p in range(self.fragments):
            idx = [i for i, f in enumerate(frag) if f == p]

            def outer_step(args: Any, idx: list[int] = idx) -> Any:
                local, start, opt_state = args
                pseudo = [
                    jax.lax.pmean(s - x, axis_name) for s, x in zip(start, local, strict=True)
                ]
                updates, opt_state = self.outer_optimizer.update(pseudo, opt_state, start)
                new = optax.apply_updates(start, updates)
                # Averaged values are replicated; typed per-device like the other branch.
                return vary((new, new, opt_state), axis_name)

            local = [leaves[i] for i in idx]
            start = [anchor[i] for i in idx]
            local, start, outer[p] = jax.lax.cond(
                self.due(step, p),
                outer_step,
                lambda a: vary(a, axis_name),
                (local, start, outer[p]),
            )
            for i, x, a in zip(idx, local, start, strict=True):
                leaves[i], anchor[i] = x, a
        new_state = {"anchor": jax.tree.unflatten(treedef, anchor), "outer": tuple(outer)}
        return jax.tree.unflatten(treedef, leaves), new_state


def diloco(
    inner_steps: int,
    *,
    outer_optimizer: optax.GradientTransformation | None = None,
    fragments: int = 1,
) -> DiLoCo:
    """DiLoCo's outer loop for ``fdp.train_step(model_averager=...)`` (see module doc).

    Args:
      inner_steps: ``H``, local steps between syncs (500 in the paper; tens
        when the links are less slow).
      outer_optimizer: applied to the averaged pseudo-gradient; default SGD
        with learning rate 0.7 and Nesterov momentum 0.9 (the paper's).
      fragments: streaming DiLoCo's ``P``: fragments of buckets synced in turn,
        one every ``inner_steps / fragments`` steps.

    Returns:
      The averager; the step keeps one train state per device (replicas
      diverge between syncs).

    Raises:
      ValueError: a setting out of range, or ``fragments`` not dividing
        ``inner_steps``.

    Example:
      >>> d = diloco(8, fragments=2)
      >>> [int(d.due(jnp.asarray(t), 0)) for t in range(8)], d.offset(1)
      ([0, 0, 0, 0, 0, 0, 0, 1], 4)
    """
    inner_steps = check_int(inner_steps, "inner_steps", low=1)
    fragments = check_int(fragments, "fragments", low=1)
    if inner_steps % fragments:
        raise ValueError(
            f"fragments={fragments} must divide inner_steps={inner_steps}, so each fragment "
            "syncs every inner_steps steps at its own offset."
        )
    if outer_optimizer is None:
        outer_optimizer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    return DiLoCo(inner_steps, outer_optimizer, fragments)
