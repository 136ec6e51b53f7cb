"""The data-parallel mesh, and placing state and batches on it."""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp._extended import from_raw, impl_of, to_numpy
from fdp._validate import check_int
from fdp.collectives._axis import AxisName
from fdp.data._abstract import is_abstract, placed_like
from fdp.data._rows import leading_size
from fdp.runtime._consistency import check_consistent
from fdp.runtime._host import all_gather_object

DATA_AXIS = "data"
# Names of a host x device data mesh's axes: outer (processes/hosts), inner (devices).
HOST_AXES = ("host", "device")


def data_mesh(
    devices: Sequence[Any] | None = None,
    *,
    axis_name: AxisName = DATA_AXIS,
    axis_type: AxisType = AxisType.Auto,
    hosts: int | None = None,
) -> Mesh:
    """The data-parallel mesh over ``devices`` (default: every device of every process).

    With one axis name it is a 1-D mesh. With two, ``axis_name=(outer, inner)``
    (fdp's names are ``fdp.HOST_AXES == ("host", "device")``), it is a host x
    device mesh: the outer axis spans processes (hosts), the inner one each
    host's devices, so collectives over the inner axis stay inside a host. With
    several processes it is JAX's hybrid mesh
    (``mesh_utils.create_hybrid_device_mesh(..., process_is_granule=True)``);
    in one process ``hosts`` cuts the devices into that many groups of
    consecutive devices, which simulates hosts. Pass the same tuple as the
    step's ``axis_name`` to use both axes together as the data axis.

    The axes are ``Auto`` by default (``jax.make_mesh`` would make them
    ``Explicit``): fdp's steps work on either, but ordinary jitted code on a
    batch placed on an Explicit data axis can fail to type-check (for example
    ``nn.Embed`` raises ``ShardingTypeError``), and a DDP user's evaluation code
    should run unchanged on the batches fdp places.

    Args:
      devices: the devices, in rank order. Defaults to ``jax.devices()``.
      axis_name: the name of the data axis, or ``(outer, inner)`` for a host x
        device mesh.
      axis_type: ``jax.sharding.AxisType`` of the axes.
      hosts: size of the outer axis of a host x device mesh. Defaults to the
        number of processes.

    Returns:
      A ``jax.sharding.Mesh``.

    Raises:
      ValueError: no devices; the processes have different numbers of
        devices (each feeds an equal local batch); ``hosts`` does not divide
        the devices; or ``hosts`` is given for a 1-D mesh.

    Example:
      >>> dict(data_mesh().shape)
      {'data': 8}
      >>> dict(data_mesh(axis_name=("host", "device"), hosts=2).shape)
      {'host': 2, 'device': 4}
    """
    names = axis_names_of(axis_name)
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must name at least one device, got an empty list.")
    check_even_processes(devices, "data_mesh")
    if len(names) == 1:
        if hosts is not None:
            raise ValueError(
                f"hosts={hosts!r} needs a host x device mesh: pass axis_name=(outer, inner), "
                'for example axis_name=("host", "device").'
            )
        return jax.make_mesh((len(devices),), names, axis_types=(axis_type,), devices=devices)
    if len(names) != 2:
        raise ValueError(f"axis_name must name one axis or two (outer, inner), got {axis_name!r}.")
    return Mesh(_host_grid(devices, hosts), names, axis_types=(axis_type,) * 2)


def default_mesh(axis_name: AxisName = DATA_AXIS) -> Mesh:
    """The mesh fdp uses where none is passed: ``jax.set_mesh``'s, else :func:`data_mesh`.

    Current JAX sets a program's mesh with ``jax.set_mesh(mesh)``; code under it
    places and reshards on that mesh, and a step on another mesh would clash with
    it. So under ``jax.set_mesh`` fdp's steps, ``replicate`` and ``shard_batch``
    default to that mesh, whose axes must then include the data axis. (jax 0.10
    and 0.11 read the context mesh only outside a trace: a step first used inside
    the user's own ``jax.jit`` there takes :func:`data_mesh`; pass ``mesh=``.)

    Args:
      axis_name: the data axis (or ``(outer, inner)`` axes) the caller reduces over.

    Returns:
      The context mesh where one is set, else ``data_mesh(axis_name=axis_name)``.

    Raises:
      ValueError: the context mesh has no axis named ``axis_name``.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((4, 2), ("data", "model"))
      >>> with jax.set_mesh(mesh):
      ...     default_mesh() is mesh
      True
      >>> dict(default_mesh().shape)
      {'data': 8}
    """
    try:
        context = jax.sharding.get_mesh()
    except ValueError:  # jax 0.10 and 0.11 answer only outside a trace (0.12 inside too)
        return data_mesh(axis_name=axis_name)
    if context.empty:
        return data_mesh(axis_name=axis_name)
    try:
        check_axis(context, axis_name)
    except ValueError as e:
        raise ValueError(f"the mesh set with jax.set_mesh: {e} Or pass mesh=.") from None
    return context


