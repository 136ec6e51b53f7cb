"""The data-parallel mesh, and placing state and batches on it."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fdp.data._rows import leading_size
from fdp.runtime._consistency import check_consistent
from fdp.runtime._host import all_gather_object

DATA_AXIS = "data"


def data_mesh(
    devices: Sequence[Any] | None = None,
    *,
    axis_name: str = DATA_AXIS,
    axis_type: AxisType = AxisType.Auto,
) -> Mesh:
    """A 1-D mesh over ``devices`` (default: every device of every process).

    The axis is ``Auto`` by default (``jax.make_mesh`` would make it
    ``Explicit``): fdp's steps work on either, but ordinary jitted code on a
    batch placed on an Explicit data axis can fail to type-check (for example
    ``nn.Embed`` raises ``ShardingTypeError``), and a DDP user's evaluation code
    should run unchanged on the batches fdp places.

    Args:
      devices: the devices, in rank order. Defaults to ``jax.devices()``.
      axis_name: the name of the data axis.
      axis_type: ``jax.sharding.AxisType`` of the axis.

    Returns:
      A ``jax.sharding.Mesh`` with one axis named ``axis_name``.

    Example:
      >>> mesh = data_mesh()
      >>> dict(mesh.shape)
      {'data': 8}
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must name at least one device, got an empty list.")
    return jax.make_mesh((len(devices),), (axis_name,), axis_types=(axis_type,), devices=devices)


def check_axis(mesh: Mesh, axis_name: str) -> int:
    """Returns the size of ``axis_name`` in ``mesh``, or raises naming the axes it has.

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: the mesh has no axis called ``axis_name``.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name not in mesh.shape:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)}; pass axis_name= to name the data axis."
        )
    return int(mesh.shape[axis_name])


@functools.lru_cache(maxsize=32)
def _copy_to(sharding: NamedSharding) -> Any:
    return jax.jit(lambda tree: tree, out_shardings=sharding)


def _as_numpy(x: Any) -> np.ndarray:
    return np.asarray(x)


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

    Args:
      tree: parameters, optimizer state, a ``TrainState``: any pytree of arrays
        or scalars.
      mesh: the mesh (default: :func:`data_mesh`).

    Returns:
      The same pytree, each leaf a ``jax.Array`` replicated over ``mesh``. The
      leaves are copies, so donating them to a step leaves ``tree`` intact.

    Raises:
      ValueError: with several processes, ``tree`` differs across them in a
        leaf's key path, shape or dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> params = replicate({"w": jnp.ones(3)})
      >>> params["w"].sharding.is_fully_replicated
      True
    """
    mesh = data_mesh() if mesh is None else mesh
    sharding = NamedSharding(mesh, P())
    if jax.process_count() == 1:
        # Leaves may sit anywhere (one device, another mesh, host memory): a jitted
        # copy rejects committed inputs on other devices, device_put moves any.
        tree = jax.tree.map(lambda x: _onto(x, sharding), tree)
        # Never alias the caller's buffers: a donating step would delete them.
        # device_put reuses a buffer already on a mesh device (even with
        # may_alias=False in jax 0.10.2); a jitted copy never does.
        return _copy_to(sharding)(tree)
    check_consistent(tree, what="state passed to fdp.replicate")
    tree = multihost_utils.broadcast_one_to_all(jax.tree.map(_as_numpy, tree))
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx]), tree
    )


def _local_data_size(mesh: Mesh, axis_name: str) -> int:
    """Number of distinct positions along the data axis held by this process."""
    pos = list(mesh.axis_names).index(axis_name)
    me = jax.process_index()
    idx = np.argwhere(np.vectorize(lambda d: d.process_index == me)(mesh.devices))
    return len(set(idx[:, pos].tolist()))


# (mesh, axis, rows) that every process was seen to pass together: checked once each.
_AGREED_ROWS: set[tuple[Mesh, str, int]] = set()


def _check_rows_agree(rows: int, mesh: Mesh, axis_name: str) -> None:
    """Raises unless every process passes ``rows`` rows; one exchange per new size."""
    key = (mesh, axis_name, rows)
    if key in _AGREED_ROWS:
        return
    counts = all_gather_object(rows)
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


def shard_batch(batch: Any, mesh: Mesh | None = None, *, axis_name: str = DATA_AXIS) -> Any:
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
    mesh = data_mesh() if mesh is None else mesh
    check_axis(mesh, axis_name)
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
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, _as_numpy(x)), batch
    )
