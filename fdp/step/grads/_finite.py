"""The numerics guard: ``FDP_CHECK_FINITE=1`` names the first device and step with a NaN.

One device's NaN or inf loss (a bad example, an overflow) reaches every device
through the gradient all-reduce, and from the next step every process trains
on NaN, silently. PyTorch users reach for ``torch.autograd.detect_anomaly``;
JAX has ``jax_debug_nans``, global and slow. With ``FDP_CHECK_FINITE=1`` (read
when a step is traced), each device of the step tests its own loss and
gradients before the all-reduce, the step sums one small vector of codes (one
per device) with its other metrics, and the process reads that vector after
every step: the first step where a device's code is not 0 raises
``FloatingPointError`` on every process, naming the devices and their
processes. The cost is that tiny sum and a wait for each step's result before
the next one is dispatched; off (the default), the step is the one it would be
without the guard.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from fdp.collectives import sum_over
from fdp.collectives._axis import AxisName

ENV_VAR = "FDP_CHECK_FINITE"
KEY = "fdp_nonfinite"
"""The metric the guarded step returns (removed before the metrics reach the caller)."""

_LOSS, _GRADS = 1, 2  # bits of a device's code
BLAMES_ATTR = "fdp_blames_process"
"""The attribute of an error naming the process at fault (fdp.launch._bootstrap.BLAMES_ATTR)."""


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``FDP_CHECK_FINITE`` asks for the guard (``1``/``true``/``on``/``yes``).

    Raises:
      ValueError: it holds something else than an on or off value.

    Example:
      >>> enabled({}), enabled({"FDP_CHECK_FINITE": "1"})
      (False, True)
    """
    raw = environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{ENV_VAR} must be 1 or 0 (true/false, on/off), got {raw!r}.")


def codes(loss: jax.Array, grads: Any, axis_name: AxisName, num_replicas: int) -> jax.Array:
    """Inside the step: every device's code (1: loss, 2: gradients not finite), summed.

    Called on one device's loss and gradients before they are reduced; returns
    an int32 vector of ``num_replicas`` codes, the same on every device.
    """
    leaves = [g for g in jax.tree.leaves(grads) if jnp.issubdtype(jnp.result_type(g), jnp.inexact)]
    loss_ok = jnp.all(jnp.isfinite(loss))
    grads_ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves])) if leaves else True
    code = jnp.where(loss_ok, 0, _LOSS) + jnp.where(grads_ok, 0, _GRADS)
    mine = jax.nn.one_hot(jax.lax.axis_index(axis_name), num_replicas, dtype=jnp.int32)
    return sum_over(mine * code.astype(jnp.int32), axis_name)


def _processes(mesh: Any, axis_names: tuple[str, ...]) -> list[int]:
    """The process of each position along the data axes (the first device there)."""
    names = list(mesh.axis_names)
    order = [names.index(n) for n in axis_names] + [
        i for i, n in enumerate(names) if n not in axis_names
    ]
    devices = np.transpose(mesh.devices, order)
    rows = devices.reshape(math.prod(devices.shape[: len(axis_names)]), -1)
    return [int(row[0].process_index) for row in rows]


def check(metrics: dict[str, Any], *, kind: str, call: int, config: Any) -> dict[str, Any]:
    """After a guarded step: ``metrics`` without the codes, or ``FloatingPointError``.

    Args:
      metrics: the step's metrics, holding :data:`KEY`.
      kind: the step's name, e.g. ``"fdp.train_step"``.
      call: which call of the step this was (1 for the first).
      config: the step's bound :class:`fdp.step.StepConfig` (its mesh).

    Raises:
      FloatingPointError: a device's loss or gradients were not finite; the
        message names each such device (its index on the data axis and its
        process) and the step.
    """
    metrics = dict(metrics)
    found = np.asarray(metrics.pop(KEY))  # waits for the step: the cost of the guard
    bad = np.flatnonzero(found)
    if bad.size == 0:
        return metrics
    processes = _processes(config.bound_mesh, config.axis_names)
    parts = []
    for i in bad:
        what = {_LOSS: "loss", _GRADS: "gradients", _LOSS | _GRADS: "loss and gradients"}
        parts.append(f"device {i} (process {processes[i]}): {what[int(found[i])]}")
    first = processes[int(bad[0])]
    if bad.size < found.size:
        cause = (
            "The other devices' values were finite, so the cause is in these devices' "
            "share of the batch (an example, a label) or what the model does with it."
        )
    else:
        cause = "Every device's values were non-finite: the state, a hyper-parameter or the model."
    error = FloatingPointError(
        f"{kind}: non-finite values (NaN or inf) at call {call} of this step, before the "
        f"gradient all-reduce, first on process {first}: " + "; ".join(parts) + f". {cause} "
        f"({ENV_VAR}=1 checks every step; the state this step returned holds the "
        "non-finite values.)"
    )
    # Every process raises this error; fdp launch's summary blames the process it names,
    # not the first to exit (fdp/launch/_bootstrap.py records the attribute).
    setattr(error, BLAMES_ATTR, first)
    raise error


