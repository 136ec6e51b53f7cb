"""The data axis inside the loss: sharding constraints on it refused, collectives over it found.

Collectives: a loss that communicates over the data axis keeps JAX's replication
typing on (:func:`communicates_over`, read by :mod:`fdp.step.core._plan`).

Sharding constraints on the data axis inside the loss: refused with the fix, before tracing.
Constraints on the mesh's other axes (a tensor-parallel model pinning its
activations to ``P(None, 'model')``) are the compiler's, and pass unchanged.

fdp's step runs the loss on each device's share of the batch inside
``jax.shard_map`` over the data axes, where those axes are manual. A model that
annotates its activations the MaxText way,
``jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P('data')))``, then
fails deep in JAX's tracing (``Axes mentioned in manual_axis_type field ...
should be of type Manual``), with an error that does not say why. Inside the
step the batch is already split over the data axis, which is what such a
constraint asks for; fdp cannot drop it from the user's program, so it refuses
it up front, from the loss's traced program, naming the fix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax.extend.core as jex

from fdp import _compat as compat
from fdp.collectives._blocks import spec_axes


def _equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of its sub-programs (scan, remat, cond, jit...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from _equations(sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub)


def check_no_data_constraints(jaxpr: Any, axis_names: Sequence[str]) -> None:
    """Raises if the loss's ``jaxpr`` constrains a value's sharding over a data axis.

    Raises:
      ValueError: a ``with_sharding_constraint`` whose spec names one of ``axis_names``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices(), ("data",))  # Auto axes, as MaxText's
      >>> def loss(w, x):
      ...     h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("data")))
      ...     return h.sum()
      >>> closed = jax.make_jaxpr(loss)(jnp.ones((4, 4)), jnp.ones((8, 4)))
      >>> try:
      ...     check_no_data_constraints(closed.jaxpr, ("data",))
      ... except ValueError as err:
      ...     print(str(err)[:72])
      the loss calls jax.lax.with_sharding_constraint with a spec that names t
    """
    for eqn in _equations(jaxpr):
        if not compat.is_sharding_constraint(eqn):
            continue
        names, spec, concrete = compat.constraint_sharding(eqn)
        data = [n for n in spec_axes(spec) if n in axis_names]
        if data:
            raise ValueError(
                f"the loss calls jax.lax.with_sharding_constraint with a spec that names the "
                f"data axis {data[0]!r} ({spec}); fdp's step runs the loss on each device's "
                f"share of the batch inside jax.shard_map over {tuple(axis_names)}, where "
                "JAX refuses such a constraint ('Axes mentioned in manual_axis_type ... "
                f"should be of type Manual'). The batch is already split over {data[0]!r} "
                "there, as the constraint asks: leave the constraint out when the model "
                "runs under fdp (for example behind a flag of the model), or train it "
                "with plain jax.jit and these constraints instead of fdp's step. With "
                "Flax's logical partitioning, map the logical axis that names "
                f"{data[0]!r} to None in the rules: fdp splits over the data axis itself."
            )
        on_data_mesh = [n for n in names if n in axis_names]
        if concrete and on_data_mesh:
            raise ValueError(
                f"the loss calls jax.lax.with_sharding_constraint with a NamedSharding on a "
                f"mesh with the data axis {on_data_mesh[0]!r} (spec {spec}); inside fdp's "
                f"step that axis is manual (jax.shard_map over {tuple(axis_names)}), and "
                "JAX refuses a sharding built on the mesh as it is outside "
                "('Axes mentioned in manual_axis_type ... should be of type Manual'). Pass "
                f"the bare PartitionSpec instead, with_sharding_constraint(x, {spec}) (or "
                "Flax's nn.with_logical_constraint): JAX resolves it against the step's "
                "mesh, and it works under plain jax.jit with jax.set_mesh(mesh) too."
            )


def communicates_over(jaxpr: Any, axis_names: Sequence[str]) -> bool:
    """Whether the loss's ``jaxpr`` runs a collective over one of ``axis_names``.

    ``axis_index`` does not count: it moves no data.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def loss(w, x):
      ...     return jax.lax.pmean(((x @ w) ** 2).mean(), "data")
      >>> closed = jax.make_jaxpr(loss, axis_env=[("data", 8)])(jnp.ones(4), jnp.ones((2, 4)))
      >>> communicates_over(closed.jaxpr, ("data",)), communicates_over(closed.jaxpr, ("model",))
      (True, False)
    """
    return any(
        not compat.is_axis_index(eqn) and any(a in axis_names for a in compat.named_axes(eqn))
        for eqn in _equations(jaxpr)
    )
