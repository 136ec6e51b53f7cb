"""Every read of JAX's and XLA's internals, in one place, failing closed.

fdp relies on a few things JAX does not promise to keep: where a value's type
records the mesh axes it varies over (and those its explicit sharding splits it
over), the primitive ``jax.grad`` sums a replicated value's gradient with, the
size of a jitted function's cache, the name of XLA:CPU's all-reduce combiner
pass, the primitives and parameter names of a few jaxpr equations, the
coordination-service client, and which experimental XLA:GPU options the installed
XLA has. Each is read here and nowhere else, and each read checks what it finds:
a JAX release that renames or moves one of them makes fdp raise
:class:`JaxCompatibilityError`, naming the JAX version, instead of silently doing
the wrong thing (for the varying axes, silently reducing gradients twice: N-fold
gradients). An experimental XLA option alone is left out with a warning instead,
since the step is right without it (:func:`known_compile_options`).

The range of JAX versions fdp is tested with is ``pyproject.toml``'s (CI runs the
oldest and the newest).
"""

from __future__ import annotations

import functools
import importlib.metadata
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as jex_primitives


class JaxCompatibilityError(RuntimeError):
    """A JAX internal fdp reads is not where, or not what, this fdp version expects."""


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _broken(what: str, detail: str) -> JaxCompatibilityError:
    return JaxCompatibilityError(
        f"fdp cannot read {what} in jax {jax.__version__} (jaxlib {_jaxlib_version()}): "
        f"{detail}. This fdp release "
        "is tested with the jax versions its pyproject.toml allows; install one of those, or "
        "report this with your jax and jaxlib versions."
    )


# -- the device-varying axes of a value (shard_map's replication typing) -----------------


def _raw_varying_axes(x: Any) -> frozenset[str] | None:
    """The varying axes recorded in ``x``'s type, or None where the field is absent."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10.2
    if manual is not None and hasattr(manual, "varying"):
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)  # jax 0.10.0 and 0.10.1
    if vma is not None:
        return frozenset(vma)
    return None


def _probe_mesh(size: int) -> jax.sharding.AbstractMesh:
    """A one-axis abstract mesh for the probes, its axis ``Auto`` on every JAX.

    ``AbstractMesh`` makes ``Auto`` axes in jax 0.10 and ``Explicit`` ones from 0.12;
    under an ``Explicit`` axis shard_map checks ``in_specs`` against the types of the
    probe's unsharded inputs and refuses them.
    """
    auto = (jax.sharding.AxisType.Auto,)
    return jax.sharding.AbstractMesh((size,), ("fdp_probe",), axis_types=auto)


def _probe_varying_axes() -> bool:
    """Whether ``axis_index`` inside a replication-checked shard_map reads as varying.

    ``axis_index`` varies over its axis by definition; if fdp cannot see that, it
    cannot see anything (a renamed field), and must not guess. It traces (1-2 ms
    on CPU) on an abstract mesh, so it starts no backend; it must not run inside
    another shard_map's trace or under ``jax.set_mesh`` (their context mesh
    refuses the probe's), which :func:`_varying_axes_readable` sees to.
    """
    mesh = _probe_mesh(1)
    seen: list[frozenset[str] | None] = []

    def probe(x: jax.Array) -> jax.Array:
        seen.append(_raw_varying_axes(jax.lax.axis_index("fdp_probe")))
        return x

    spec = jax.sharding.PartitionSpec()
    mapped = jax.shard_map(probe, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
    try:
        jax.make_jaxpr(mapped)(jax.ShapeDtypeStruct((), "float32"))
    except Exception:  # an API change breaks the probe itself: also unreadable
        return False
    return bool(seen) and seen[0] is not None and "fdp_probe" in seen[0]


@functools.cache
def _varying_axes_readable() -> bool:
    """:func:`_probe_varying_axes`, run once, at the first use rather than at import.

    The first use is inside a step's trace, so the probe runs on a thread of its
    own: JAX keeps the trace and the context mesh per thread, and a new thread
    starts with neither.
    """
    return _on_fresh_thread(_probe_varying_axes)


def _on_fresh_thread(probe: Callable[[], bool]) -> bool:
    """``probe()`` on a thread of its own (no enclosing trace or context mesh there)."""
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(probe()), name="fdp-compat-probe")
    worker.start()
    worker.join()
    return bool(result) and result[0]


def varying_axes(x: Any) -> frozenset[str]:
    """The mesh axes along which ``x`` varies, as recorded in its type.

    Raises:
      JaxCompatibilityError: this JAX records them somewhere fdp does not read.
    """
    if not _varying_axes_readable():
        raise _broken(
            "the mesh axes a value varies over",
            "neither aval.manual_axis_type.varying nor aval.vma shows that axis_index varies "
            "over its axis inside jax.shard_map(check_vma=True); fdp uses them to make "
            "gradients per-device before reducing them, and reducing without them could "
            "reduce twice",
        )
    return _raw_varying_axes(x) or frozenset()


# -- the sum that jax.grad inserts by itself (fdp.ddp's missing-reduction check) --------

AUTO_REDUCTION_PRIMITIVE = "psum_invariant"
"""The primitive ``jax.grad`` emits to sum the cotangent of a replicated value.