def hyperparameters(args: Mapping[str, Any]) -> dict[str, float]:
    """The optimizer hyper-parameters a step can see: ``optax.inject_hyperparams`` state.

    A learning rate given to ``optax.sgd(lr)`` lives in a closure, out of fdp's
    sight (its program is read by :func:`nan_constants`); one given through
    ``optax.inject_hyperparams`` lives in the optimizer state, under
    ``hyperparams``. Reads those values (one small transfer, at a step's first call).

    Args:
      args: the step's arguments by name.

    Returns:
      ``{"state.opt_state.hyperparams['learning_rate']": 0.1, ...}`` for every
      scalar leaf under a ``hyperparams`` key.
    """
    out = {}
    for name, tree in args.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            names = {str(getattr(k, "name", getattr(k, "key", ""))) for k in path}
            scalar = np.ndim(leaf) == 0 and hasattr(leaf, "dtype")
            if "hyperparams" in names and scalar and jnp.issubdtype(leaf.dtype, jnp.inexact):
                out[f"{name}{jax.tree_util.keystr(path)}"] = float(np.asarray(leaf))
    return out


def check_hyperparameters(values: Mapping[str, float], *, kind: str) -> None:
    """Raises if a hyper-parameter (a learning rate, a momentum) is NaN or infinite.

    Raises:
      ValueError: naming each such hyper-parameter by its key path and value.

    Example:
      >>> check_hyperparameters({"lr": 0.1}, kind="fdp.train_step")
      >>> check_hyperparameters({"lr": float("nan")}, kind="fdp.train_step")
      Traceback (most recent call last):
      ...
      ValueError: fdp.train_step: optimizer hyper-parameters must be finite, got lr=nan; ...
    """
    bad = [f"{k}={v!r}" for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(
            f"{kind}: optimizer hyper-parameters must be finite, got {', '.join(bad)}; "
            "every update would make the parameters NaN. Pass a finite value to "
            "optax.inject_hyperparams (or set it in opt_state.hyperparams)."
        )


# Primitives whose result is NaN wherever an operand is NaN: a NaN constant there is a
# NaN setting (a learning rate, a momentum, a schedule's value) that reaches every
# update. Not select_n, broadcast_in_dim and the like, which may hold a NaN on purpose
# (optax's schedule-free optimizers fill with NaN inside a jnp.where).
_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "pow", "max", "min", "rem", "atan2"})


def nan_constants(tx: Any, opt_state: Any, params: Any) -> list[str]:
    """The primitives of ``tx.update``'s program that compute with a NaN constant.

    The optimizer's settings are closed over by its functions (``optax.sgd(lr)``
    keeps ``lr`` in a closure); traced, a setting is a constant of the program
    (a literal, or a closed-over array). ``tx.update`` is traced on the shapes of
    ``params`` (as the gradients), ``opt_state`` and ``params``, nothing computed.
    Infinite constants are not reported: ``optax.clip_by_global_norm(inf)`` (no
    clipping) multiplies by inf in a branch it never takes, so an infinite
    setting cannot be told from it by its program.

    Returns:
      e.g. ``["mul"]`` for ``optax.sgd(float("nan"))``; ``[]`` when none, or when
      ``tx.update`` cannot be traced on these shapes alone (it is then not judged).
    """
    try:
        closed = jax.make_jaxpr(tx.update)(params, opt_state, params)
    except Exception:  # an update that needs more than these: not judged
        return []
    consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    return sorted(set(_nan_uses(closed.jaxpr, consts)))


def _nan_uses(jaxpr: Any, known: dict[Any, Any]) -> Iterator[str]:
    """Primitives of ``jaxpr`` (and the jaxprs inside it) with a NaN constant operand.

    ``known`` maps variables to their constant values (closed-over arrays, and the
    constants a call passes into its jaxpr).
    """

    def value(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else known.get(v)

    def nan(v: Any) -> bool:
        array = np.asarray(value(v)) if value(v) is not None else None
        if array is None or array.size != 1 or not np.issubdtype(array.dtype, np.inexact):
            return False
        return bool(np.isnan(array).all())

    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _ARITHMETIC and any(nan(v) for v in eqn.invars):
            yield eqn.primitive.name
        for param in eqn.params.values():
            for inner in param if isinstance(param, list | tuple) else [param]:
                if isinstance(inner, jex.ClosedJaxpr):
                    inner_known = dict(zip(inner.jaxpr.constvars, inner.consts, strict=True))
                    if len(inner.jaxpr.invars) == len(eqn.invars):  # a call: the same operands
                        pairs = zip(inner.jaxpr.invars, eqn.invars, strict=True)
                        inner_known.update((i, value(o)) for i, o in pairs)
                    yield from _nan_uses(inner.jaxpr, inner_known)
                elif isinstance(inner, jex.Jaxpr):
                    yield from _nan_uses(inner, {})


def check_optimizer(tx: Any, opt_state: Any, params: Any, *, kind: str) -> None:
    """Raises if ``tx``'s update computes with a NaN setting (:func:`nan_constants`).

    Raises:
      ValueError: naming the primitives and the fix.
    """
    uses = nan_constants(tx, opt_state, params)
    if uses:
        raise ValueError(
            f"{kind}: the optimizer's update computes with a NaN constant ({', '.join(uses)}): "
            "a setting given to it (a learning rate, momentum, weight decay or schedule "
            "value) is NaN, and every update would make the parameters NaN. Pass finite "
            "values to the optimizer."
        )