def check_even_processes(devices: Any, what: str) -> None:
    """Raises unless every process holds the same number of ``devices``.

    Each process passes an equal local batch (DDP's ranks do), split over its own
    devices; with 2 devices in one process and 1 in another, JAX fails later with
    ``cannot reshape array of size 3 into shape (2,1)`` or ``non-uniform sharding``.

    Raises:
      ValueError: naming each process's device count.
    """
    counts = collections.Counter(int(d.process_index) for d in devices)
    if len(set(counts.values())) > 1:
        each = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        raise ValueError(
            f"{what}: every process must have the same number of devices (each feeds an "
            f"equal share of the batch to its own devices); got {each}. Start every "
            "process with the same devices: jax_num_cpu_devices, CUDA_VISIBLE_DEVICES, "
            "or fdp.init(local_device_ids=...)."
        )


def _host_grid(devices: list[Any], hosts: int | None) -> np.ndarray:
    """``devices`` as a [hosts, devices per host] array, one process per row when possible."""
    processes = len({d.process_index for d in devices})
    if hosts is None:
        hosts = processes
    hosts = check_int(hosts, "hosts", low=1)
    if len(devices) % hosts:
        raise ValueError(
            f"hosts={hosts} must divide the {len(devices)} devices of the mesh evenly; "
            f"got a remainder of {len(devices) % hosts}."
        )
    if processes > 1 and hosts == processes:
        per = len(devices) // hosts
        return mesh_utils.create_hybrid_device_mesh(
            (1, per), (hosts, 1), devices, process_is_granule=True
        )
    return np.array(devices, dtype=object).reshape(hosts, -1)


def axis_names_of(axis_name: AxisName) -> tuple[str, ...]:
    """The mesh axes a data axis spans: ``'data'`` -> ``('data',)``.

    Raises:
      TypeError: ``axis_name`` is neither a str nor a non-empty tuple of
        distinct strs.
    """
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if (
        not isinstance(names, tuple)
        or not names
        or not all(isinstance(n, str) for n in names)
        or len(set(names)) != len(names)
    ):
        raise TypeError(
            "axis_name must be a mesh axis name (str) or a tuple of distinct names "
            f"(outer, inner) taken together as the data axis, got {axis_name!r}."
        )
    return names