Inside a replication-tracking ``shard_map`` (``check_vma=True``), the gradient
of a value that is the same on every device is summed over the axis by JAX
itself, with this primitive (read from jax 0.10.2's jaxprs).
"""


def _contains_primitive(jaxpr: Any, name: str) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return True
        for sub in jex.jaxprs_in_params(eqn.params):
            inner = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
            if isinstance(inner, jex.Jaxpr) and _contains_primitive(inner, name):
                return True
    return False


def _probe_auto_reduction() -> bool:
    """Whether the gradient of a replicated value in a checked shard_map shows the primitive."""
    mesh = _probe_mesh(2)
    spec = jax.sharding.PartitionSpec

    def body(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.grad(lambda w: (w * x).sum())(w)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(spec(), spec("fdp_probe")), out_specs=spec(), check_vma=True
    )
    try:
        f32 = jax.numpy.float32
        closed = jax.make_jaxpr(mapped)(
            jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((2,), f32)
        )
    except Exception:  # an API change breaks the probe itself: also unreadable
        return False
    return _contains_primitive(closed.jaxpr, AUTO_REDUCTION_PRIMITIVE)


@functools.cache
def _auto_reduction_readable() -> bool:
    return _on_fresh_thread(_probe_auto_reduction)


def has_auto_reduction(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or one inside it) sums a replicated value's gradient by itself.

    Raises:
      JaxCompatibilityError: this JAX writes that sum with another primitive, so
        its absence from ``jaxpr`` would prove nothing.
    """
    if not _auto_reduction_readable():
        raise _broken(
            "the sum jax.grad inserts for a replicated value inside jax.shard_map",
            f"the gradient of a replicated value shows no {AUTO_REDUCTION_PRIMITIVE!r} "
            "equation; fdp.ddp looks for it to tell a step that forgot "
            "fdp.reduce_gradients (its replicas would drift apart)",
        )
    return _contains_primitive(jaxpr, AUTO_REDUCTION_PRIMITIVE)


# -- the mesh axes a value's type shards it over (explicit sharding) ------------------------


def sharded_axes(x: Any) -> tuple[str, ...] | None:
    """The mesh axes ``x``'s type shards it over (explicit axes), or None if unreadable.

    ``x`` is a value (an array or tracer) or a jaxpr variable.

    Under explicit mesh axes the sharding is part of a value's type
    (``float32[2,4@s,4]``: ``jax.typeof(x).sharding.spec``); with automatic axes
    the spec is all None. A caller that must not touch sharded values treats
    None (a JAX that keeps the sharding elsewhere) as sharded.
    """
    aval = x.aval if isinstance(x, jex.Var | jex.Literal) else jax.typeof(x)
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is None:
        return None
    axes: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        if not all(isinstance(n, str) for n in names):
            return None
        axes.extend(n for n in names if n not in axes)
    return tuple(axes)


# -- a jitted function's cache size (recompilation detection in runtime stats) -----------


def jit_cache_size(jitted: Callable[..., Any]) -> int:
    """How many compiled entries a ``jax.jit`` function holds (grows when a call compiles).

    Raises:
      JaxCompatibilityError: the jitted function has no ``_cache_size``.
    """
    size = getattr(jitted, "_cache_size", None)
    if not callable(size):
        raise _broken(
            "the size of a jitted function's cache",
            f"{type(jitted).__name__} has no _cache_size(); fdp's runtime statistics use it "
            "to leave steps that compiled out of the averages",
        )
    return int(cast(Callable[[], int], size)())


# -- XLA:CPU's collectives under a long queue of steps ---------------------------------------


def _jax_minor() -> tuple[int, int]:
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


CPU_STEPS_IN_FLIGHT = 8
"""How many multi-device CPU steps fdp lets wait in JAX's queue under jax 0.10.

XLA:CPU in jaxlib 0.10.2 aborts the process (``rendezvous.cc: Termination
timeout for all reduce ... Expected 2 threads to join the rendezvous, but only 1
of them arrived``) when a few hundred steps with collectives over several devices
of one process are dispatched without the host waiting. Measured on 2 simulated
CPU devices, 3,000 steps of a jitted all-reduce step: unbounded, 64 and 32 in
flight aborted; 16, 8 and 4 completed (0.72, 0.81 and 0.99 s). jax 0.12.0.1
completes 3,000 unbounded.
"""


def cpu_steps_in_flight() -> int | None:
    """The bound on queued multi-device CPU steps this JAX needs (None: none needed)."""
    return CPU_STEPS_IN_FLIGHT if _jax_minor() < (0, 11) else None


# -- XLA pass names -------------------------------------------------------------------------

CPU_ALL_REDUCE_COMBINER = "cpu-all-reduce-combiner"
"""XLA:CPU's pass that merges every all-reduce of a program into one.

fdp's flat layout turns it off to keep DDP's buckets apart. An unknown pass name
in ``xla_disable_hlo_passes`` is ignored by XLA rather than rejected, so its effect
is pinned by a test that counts the all-reduces of a compiled flat-layout step.
"""


def config_value(name: str) -> Any:
    """The current value of the JAX option ``name`` (``jax_cpu_collectives_implementation``)."""
    return jax.config.values[name]


def keep_all_reduces_apart() -> dict[str, str]:
    """XLA:CPU compiler options that keep each all-reduce of a program on its own."""
    return {"xla_disable_hlo_passes": CPU_ALL_REDUCE_COMBINER}


GPU_COMBINE_THRESHOLDS = {
    "all-reduce": "xla_gpu_all_reduce_combine_threshold_bytes",
    "reduce-scatter": "xla_gpu_reduce_scatter_combine_threshold_bytes",
    "all-gather": "xla_gpu_all_gather_combine_threshold_bytes",
}
"""XLA:GPU's options that cap how many bytes its combiners merge into one collective.

Set to 0 for one compilation, each collective of the program stays on its own.
An unknown option name is an error when the step compiles, so a rename fails
loudly (and the GPU compile tier's tests count the collectives).
"""


def keep_gpu_collectives_apart(kinds: tuple[str, ...]) -> dict[str, int]:
    """XLA:GPU compiler options that keep each collective of ``kinds`` on its own."""
    return {GPU_COMBINE_THRESHOLDS[k]: 0 for k in kinds}


GPU_COMBINER_KEY = "combiner_key"
"""The frontend attribute XLA:GPU's all-reduce combiner adds to its grouping key.

Two all-reduces with different values are never merged, whatever the threshold
(``AppendCombinerKeyFromFrontendAttr`` in XLA's GPU collective combiners). An
attribute XLA stops reading would let every bucket merge into one all-reduce: the
GPU compile tier counts one per bucket.
"""


def _set_xla_metadata() -> Any:
    """``jax.experimental.xla_metadata.set_xla_metadata``, failing closed."""
    try:
        from jax.experimental.xla_metadata import set_xla_metadata
    except ImportError as e:  # pragma: no cover - depends on the jax version
        raise _broken("jax.experimental.xla_metadata", str(e)) from e
    return set_xla_metadata


def combiner_key_scope(key: str) -> Any:
    """A context in which every operation traced is tagged with combiner key ``key``.

    Raises:
      JaxCompatibilityError: this jax cannot attach XLA metadata to operations.
    """
    return _set_xla_metadata()(**{GPU_COMBINER_KEY: key})


GPU_ALL_REDUCE_CONTIGUOUS = "all-reduce-contiguous"
"""XLA's pass that concatenates the operands of a merged all-reduce into one buffer.

Turned off, a merged all-reduce reduces its operands where they lie (one NCCL
group call) instead of copying them together first.
"""

# Larger than any bucket: the combiner merges every all-reduce of a key.
_GROUP_THRESHOLD_BYTES = 1 << 62


def group_gpu_all_reduces_by_key(kinds: tuple[str, ...]) -> dict[str, int | str]:
    """XLA:GPU options: all-reduces merged per :data:`GPU_COMBINER_KEY`, other ``kinds`` apart.

    Each bucket's all-reduces, tagged with the bucket's key
    (:func:`tag_combiner_key`), become one all-reduce of several operands,
    reduced in place: one collective per bucket without packing the gradients
    into a flat buffer. Untagged all-reduces (the loss, metrics) share one key,
    and merge as XLA merges them by default.
    """
    options: dict[str, int | str] = dict(keep_gpu_collectives_apart(kinds))
    options.update(group_gpu_collectives_by_key(("all-reduce",)))
    options["xla_disable_hlo_passes"] = GPU_ALL_REDUCE_CONTIGUOUS
    return options


def group_gpu_collectives_by_key(kinds: tuple[str, ...]) -> dict[str, int]:
    """XLA:GPU options: the collectives of ``kinds`` merged per :data:`GPU_COMBINER_KEY`.

    Every collective of ``kinds`` that is tagged with one key
    (:func:`combiner_key_scope`) and depends on none of the others becomes one
    collective of several operands; untagged ones share one key.
    """
    return {GPU_COMBINE_THRESHOLDS[k]: _GROUP_THRESHOLD_BYTES for k in kinds}


def tag_combiner_key(x: jax.Array, key: str) -> jax.Array:
    """``x``, its producing operation (a collective) tagged with combiner key ``key``.

    Raises:
      JaxCompatibilityError: this jax cannot attach XLA metadata to a value.
    """
    return cast(jax.Array, _set_xla_metadata()(x, **{GPU_COMBINER_KEY: key}))


XLA_KEEP_ONE_TRIP_LOOP = "skip-simplify-while-loops_trip-count-one"
"""The frontend attribute that stops XLA's while-loop simplifier inlining a one-trip loop.

Kept, the loop's body is a computation of its own whose parameters its carry is.
"""


def run_once(body: Callable[[Any], tuple[Any, Any]], init: Any) -> tuple[Any, Any]:
    """``body(init)`` in a loop of one trip that XLA keeps (a ``lax.scan`` of length 1).

    Inside, ``init`` is the loop body's parameter: XLA:GPU's matmul fusion then adds
    a product into it in place (it takes in an addition only with a parameter).
    The trip count stays known to XLA, so a GPU does not synchronize with the host.

    Args:
      body: ``carry -> (carry, out)``, one step of a scan.
      init: the carry going in.

    Returns:
      ``body``'s carry and ``out``.

    Raises:
      JaxCompatibilityError: this jax cannot attach XLA metadata to a value.
    """
    set_xla_metadata = _set_xla_metadata()
    carry, outs = jax.lax.scan(lambda c, _: body(c), init, None, length=1)
    # Tagging a value the loop computes tags the loop. Every carried value is tagged:
    # one the body passes through unchanged may not come from the loop at all.
    carry = jax.tree.map(lambda x: set_xla_metadata(x, **{XLA_KEEP_ONE_TRIP_LOOP: "true"}), carry)
    return carry, jax.tree.map(lambda y: y[0], outs)


GPU_COLLECTIVES_IN_FLIGHT = "xla_gpu_experimental_parallel_collective_overlap_limit"
"""XLA:GPU's cap on async collectives in flight at once (1 by default).

An experimental option: a release of XLA without it compiles the step without it
(see :func:`known_compile_options`).
"""


def gpu_collectives_in_flight(n: int) -> dict[str, int]:
    """XLA:GPU compiler options letting ``n`` async collectives overlap each other."""
    return {GPU_COLLECTIVES_IN_FLIGHT: n}


GPU_PIPELINED_REDUCE_SCATTER = "xla_gpu_enable_pipelined_reduce_scatter"
"""XLA:GPU's collective pipeliner for reduce-scatters in loops (on by default).

It moves a loop trip's reduce-scatter into the next trip, so it overlaps that
trip's work, and keeps the whole value it scatters (a layer's gradient) alive
across the trip boundary, with a copy. jaxlib 0.11.2's XLA has no option of this
name (seen on a lent H100); 0.12's has :data:`GPU_PIPELINE_REDUCE_SCATTER` instead,
which :func:`known_compile_options` sets in its place. A release with neither
compiles the step without it.
"""

GPU_PIPELINE_REDUCE_SCATTER = "xla_gpu_pipeline_reduce_scatter"
"""The same switch in jaxlib 0.12's XLA: an enum ``COLLECTIVE_PIPELINING_MODE_{OFF,ON,...}``."""

# An optional option a newer XLA renamed: its new name, and its value for each old value.
_RENAMED_OPTIONS: dict[str, tuple[str, dict[Any, Any]]] = {
    GPU_PIPELINED_REDUCE_SCATTER: (
        GPU_PIPELINE_REDUCE_SCATTER,
        {False: "COLLECTIVE_PIPELINING_MODE_OFF", True: "COLLECTIVE_PIPELINING_MODE_ON"},
    ),
}


def gpu_reduce_scatters_in_their_trip() -> dict[str, bool]:
    """XLA:GPU compiler options keeping each loop trip's reduce-scatters in that trip."""
    return {GPU_PIPELINED_REDUCE_SCATTER: False}


#: What each optional compile option does, for the warning when XLA lacks it.
_OPTIONAL_OPTION_EFFECTS = {
    GPU_COLLECTIVES_IN_FLIGHT: "gathers issued ahead of their use wait for each other",
    GPU_PIPELINED_REDUCE_SCATTER: (
        "a scanned stack's per-layer reduce-scatters may move into the next loop trip, "
        "keeping a layer's whole gradient alive across it"
    ),
}


def _no_such_option(error: Exception, name: str) -> bool:
    return "no such compile option" in str(error).lower() and name in str(error)


@functools.cache
def _knows_compile_option(device: Any, name: str, value: Any) -> bool:
    """Whether the compiler of ``device`` accepts option ``name`` (one tiny compile).

    Only XLA's own "No such compile option" answer means no; any other failure
    is raised, as compiling the step with the option would raise it.
    """
    x = jax.ShapeDtypeStruct((), "float32", sharding=jax.sharding.SingleDeviceSharding(device))
    try:
        jax.jit(lambda v: v + 1).lower(x).compile(compiler_options={name: value})
    except Exception as error:  # jax.errors.JaxRuntimeError, from XLA's option parser
        if _no_such_option(error, name):
            return False
        raise
    return True


def known_compile_options(device: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less the optional ones that ``device``'s XLA does not have.

    The optional ones are :data:`GPU_COLLECTIVES_IN_FLIGHT` and
    :data:`GPU_PIPELINED_REDUCE_SCATTER` (set under its new name,
    :data:`GPU_PIPELINE_REDUCE_SCATTER`, where XLA has that one). Experimental XLA
    options come and go between releases, and an unknown one makes the whole compilation fail. The
    step is still right without them, only slower or larger, so each missing
    one is left out with a ``UserWarning`` (once per process) that names it and
    what it did. Any other option is passed as given: one XLA lacks fails the
    compilation, naming it.
    """
    kept = {}
    for name, value in options.items():
        effect = _OPTIONAL_OPTION_EFFECTS.get(name)
        renamed, values = _RENAMED_OPTIONS.get(name, (None, {}))
        if effect is None or _knows_compile_option(device, name, value):
            kept[name] = value
        elif renamed is not None and _knows_compile_option(device, renamed, values[value]):
            kept[renamed] = values[value]
        else:
            _warn_missing_option(name, effect)
    return kept


@functools.cache
def _warn_missing_option(name: str, effect: str) -> None:
    warnings.warn(
        f"the XLA of jaxlib {_jaxlib_version()} has no compile option {name!r}; fdp "
        f"compiles the step without it, so {effect}. This fdp release is tested with the "
        "jax versions its pyproject.toml allows.",
        stacklevel=2,
    )


# -- jaxpr equations (parameter-usage analysis, per-use gathers, fold_dots) -----------------


def _primitive(name: str) -> Any:
    """``jax.extend.core.primitives.<name>``, failing closed."""
    primitive = getattr(jex_primitives, name, None)
    if primitive is None:
        raise _broken(
            f"the primitive {name}",
            f"jax.extend.core.primitives has no {name}; fdp's jaxpr walks compare equations "
            "with it",
        )
    return primitive


def _raw_named_axes(eqn: Any) -> tuple[str, ...]:
    named: list[str] = []
    for key in ("axes", "axis_name"):  # psum, pmax, pmin: axes; the others: axis_name
        value = eqn.params.get(key, ())
        values = value if isinstance(value, (tuple, list)) else (value,)
        named += [v for v in values if isinstance(v, str)]  # integers: positional axes
    return tuple(named)


@functools.cache
def _named_axes_readable() -> bool:
    closed = jax.make_jaxpr(
        lambda x: jax.lax.psum(x, "fdp_probe") + jax.lax.all_gather(x, "fdp_probe").sum(),
        axis_env=[("fdp_probe", 2)],
    )(1.0)
    named = [axes for axes in map(_raw_named_axes, closed.jaxpr.eqns) if axes]
    return named == [("fdp_probe",), ("fdp_probe",)]  # the psum's and the all_gather's


def named_axes(eqn: Any) -> tuple[str, ...]:
    """The mesh axes ``eqn`` names: a collective's (psum, all_gather...) or ``axis_index``'s.

    Raises:
      JaxCompatibilityError: this jax keeps a collective's axes where fdp does not
        read them (checked once, on a psum and an all_gather).
    """
    if not _named_axes_readable():
        raise _broken(
            "the axes of a collective in a jaxpr",
            "a psum or all_gather traced over an axis does not name it in its 'axes' or "
            "'axis_name' parameter; fdp reads them to find a loss that communicates",
        )
    return _raw_named_axes(eqn)


def is_axis_index(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``lax.axis_index`` (it names an axis but moves no data)."""
    return eqn.primitive is _primitive("axis_index_p")


def is_cond(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``lax.cond`` (its branches: :func:`cond_branches`)."""
    return eqn.primitive is _primitive("cond_p")


def is_all_gather(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``lax.all_gather``."""
    return eqn.primitive is _primitive("all_gather_p")


def is_scan(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``lax.scan`` (its parts: :func:`scan_parts`)."""
    return eqn.primitive is _primitive("scan_p")


def is_sharding_constraint(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``with_sharding_constraint`` (see :func:`constraint_sharding`)."""
    return eqn.primitive is _primitive("sharding_constraint_p")


def is_dot_general(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``lax.dot_general`` (a matrix product)."""
    return eqn.primitive is _primitive("dot_general_p")


class DotParams(NamedTuple):
    """The parameters of a ``dot_general`` equation that fdp reads (``lax.dot_general``'s).

    Attributes:
      contracting: ``(lhs, rhs)`` contracting dimensions.
      batch: ``(lhs, rhs)`` batch dimensions.
      precision: as given to ``lax.dot_general``.
      preferred_element_type: as given to ``lax.dot_general``.
      out_sharding: the output sharding the product was written with, or None.
    """

    contracting: tuple[tuple[int, ...], tuple[int, ...]]
    batch: tuple[tuple[int, ...], tuple[int, ...]]
    precision: Any
    preferred_element_type: Any
    out_sharding: Any


def dot_params(eqn: Any) -> DotParams:
    """The :class:`DotParams` of a ``dot_general`` equation.

    Raises:
      JaxCompatibilityError: the equation has no ``dimension_numbers`` of the
        form ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
    """
    params = eqn.params
    try:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        contracting = (tuple(lc), tuple(rc))
        batch = (tuple(lb), tuple(rb))
    except (KeyError, TypeError, ValueError):
        raise _broken(
            "the dimensions of a dot_general in a jaxpr",
            f"its params are {sorted(params)} (expected 'dimension_numbers' as "
            "((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))); fdp's fold_dots reads them",
        ) from None
    return DotParams(
        contracting,
        batch,
        params.get("precision"),
        params.get("preferred_element_type"),
        params.get("out_sharding"),
    )


def cond_branches(eqn: Any) -> list[Any]:
    """The branch jaxprs of a ``cond`` equation.

    Raises:
      JaxCompatibilityError: the equation has no ``branches`` parameter.
    """
    branches = eqn.params.get("branches")
    if not isinstance(branches, tuple | list) or not all(
        isinstance(b, jex.ClosedJaxpr) for b in branches
    ):
        raise _broken(
            "the branches of a lax.cond in a jaxpr",
            f"its 'cond' equation has params {sorted(eqn.params)} (expected 'branches', a "
            "tuple of ClosedJaxpr); fdp's find_unused_parameters reads them",
        )
    return [b.jaxpr for b in branches]


def call_body(eqn: Any) -> Any:
    """The one sub-jaxpr of a call-like equation whose inputs are the equation's, or None.

    Loops (``while``, ``scan``) carry sub-jaxprs whose inputs are not the
    equation's; they return None, and the caller treats every input as reaching
    every output (a safe over-approximation).
    """
    for sub in jex.jaxprs_in_params(eqn.params):
        sub = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
        if isinstance(sub, jex.Jaxpr) and len(sub.invars) == len(eqn.invars):
            return sub
    return None


class ScanParts(NamedTuple):
    """What a ``scan`` equation is made of: ``jax.lax.scan``'s arguments, read back.

    The equation's inputs are ``num_consts`` constants, then ``num_carry``
    carried values, then the scanned-over arrays (``xs``); the body's outputs
    are the new carry, then the per-iteration outputs (``ys``).
    """

    body: Any  # ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool


def _scan_counts(params: dict[str, Any]) -> tuple[Any, Any]:
    """``(num_consts, num_carry)`` of a scan's params, in either JAX's form (or Nones).

    jax 0.10 writes the two counts; from 0.12 the inputs' structure is a flat tree
    ``ft_in`` of three parts (constants, carry, scanned-over arrays), read with
    its ``unpack()`` and the parts' ``len()``.
    """
    if "num_consts" in params or "ft_in" not in params:
        return params.get("num_consts"), params.get("num_carry")
    try:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    except (AttributeError, TypeError, ValueError):
        return None, None


def scan_parts(eqn: Any) -> ScanParts:
    """The body and settings of a ``scan`` equation (fdp's per-layer gathers re-run it).

    Raises:
      JaxCompatibilityError: the equation's params are not the ones expected.
    """
    params = eqn.params
    body = params.get("jaxpr")
    numbers = [*_scan_counts(params), params.get("length")]
    if (
        not isinstance(body, jex.ClosedJaxpr)
        or not all(isinstance(x, int) for x in numbers)
        or not isinstance(params.get("reverse"), bool)
        or not isinstance(params.get("unroll"), int | bool)
        or len(body.jaxpr.invars) != len(eqn.invars)
        or numbers[0] + numbers[1] > len(eqn.invars)
    ):
        raise _broken(
            "a lax.scan in a jaxpr",
            f"its 'scan' equation has params {sorted(params)} (expected 'jaxpr', a ClosedJaxpr "
            "taking the equation's inputs; 'num_consts' and 'num_carry' as ints, or 'ft_in' "
            "unpacking to constants, carry and scanned-over inputs; an int 'length' and "
            "'unroll', a bool 'reverse'); fdp's per-layer gathers at ZeRO stage 3 read them",
        )
    num_consts, num_carry, length = cast(list[int], numbers)
    return ScanParts(body, num_consts, num_carry, length, params["reverse"], params["unroll"])


def constraint_sharding(eqn: Any) -> tuple[tuple[str, ...], Any, bool]:
    """The mesh axis names, the spec and the mesh's kind of a ``sharding_constraint``.

    The spec is the sharding's ``PartitionSpec``; the bool says whether its mesh
    is a concrete ``jax.sharding.Mesh`` (a ``NamedSharding`` the user built),
    not the abstract mesh a bare ``PartitionSpec`` resolves against.

    Raises:
      JaxCompatibilityError: the equation carries no sharding with a mesh.
    """
    sharding = eqn.params.get("sharding")
    names = getattr(getattr(sharding, "mesh", None), "axis_names", None)
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise _broken(
            "the sharding of a with_sharding_constraint in a jaxpr",
            f"its 'sharding_constraint' equation has params {sorted(eqn.params)} (expected "
            "'sharding', a NamedSharding with a mesh); fdp checks the loss's constraints",
        )
    spec = getattr(sharding, "spec", None)
    if not isinstance(spec, jax.sharding.PartitionSpec):
        raise _broken(
            "the spec of a with_sharding_constraint in a jaxpr",
            f"its sharding is a {type(sharding).__name__} with spec {spec!r} (expected a "
            "PartitionSpec); fdp checks the loss's constraints",
        )
    return names, spec, isinstance(sharding.mesh, jax.sharding.Mesh)


def inlinable_call(eqn: Any) -> Any | None:
    """The closed jaxpr of a ``jit`` equation that can be evaluated in place, or None.

    A nested ``jax.jit`` inside a traced function adds nothing to the enclosing
    program but a call; one without shardings, layouts, donation or compiler
    options of its own can be inlined. Anything else returns None.
    """
    if eqn.primitive.name not in ("jit", "pjit"):  # "pjit" before the rename
        return None
    params = eqn.params
    inner = params.get("jaxpr")
    if not isinstance(inner, jex.ClosedJaxpr):
        raise _broken(
            "the body of a jit equation in a jaxpr",
            f"its params are {sorted(params)} (expected 'jaxpr', a ClosedJaxpr)",
        )
    plain = (
        not any(params.get("donated_invars", ()))
        and not params.get("compiler_options_kvs")
        and all(x is None for x in (*params.get("in_layouts", ()), *params.get("out_layouts", ())))
        and all(
            type(x).__name__ == "UnspecifiedValue"
            for x in (*params.get("in_shardings", ()), *params.get("out_shardings", ()))
        )
    )
    return inner if plain else None


def bind_equation(eqn: Any, invals: list[Any]) -> list[Any]:
    """Bind a jaxpr equation's primitive to ``invals`` as tracing did (``eval_jaxpr``'s step).

    Returns:
      The equation's outputs, as a list.
    """
    params = eqn.primitive.get_bind_params(eqn.params)
    if not isinstance(params, dict):
        raise _broken(
            "how a jaxpr equation is bound again",
            f"Primitive.get_bind_params returned {type(params).__name__} (expected a dict "
            "of parameters); fdp's fold_dots evaluates jaxprs with it",
        )
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None) if ctx is not None else None
    if manager is None:
        raise _broken("a jaxpr equation's context", "the equation has no ctx.manager")
    with manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# -- the coordination-service client (host collectives and the store) ---------------------

# The client methods fdp calls (names and signatures read from jaxlib 0.10.2).
_CLIENT_METHODS = (
    "key_value_set_bytes",
    "key_value_try_get_bytes",
    "blocking_key_value_get_bytes",
    "key_value_dir_get_bytes",
    "key_value_delete",
    "key_value_increment",
    "wait_at_barrier",
)


def coordination_client() -> Any | None:
    """The coordination-service client of this process, or ``None`` before ``fdp.init``.

    ``jax.distributed.initialize`` starts a coordination service (on process 0)
    and connects a client to it from every process. The client carries a
    key-value store and named barriers with timeouts, what host collectives
    need; JAX and Orbax use it the same way
    (``multihost_utils.live_devices``, ``orbax.checkpoint.multihost``). JAX
    exposes no public handle on it, so it is reached through ``jax._src`` here,
    and nowhere else.

    Returns:
      The ``jaxlib`` ``DistributedRuntimeClient``, or ``None`` when
      ``jax.distributed`` is not initialised (a single process).

    Raises:
      JaxCompatibilityError: ``jax.distributed`` is initialised but the client
        is not where, or not what, this version of fdp expects.
    """
    if not jax.distributed.is_initialized():
        return None
    from jax._src import distributed  # no public API exists (see above)

    client = getattr(getattr(distributed, "global_state", None), "client", None)
    missing = [m for m in _CLIENT_METHODS if not hasattr(client, m)]
    if client is None or missing:
        raise _broken(
            "the coordination-service client",
            f"missing {missing or 'the client itself'}; fdp's host collectives and Store use it",
        )
    return client


# -- the CUDA plugin, for compiling without a GPU -------------------------------------------

CUDA_PLUGIN_MODULE = "jax_plugins.xla_cuda12"


def register_cuda_plugin() -> None:
    """Registers the CUDA PJRT plugin after JAX's backends have started.

    JAX finds plugins once, when its first backend starts, by importing each
    ``jax_plugins.*`` module and calling its ``initialize()`` (the plugin
    protocol). fdp keeps the plugin out of site-packages (it prints errors in
    every JAX process of a machine without CUDA), so it calls that protocol
    itself, later, for the compile-only topology.

    Raises:
      JaxCompatibilityError: the plugin module has no ``initialize``.
    """
    import importlib

    module = importlib.import_module(CUDA_PLUGIN_MODULE)
    initialize = getattr(module, "initialize", None)
    if not callable(initialize):
        raise _broken("the CUDA plugin", f"{CUDA_PLUGIN_MODULE} has no initialize()")
    initialize()
