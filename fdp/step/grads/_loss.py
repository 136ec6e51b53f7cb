"""The loss contract: what a loss function returns, and fdp's errors when it does not."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fdp.step.options._config import StepConfig


def _token_loss(loss: Any) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, weight)`` as two float32 scalars, or the contract's error."""
    pair = isinstance(loss, tuple | list) and len(loss) == 2
    if pair and all(
        jnp.shape(x) == () and jnp.issubdtype(jnp.result_type(x), jnp.number) for x in loss
    ):
        loss_sum, weight = loss
        return jnp.asarray(loss_sum, jnp.float32), jnp.asarray(weight, jnp.float32)
    raise TypeError(
        "loss_fn must return (loss_sum, weight) with loss=fdp.Loss(normalize='tokens'): the "
        "sum of its per-token losses and their number (two scalars; the step divides by "
        f"the global weight); got {_describe(loss)}."
    )


def check_loss_fn(loss_fn: Any) -> Any:
    """``loss_fn`` if it is callable.

    Raises:
      TypeError: it is not.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
    return loss_fn


def call_loss(
    loss_fn: Any, cfg: StepConfig, has_buffers: bool, *args: Any
) -> tuple[jax.Array | tuple[jax.Array, jax.Array], Any, Any]:
    """Calls the user's loss and splits its result into ``(loss, aux, new_buffers)``.

    ``loss_fn`` returns ``loss``, ``(loss, aux)`` (``has_aux``), ``(loss,
    new_buffers)`` (with buffers) or ``(loss, (aux, new_buffers))`` (both).
    ``loss`` is a float scalar, one value per example with ``per_example``, or
    ``(loss_sum, weight)``, two float scalars, with ``normalize='tokens'``
    (returned as they are, a tuple).

    Raises:
      TypeError: the result does not have the expected structure, shape or dtype.
    """
    out = loss_fn(*args)
    aux = buffers = None
    if cfg.has_aux or has_buffers:
        both = cfg.has_aux and has_buffers
        shape = (
            "(loss, (aux, new_batch_stats))"
            if both
            else ("(loss, aux)" if cfg.has_aux else "(loss, new_batch_stats)")
        )
        why = " and ".join(
            ([" has_aux=True"] if cfg.has_aux else [])
            + ([" the state has batch_stats"] if has_buffers else [])
        ).strip()
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"loss_fn must return {shape} since{' ' + why}; got {_describe(out)}.")
        loss, rest = out
        if both:
            if not (isinstance(rest, tuple) and len(rest) == 2):
                raise TypeError(
                    f"loss_fn must return {shape} since {why}; got (loss, {_describe(rest)})."
                )
            aux, buffers = rest
        elif cfg.has_aux:
            aux = rest
        else:
            buffers = rest
    else:
        loss = out
    if cfg.loss.normalize == "tokens":
        return _token_loss(loss), aux, buffers
    _check_is_array(loss, cfg, has_buffers)
    batch_size = jnp.shape(jax.tree.leaves(args[1])[0])[0] if len(args) > 1 else None
    want = (batch_size,) if cfg.per_example else ()
    if jnp.shape(loss) != want or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        if cfg.per_example:
            raise TypeError(
                "loss_fn must return one float loss per example of the local batch "
                f"(per_example=True): float[{batch_size}]; got "
                f"{jnp.result_type(loss)}{list(jnp.shape(loss))}."
            )
        raise TypeError(
            "loss_fn must return the mean loss over the local batch as a float scalar; got "
            f"{jnp.result_type(loss)}{list(jnp.shape(loss))}. Reduce it with .mean()"
            + ("" if cfg.has_aux else ", or pass has_aux=True if it returns (loss, aux)")
            + (", or per_example=True for one loss per example." if jnp.ndim(loss) == 1 else ".")
        )
    return loss, aux, buffers


def _check_is_array(loss: Any, cfg: StepConfig, has_buffers: bool) -> None:
    """Raises fdp's message when the loss is not an array (before ``jnp.shape`` would)."""
    if (hasattr(loss, "shape") and hasattr(loss, "dtype")) or isinstance(loss, float | int):
        return
    if isinstance(loss, tuple | list) and not cfg.has_aux and not has_buffers:
        raise TypeError(
            f"loss_fn returned a {type(loss).__name__} of {len(loss)} "
            f"({', '.join(_describe(x) for x in loss)}), but has_aux=False, so the step "
            "expects the loss alone. If it returns (loss, aux), pass has_aux=True to the "
            "step (aux values then come back in metrics['aux']); otherwise return only the "
            "mean loss."
        )
    raise TypeError(
        "loss_fn must return the mean loss over the local batch as a float scalar array "
        f"where it returns the loss; got {_describe(loss)}"
        + (
            ". With has_aux=True the result is (loss, aux): is the tuple nested one level too deep?"
            if isinstance(loss, tuple | list)
            else "."
        )
    )


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array {jnp.result_type(x)}{list(jnp.shape(x))}"
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    return type(x).__name__
