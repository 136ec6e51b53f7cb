"""Replica groups read from every spelling XLA and StableHLO write them in."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import fdp

# On a 4 x 2 mesh ('batch', 'model'): the groups along 'batch', and along 'model'.
BATCH = ((0, 2, 4, 6), (1, 3, 5, 7))
MODEL = ((0, 1), (2, 3), (4, 5), (6, 7))


def _hlo(groups, op="all-reduce"):
    return (
        f"  %op.1 = f32[64]{{0}} {op}(f32[64]{{0}} %p), channel_id=1, "
        f"replica_groups={groups}, use_global_device_ids=true, to_apply=%add"
    )


def _stablehlo(groups, meshes=""):
    return (
        "module @jit_f attributes {mhlo.num_partitions = 8 : i32} {\n"
        f"{meshes}"
        "  func.func public @main(%arg0: tensor<64xf32>) -> (tensor<64xf32>) {\n"
        '    %1 = "stablehlo.all_reduce"(%arg0) <{channel_handle = '
        f"#stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = {groups}, "
        "use_global_device_ids}> ({\n"
        "    ^bb0(%a: tensor<f32>, %b: tensor<f32>):\n"
        "      %2 = stablehlo.add %a, %b : tensor<f32>\n"
        "      stablehlo.return %2 : tensor<f32>\n"
        "    }) : (tensor<64xf32>) -> tensor<64xf32>\n"
        "    return %1 : tensor<64xf32>\n"
        "  }\n"
        "}"
    )


_MESH_0 = (
    '  sdy.mesh @mesh_0 = <["batch"=4, "model"=2]> {stablehlo.mesh = {axes = [{name = "batch", '
    'size = 4 : i64}, {name = "model", size = 2 : i64}]}}\n'
)
_REVERSED = '  sdy.mesh @rev = <["batch"=4, "model"=2], device_ids=[7, 6, 5, 4, 3, 2, 1, 0]>\n'


def _axes(mesh, *refs):
    axes = ", ".join(f"#stablehlo.axis_ref<{ref}>" for ref in refs)
    return f"#stablehlo.replica_group_mesh_axes<mesh = {mesh}, axes = [{axes}]>"


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        # Compiled HLO: explicit groups, iota groups, mesh groups.
        (_hlo("{{0,2,4,6},{1,3,5,7}}"), BATCH),
        (_hlo("[4,2]<=[8]"), MODEL),
        (_hlo("[2,4]<=[4,2]T(1,0)"), BATCH),
        (_hlo("[4,2]<=[2,2,2]T(2,1,0)"), ((0, 4), (2, 6), (1, 5), (3, 7))),
        (_hlo("mesh['batch'=4,'model'=2] {'batch'}"), BATCH),
        (_hlo("mesh['batch'=4,'model'=2] {'model'}"), MODEL),
        # Several axes: the devices in the order the axes are named.
        (_hlo("mesh['batch'=4,'model'=2] {'batch','model'}"), ((0, 1, 2, 3, 4, 5, 6, 7),)),
        (_hlo("mesh['batch'=4,'model'=2] {'model','batch'}"), ((0, 2, 4, 6, 1, 3, 5, 7),)),
        # Sub-axes: the major half of 'batch' (pre-size 1), then its minor half.
        (_hlo("mesh['batch'=4,'model'=2] {'batch':(1)2}"), ((0, 4), (1, 5), (2, 6), (3, 7))),
        (_hlo("mesh['batch'=4,'model'=2] {'batch':(2)2}"), ((0, 2), (1, 3), (4, 6), (5, 7))),
        # Devices named as an iota ([2,4]T(1,0): 0,4,1,5,2,6,3,7), or one by one.
        (
            _hlo("mesh['a'=4,'b'=1,'c'=2], device_ids=([2,4]T(1,0)) {'a'}", "all-gather"),
            ((0, 1, 2, 3), (4, 5, 6, 7)),
        ),
        (
            _hlo("mesh['batch'=4,'model'=2], device_ids=(7,6,5,4,3,2,1,0) {'batch'}"),
            ((7, 5, 3, 1), (6, 4, 2, 0)),
        ),
        # StableHLO: dense groups, and mesh-axes groups of a mesh declared apart or inline.
        (_stablehlo("dense<[[0, 2, 4, 6], [1, 3, 5, 7]]> : tensor<2x4xi64>"), BATCH),
        (_stablehlo(_axes("@mesh_0", 'name = "batch"'), _MESH_0), BATCH),
        (_stablehlo(_axes("@mesh_0", 'name = "model"'), _MESH_0), MODEL),
        (
            _stablehlo(_axes("@mesh_0", 'name = "batch", sub_axis_info = (2)2'), _MESH_0),
            ((0, 2), (1, 3), (4, 6), (5, 7)),
        ),
        (_stablehlo(_axes("@rev", 'name = "batch"'), _REVERSED), ((7, 5, 3, 1), (6, 4, 2, 0))),
        (
            _stablehlo(
                _axes(
                    '#stablehlo.mesh<axes=[<name = "batch", size = 4>, <name = "model", '
                    "size = 2>]>",
                    'name = "model"',
                )
            ),
            MODEL,
        ),
    ],
    ids=[
        "hlo-explicit",
        "hlo-iota",
        "hlo-iota-transposed",
        "hlo-iota-3d-transposed",
        "hlo-mesh-batch",
        "hlo-mesh-model",
        "hlo-mesh-batch-model",
        "hlo-mesh-model-batch",
        "hlo-mesh-sub-axis-major",
        "hlo-mesh-sub-axis-minor",
        "hlo-mesh-device-ids-iota",
        "hlo-mesh-device-ids-list",
        "stablehlo-dense",
        "stablehlo-mesh-batch",
        "stablehlo-mesh-model",
        "stablehlo-mesh-sub-axis",
        "stablehlo-mesh-device-ids",
        "stablehlo-inline-mesh",
    ],
)
def test_every_spelling_reads_as_the_same_groups(text, groups):
    (op,) = fdp.collective_stats(text).ops
    assert op.groups == groups
    assert op.group_size == len(groups[0])


def test_stablehlo_mesh_axes_groups_are_kept_in_the_compiled_mesh_spelling():
    (op,) = fdp.collective_stats(_stablehlo(_axes("@mesh_0", 'name = "batch"'), _MESH_0)).ops
    assert op.replica_groups == "mesh['batch'=4,'model'=2] {'batch'}"
    assert op.sent_bytes == 2 * 3 / 4 * 64 * 4
    (op,) = fdp.collective_stats(_stablehlo(_axes("@rev", 'name = "batch"'), _REVERSED)).ops
    assert op.replica_groups == "mesh['batch'=4,'model'=2], device_ids=(7,6,5,4,3,2,1,0) {'batch'}"


def test_no_groups_is_one_group_of_all_devices_and_unknown_spellings_raise():
    (op,) = fdp.collective_stats(_hlo("{}")).ops
    assert op.groups == () and op.group_size == 1
    permute = (
        "  %cp = f32[4]{0} collective-permute(f32[4]{0} %p), source_target_pairs={{0,1},{1,0}}"
    )
    (op,) = fdp.collective_stats(permute).ops
    assert op.replica_groups == "" and op.groups == () and op.sent_bytes == 16
    with pytest.raises(ValueError, match="Cannot read replica groups"):
        _ = dataclasses.replace(op, replica_groups="somewhere[else]").groups


def test_a_psum_over_one_axis_of_a_4x2_mesh_groups_along_that_axis():
    mesh = jax.make_mesh((4, 2), ("batch", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def f(x):
        once = jax.lax.psum(x, "batch")
        looped, _ = jax.lax.scan(lambda c, y: (c + jax.lax.psum(y, "batch"), None), 0.0, x)
        return once + looped

    jitted = jax.jit(
        jax.shard_map(
            f, mesh=mesh, in_specs=P("batch"), out_specs=P(), axis_names={"batch"}, check_vma=False
        )
    )
    x = jax.device_put(jnp.ones(16), jax.NamedSharding(mesh, P("batch")))
    lowered = jitted.lower(x)
    for program in (lowered, lowered.compile()):
        ops = fdp.collective_stats(program).ops
        assert ops and all(op.kind == "all-reduce" and op.groups == BATCH for op in ops)
        assert all(op.group_size == 4 for op in ops)
    # Inside loop bodies too, where the mesh is declared outside the body.
    (op,) = fdp.loop_collectives(lowered).ops
    assert op.groups == BATCH