def check_axis(mesh: Mesh, axis_name: AxisName) -> int:
    """Returns the size of the data axis in ``mesh``, or raises naming the axes it has.

    A tuple ``axis_name`` names several mesh axes that together form the data
    axis (its size is their product), outer first.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``, or ``axis_name`` is
        not a name or a tuple of names.
      ValueError: the mesh has no axis called ``axis_name`` (or one of them).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    names = axis_names_of(axis_name)
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)}; pass axis_name= to name the data axis."
        )
    return math.prod(int(mesh.shape[n]) for n in names)


def _spec_axes(spec: P) -> set[str]:
    """The mesh axes a ``PartitionSpec`` names."""
    named: set[str] = set()
    for part in spec:  # None, a name, a tuple of names, or P.UNCONSTRAINED
        if isinstance(part, str):
            named.add(part)
        elif isinstance(part, tuple):
            named.update(part)
    return named


def _needs_reshard(sharding: NamedSharding) -> bool:
    """Whether ``sharding`` must be reached with ``jax.reshard`` inside ``jit``.

    On ``Explicit`` axes (``jax.make_mesh``'s default) a value's sharding is part
    of its type: ``with_sharding_constraint`` may name no such axis, and where
    it names none it only asserts the value is already laid out so. There
    ``jax.reshard`` changes the type (and moves the data). On ``Auto`` axes a
    constraint is a hint to XLA's partitioner, and ``reshard`` may not name them.
    """
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True))
    named = _spec_axes(sharding.spec)
    if named:
        return any(types[a] == AxisType.Explicit for a in named)
    return AxisType.Explicit in types.values()  # whole: undo a split on an Explicit axis


def constrain_to(tree: Any, shardings: Any) -> Any:
    """Inside ``jit``: ``tree`` laid out as ``shardings`` on Auto and Explicit axes alike.

    ``shardings`` is one ``NamedSharding`` for the whole tree, or a tree of them
    (a prefix of ``tree``). Each goes through ``jax.lax.with_sharding_constraint``
    on ``Auto`` axes and through ``jax.reshard`` on ``Explicit`` ones
    (:func:`_needs_reshard`).
    """

    def one(sharding: NamedSharding, sub: Any) -> Any:
        if _needs_reshard(sharding):
            return jax.reshard(sub, sharding)
        return jax.lax.with_sharding_constraint(sub, sharding)

    return jax.tree.map(one, shardings, tree)


def unsplit(x: Any) -> Any:
    """Inside ``jit``: ``x`` whole on every device where its type splits it, else as it is.

    On ``Explicit`` axes a value's sharding is part of its type, and JAX refuses
    to slice a split dimension to a size the axis does not divide
    (``ShardingTypeError``): such a value is gathered whole first. On ``Auto``
    axes the type splits nothing and ``x`` is returned as it is.
    """
    sharding = jax.typeof(x).sharding
    if any(part is not None for part in sharding.spec):
        return jax.reshard(x, NamedSharding(sharding.mesh, P()))
    return x


@functools.lru_cache(maxsize=32)
def _copy_to(sharding: NamedSharding) -> Any:
    return jax.jit(lambda tree: tree, out_shardings=sharding)


@functools.lru_cache(maxsize=32)
def _wrap_to(sharding: NamedSharding, impl: Any) -> Any:
    return jax.jit(lambda raw: from_raw(raw, impl), out_shardings=sharding)


def _from_host(x: np.ndarray, impl: Any, sharding: NamedSharding, make: Any) -> Any:
    """A global array made by ``make(sharding, x)``; typed keys (``impl``) wrapped again.

    Keys travel between processes as their raw data (numpy has no key dtype),
    which has one more (trailing) dimension, so ``sharding``'s spec fits it too.
    """
    raw = make(sharding, x)
    return raw if impl is None else _wrap_to(sharding, impl)(raw)


def _onto(x: Any, sharding: NamedSharding) -> Any:
    """``x`` moved onto ``sharding`` if it is a ``jax.Array`` placed anywhere else."""
    if isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(sharding, x.ndim):
        return jax.device_put(x, sharding)
    return x


def replicate(tree: Any, mesh: Mesh | None = None) -> Any:
    """Places a pytree replicated on every device of ``mesh``.

    With several processes, every process gets process 0's values (DDP's
    ``_sync_module_states``), so replicas start identical even if each process
    initialised its own. Before that, the leaves' key paths, shapes and dtypes
    are compared across processes (:func:`fdp.check_consistent`), so a
    mismatch is an error that names the leaf instead of a hang.
    Typed PRNG keys (``jax.random.key``, ``nnx.Rngs``) cross processes as
    their raw data and stay keys of the same implementation.

    Args:
      tree: parameters, optimizer state, a ``TrainState``: any pytree of arrays
        or scalars.
      mesh: the mesh (default: :func:`data_mesh`).

    Returns:
      The same pytree, each leaf a ``jax.Array`` replicated over ``mesh``. The
      leaves are copies, so donating them to a step leaves ``tree`` intact.
      A ``tree`` of ``jax.ShapeDtypeStruct`` comes back as structs with the
      replicated sharding (for lowering a step without running anything).

    Raises:
      ValueError: with several processes, ``tree`` differs across them in a
        leaf's key path, shape or dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> params = replicate({"w": jnp.ones(3)})
      >>> params["w"].sharding.is_fully_replicated
      True
    """
    mesh = default_mesh() if mesh is None else mesh
    sharding = NamedSharding(mesh, P())
    if is_abstract(tree):  # shapes only (a step lowered for another mesh): nothing to copy
        return placed_like(tree, sharding)
    if jax.process_count() == 1:
        # Leaves may sit anywhere (one device, another mesh, host memory): a jitted
        # copy rejects committed inputs on other devices, device_put moves any.
        tree = jax.tree.map(lambda x: _onto(x, sharding), tree)
        # Never alias the caller's buffers: a donating step would delete them.
        # device_put reuses a buffer already on a mesh device (even with
        # may_alias=False in jax 0.10.2); a jitted copy never does.
        return _copy_to(sharding)(tree)
    check_consistent(tree, what="state passed to fdp.replicate")
    leaves, treedef = jax.tree.flatten(tree)
    impls = [impl_of(x) for x in leaves]
    host = multihost_utils.broadcast_one_to_all([to_numpy(x) for x in leaves])

    def make(sharding: NamedSharding, x: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    placed = [_from_host(x, i, sharding, make) for x, i in zip(host, impls, strict=True)]
    return jax.tree.unflatten(treedef, placed)


def _local_data_size(mesh: Mesh, axis_name: AxisName) -> int:
    """Number of distinct positions along the data axis held by this process."""
    pos = [list(mesh.axis_names).index(n) for n in axis_names_of(axis_name)]
    me = jax.process_index()
    idx = np.argwhere(np.vectorize(lambda d: d.process_index == me)(mesh.devices))
    return len({tuple(row) for row in idx[:, pos].tolist()})


# (mesh, axis, rows) that every process was seen to pass together: checked once each.
_AGREED_ROWS: set[tuple[Mesh, AxisName, int]] = set()


def _check_rows_agree(rows: int, mesh: Mesh, axis_name: AxisName) -> None:
    """Raises unless every process passes ``rows`` rows; one exchange per new size."""
    key = (mesh, axis_name, rows)
    if key in _AGREED_ROWS:
        return
    counts = all_gather_object(rows, purpose="fdp.shard_batch's row count check")
    if len(set(counts)) > 1:
        each = ", ".join(f"process {i}: {n}" for i, n in enumerate(counts))
        raise ValueError(
            f"shard_batch: every process must pass a local batch of the same number of rows; "
            f"got {each}. The global batch would weigh the processes' examples unequally "
            "(or not line up at all). Give every process equal batches (DistributedSampler "
            "pads or drops to make them equal), or pad with fdp.pad_batch and mask."
        )
    if len(_AGREED_ROWS) >= 64:  # new sizes every call: keep memory bounded
        _AGREED_ROWS.clear()
    _AGREED_ROWS.add(key)


def shard_batch(batch: Any, mesh: Mesh | None = None, *, axis_name: AxisName = DATA_AXIS) -> Any:
    """Splits a batch along its leading axis over the data axis of ``mesh``.

    In a single process ``batch`` is the global batch. With several processes
    each passes its own local batch, as each DDP rank feeds its own, and the
    global batch is their concatenation in process order.

    Args:
      batch: a pytree of arrays, all with the same leading (batch) size.
      mesh: the mesh (default: :func:`data_mesh`).
      axis_name: the data axis of ``mesh``.

    Returns:
      The batch as global ``jax.Array`` s sharded ``P(axis_name)``.

    Raises:
      ValueError: a leaf is a scalar, leading sizes differ, the batch size
        does not divide evenly over the devices of the data axis, or (with
        several processes) the processes pass different numbers of rows. That
        is checked the first time each process passes a batch of a new size,
        with one exchange through the coordination service, so every process
        must meet a new size at the same call.

    Example:
      >>> import numpy as np
      >>> x = shard_batch(np.zeros((16, 3), np.float32))
      >>> x.shape, len(x.addressable_shards), x.addressable_shards[0].data.shape
      ((16, 3), 8, (2, 3))
    """
    mesh = default_mesh(axis_name) if mesh is None else mesh
    check_axis(mesh, axis_name)
    if jax.process_count() > 1:
        check_even_processes(mesh.devices.flat, "shard_batch")
    local_n = _local_data_size(mesh, axis_name)
    size = leading_size(batch, "shard_batch: batch")
    if size is not None and size % local_n:
        where = "" if jax.process_count() == 1 else " local to this process"
        raise ValueError(
            f"shard_batch: the batch size{where} ({size}) must be divisible by the "
            f"{local_n} devices of axis {axis_name!r}; got {size}. Use a multiple of "
            f"{local_n} (for example {size - size % local_n or local_n}), or pad it."
        )
    sharding = NamedSharding(mesh, P(axis_name))
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    if size is not None:
        _check_rows_agree(size, mesh, axis_name)
    make = jax.make_array_from_process_local_data
    return jax.tree.map(lambda x: _from_host(to_numpy(x), impl_of(x), sharding, make), batch)
