"""Shape-op and indexing rules, checked numerically per rank (with size arguments rewritten to
local sizes the way codegen does)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rules_harness import MESH_3D, Mesh, check_op, context, ints, make_node

from autopar.ir import NodeRef as R
from autopar.sharding_spec import ShardingSpec
from autopar.sharding_spec.rules.view import reshape_spec, view_groups
from autopar.sharding_spec.rules import strategies_for

V = {
    "a": ints(4, 6),
    "x": ints(4, 6, 8),
    "y": ints(4, 1, 6),
    "z": ints(2, 1, 6),
    "q": ints(2, 4, 8, 4),
    "i2": ints(2, 16, lo=0, hi=16, dtype=torch.int64),
    "ia": ints(2, 1, 1, 1, lo=0, hi=2, dtype=torch.int64),
    "ib": ints(1, 1, 8, 1, lo=0, hi=16, dtype=torch.int64),
    "ic": ints(1, 1, 1, 8, lo=0, hi=16, dtype=torch.int64),
    "iq": ints(1, 1, 8, 1, lo=0, hi=8, dtype=torch.int64),
    "sel": ints(6, lo=0, hi=4, dtype=torch.int64),
    "gi": ints(4, 3, 8, lo=0, hi=6, dtype=torch.int64),
    "pre": ints(4, 1, 8),
    "m": ints(4, 8, 8),
}
V["parts"] = tuple(torch.split(V["x"], 2, dim=2))


@pytest.mark.parametrize(
    "target,args",
    [
        ("aten.view.default", (R("x"), [24, 8])),
        ("aten.view.default", (R("x"), [4, 48])),
        ("aten.view.default", (R("x"), [2, 2, 6, 8])),
        ("aten.view.default", (R("x"), [4, 6, 2, 4])),
        ("aten.view.default", (R("x"), [8, 3, -1])),
        ("aten.view.default", (R("y"), [4, 6])),
        ("aten._unsafe_view.default", (R("x"), [4, 2, 24])),
        ("aten.reshape.default", (R("x"), [-1])),
        ("aten.flatten.using_ints", (R("x"), 0, 1)),
        ("aten.unflatten.int", (R("x"), 2, [2, 4])),
        ("aten.permute.default", (R("x"), [2, 0, 1])),
        ("aten.transpose.int", (R("x"), 1, 2)),
        ("aten.t.default", (R("a"),)),
        ("aten.expand.default", (R("y"), [4, 4, 6])),
        ("aten.expand.default", (R("y"), [2, 4, -1, 6])),
        ("aten.unsqueeze.default", (R("x"), 1)),
        ("aten.unsqueeze.default", (R("x"), -1)),
        ("aten.squeeze.dim", (R("y"), 1)),
        ("aten.squeeze.default", (R("z"),)),
        ("aten.squeeze.dims", (R("z"), [0, 1])),
        ("aten.slice.Tensor", (R("x"), 2, 0, 4)),
        ("aten.slice.Tensor", (R("x"), 1, 0, 9223372036854775807)),
        ("aten.slice.Tensor", (R("x"), 0, 1, None, 2)),
        ("aten.narrow.default", (R("x"), 2, 2, 4)),
        ("aten.narrow.default", (R("x"), 1, 0, 6)),
        ("aten.select.int", (R("x"), 1, 3)),
        ("aten.split.Tensor", (R("x"), 2, 2)),
        ("aten.split_with_sizes.default", (R("x"), [2, 4], 1)),
        ("aten.chunk.default", (R("x"), 2, -1)),
        ("aten.unbind.int", (R("x"), 1)),
        ("operator.getitem", (R("parts"), 1)),
        ("aten.cat.default", ([R("x"), R("x")], -1)),
        ("aten.cat.default", ([R("x"), R("pre")], 1)),
        ("aten.stack.default", ([R("x"), R("x")], 1)),
        ("aten.broadcast_tensors.default", ([R("x"), R("pre")],)),
    ],
)
def test_views(target, args):
    check_op(target, args, values=V)


def test_views_three_axis_mesh():
    check_op("aten.view.default", (R("x"), [8, 3, 8]), values=V, meshes=[MESH_3D])
    check_op("aten.permute.default", (R("q"), [0, 2, 1, 3]), values=V, meshes=[MESH_3D])
    check_op("aten.expand.default", (R("y"), [4, 4, 6]), values=V, meshes=[MESH_3D])


def test_view_groups():
    assert view_groups((4, 6, 8), (24, 8)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((2, 1, 3), (2, 3)) == [([0], [0]), ([1, 2], [1])]
    assert view_groups((6, 4), (4, 6)) == [([0, 1], [0, 1])]


def test_reshape_keeps_only_major_splits():
    mesh = Mesh((2, 2))
    s = ShardingSpec.parse("[S0, R, R]", (4, 6, 8), 2)
    assert reshape_spec(s, (24, 8), mesh).notation() == "[S0, R]"
    assert reshape_spec(ShardingSpec.parse("[R, S0, R]", (4, 6, 8), 2), (24, 8), mesh) is None  # minor of a merge
    assert reshape_spec(ShardingSpec.parse("[S01, R, R]", (4, 6, 8), 2), (2, 2, 48), mesh) is None  # 2 % 4
    assert reshape_spec(ShardingSpec.parse("[R, R, S0 | P1]", (4, 6, 8), 2), (4, 6, 2, 4), mesh).notation() == "[R, R, S0, R | P1]"


def test_sliced_and_split_dims_stay_whole():
    mesh = Mesh((2,))
    for target, args, dim in [("aten.slice.Tensor", (R("x"), 2, 0, 4), 2), ("aten.select.int", (R("x"), 1, 3), 1),
                              ("aten.split.Tensor", (R("x"), 2, 2), 2), ("aten.cat.default", ([R("x"), R("x")], 0), 0)]:
        node, _ = make_node(target, args, None, V)
        for s in strategies_for(context(node, V, mesh)):
            assert s.inputs[0].dim_axes[dim] == (), f"{target}: {s}"


def test_squeeze_never_drops_a_split_dim_locally():
    # z is (2, 1, 6): split over 2 ranks its dim 0 has local size 1, which a local squeeze() would drop.
    node, _ = make_node("aten.squeeze.default", (R("z"),), None, V)
    for s in strategies_for(context(node, V, Mesh((2,)))):
        assert s.inputs[0].dim_axes[0] == (), str(s)


# ---- indexing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target,args",
    [
        ("aten.index.Tensor", (R("i2"), [R("ia"), R("ib")])),  # the transformers causal-mask pattern
        ("aten.index.Tensor", (R("i2"), [R("ia"), R("ic")])),
        ("aten.index.Tensor", (R("x"), [None, R("sel")])),
        ("aten.index.Tensor", (R("q"), [R("ia"), None, R("iq")])),  # non-adjacent: broadcast dims first
        ("aten.index_select.default", (R("x"), 1, R("sel"))),
        ("aten.gather.default", (R("x"), 1, R("gi"))),
        ("aten.tril.default", (R("m"),)),
        ("aten.triu.default", (R("m"), 1)),
        ("aten.pad.default", (R("i2"), [0, 1], "constant", -100.0)),
        ("aten.pad.default", (R("x"), [1, 1])),
        ("aten.constant_pad_nd.default", (R("x"), [0, 0, 2, 0])),
        ("aten.diff.default", (R("x"), 1, 1, R("pre"))),
        ("aten.diff.default", (R("i2"), 1, 1)),
    ],
)
def test_index_ops(target, args):
    check_op(target, args, values=V)


def test_index_three_axis_mesh():
    check_op("aten.index.Tensor", (R("q"), [R("ia"), None, R("iq")]), values=V, meshes=[MESH_3D])


# ---- random reshapes ------------------------------------------------------------------------------
@st.composite
def reshapes(draw):
    """Two shapes of the same numel built from one list of prime factors, grouped differently."""
    factors = draw(st.lists(st.sampled_from([1, 2, 2, 3, 4]), min_size=1, max_size=5))

    def group(fs):
        cuts = sorted(draw(st.sets(st.integers(1, max(len(fs) - 1, 1)), max_size=len(fs) - 1))) if len(fs) > 1 else []
        out, prev = [], 0
        for c in cuts + [len(fs)]:
            out.append(int(torch.tensor(fs[prev:c] or [1]).prod()))
            prev = c
        return out

    perm = draw(st.permutations(factors)) if draw(st.booleans()) else factors
    return group(list(factors)), group(list(perm))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(reshapes(), st.sampled_from([(2,), (4,), (2, 2)]))
def test_random_reshapes_are_exact(shapes, mesh_shape):
    a, b = shapes
    if a == [] or torch.Size(a).numel() != torch.Size(b).numel():
        return
    values = {"x": ints(*a)}
    check_op("aten.reshape.default", (R("x"), b), values=values, meshes=[Mesh(mesh_shape)], min_strategies=1)
