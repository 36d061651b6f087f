"""Pointwise and factory rules: every strategy, run per rank on local shards, reproduces the
single-device result; pending sums pass exactly where the op is linear."""
import pytest
import torch
from rules_harness import MESH_3D, MESHES_2D, Mesh, check_op, context, ints, make_node, rand

from autopar.ir import NodeRef as R
from autopar.sharding_spec.rules import strategies_for

V = {
    "a": ints(4, 6),
    "b": ints(6),
    "c": ints(4, 1),
    "d": ints(2, 4, 6),
    "pos": ints(4, 6, lo=1, hi=6),
    "r": rand(4, 6),
    "m": ints(4, 6, lo=0, hi=2, dtype=torch.bool),
    "s": ints(4, 6, lo=0, hi=3, dtype=torch.int64),
    "f32": ints(4, 6, dtype=torch.float32),
}


def partials(strategies):
    """(input partial axes per input, output partial axes) of the strategies with any pending sum."""
    out = set()
    for s in strategies:
        ins = tuple(() if x is None else x.partial for x in s.inputs)
        o = s.output.partial if s.output is not None else ()
        if o or any(ins):
            out.add((ins, o))
    return out


@pytest.mark.parametrize(
    "target,args",
    [
        ("aten.add.Tensor", (R("a"), R("b"))),
        ("aten.add.Tensor", (R("a"), R("c"))),
        ("aten.add.Tensor", (R("d"), R("a"))),
        ("aten.sub.Tensor", (R("c"), R("a"))),
        ("aten.mul.Tensor", (R("a"), R("b"))),
        ("aten.div.Tensor", (R("a"), R("pos"))),
        ("aten.where.self", (R("m"), R("a"), R("c"))),
        ("aten.masked_fill.Scalar", (R("a"), R("m"), 0.0)),
        ("aten.eq.Tensor", (R("a"), R("c"))),
        ("aten.le.Tensor", (R("a"), R("b"))),
        ("aten.__and__.Tensor", (R("m"), R("m"))),
        ("aten.copy.default", (R("a"), R("b"))),
    ],
)
def test_binary(target, args):
    seen = check_op(target, args, values=V)
    assert any(s.family == "pointwise" for s in seen)


@pytest.mark.parametrize(
    "target,args,kwargs",
    [
        ("aten.add.Tensor", (R("a"), 2.0), {}),
        ("aten.add.Scalar", (R("a"), 2.0), {}),
        ("aten.mul.Tensor", (R("a"), 0.5), {}),
        ("aten.div.Tensor", (R("a"), 2.0), {}),
        ("aten.pow.Tensor_Scalar", (R("a"), 2), {}),
        ("aten.neg.default", (R("a"),), {}),
        ("aten.rsqrt.default", (R("pos"),), {}),
        ("aten.sqrt.default", (R("pos"),), {}),
        ("aten.log.default", (R("pos"),), {}),
        ("aten.exp.default", (R("r"),), {}),
        ("aten.gelu.default", (R("r"),), {"approximate": "tanh"}),
        ("aten.silu.default", (R("r"),), {}),
        ("aten.tanh.default", (R("r"),), {}),
        ("aten.relu.default", (R("a"),), {}),
        ("aten.sigmoid.default", (R("r"),), {}),
        ("aten.cos.default", (R("r"),), {}),
        ("aten.ne.Scalar", (R("s"), 1), {}),
        ("aten.dropout.default", (R("a"), 0.0, True), {}),
        ("aten._to_copy.default", (R("a"),), {"dtype": torch.float32}),
        ("aten._to_copy.default", (R("a"),), {"dtype": torch.int64}),
        ("aten.to.dtype", (R("a"), torch.float32), {}),
        ("aten.to.dtype_layout", (R("a"),), {"dtype": torch.float64, "layout": torch.strided, "device": torch.device("cpu")}),
        ("aten.type_as.default", (R("s"), R("a")), {}),
        ("aten.clone.default", (R("a"),), {}),
        ("aten.alias.default", (R("a"),), {}),
        ("aten.detach.default", (R("a"),), {}),
        ("aten.contiguous.default", (R("a"),), {}),
        ("aten.lift_fresh_copy.default", (R("a"),), {}),
        ("aten.masked_fill.Scalar", (R("a"), R("m"), -1.0), {}),
        ("aten._assert_tensor_metadata.default", (R("a"),), {"dtype": torch.float64}),
    ],
)
def test_unary_and_scalar(target, args, kwargs):
    check_op(target, args, kwargs, values=V)


def _linearity(target, args, kwargs=None):
    node, _ = make_node(target, args, kwargs, V)
    return partials(strategies_for(context(node, V, Mesh((2,)))))


def test_pending_sums_pass_only_where_linear():
    # add/sub: every tensor operand carries the sum together.
    assert _linearity("aten.add.Tensor", (R("a"), R("b"))) == {(((0,), (0,)), (0,))}
    # mul: exactly one operand carries it.
    assert _linearity("aten.mul.Tensor", (R("a"), R("c"))) == {(((0,), ()), (0,)), (((), (0,)), (0,))}
    # div: only the numerator.
    assert _linearity("aten.div.Tensor", (R("a"), R("pos"))) == {(((0,), ()), (0,))}
    assert _linearity("aten.where.self", (R("m"), R("a"), R("c"))) == {(((), (0,), (0,)), (0,))}
    for target, args in [
        ("aten.neg.default", (R("a"),)),
        ("aten.mul.Tensor", (R("a"), 3.0)),
        ("aten.clone.default", (R("a"),)),
        ("aten.to.dtype", (R("a"), torch.float64)),
    ]:
        assert _linearity(target, args) == {(((0,),), (0,))}, target
    assert _linearity("aten.masked_fill.Scalar", (R("a"), R("m"), 0.0)) == {(((0,), ()), (0,))}
    assert _linearity("aten._to_copy.default", (R("f32"),), {"dtype": torch.float64}) == {(((0,),), (0,))}
    # Never: a scalar added to a pending sum, dropout, non-linear ops, integer conversions, fills != 0.
    for target, args, kwargs in [
        ("aten.add.Tensor", (R("a"), 2.0), None),
        ("aten.sub.Tensor", (R("a"), 2.0), None),
        ("aten.dropout.default", (R("a"), 0.1, True), None),
        ("aten.exp.default", (R("a"),), None),
        ("aten.pow.Tensor_Scalar", (R("a"), 2), None),
        ("aten._to_copy.default", (R("a"),), {"dtype": torch.int64}),
        ("aten._to_copy.default", (R("a"),), {"dtype": torch.float32}),  # narrowing: rounding per part
        ("aten.masked_fill.Scalar", (R("a"), R("m"), 1.0), None),
        ("aten.eq.Tensor", (R("a"), R("c")), None),
    ]:
        assert _linearity(target, args, kwargs) == set(), target


def test_broadcast_dims_stay_whole():
    node, _ = make_node("aten.add.Tensor", (R("d"), R("c")), None, V)
    for s in strategies_for(context(node, V, Mesh((2, 2)))):
        assert s.inputs[1].dim_axes[1] == ()  # c's size-1 dim against 6
        assert s.inputs[1].dim_axes[0] == s.output.dim_axes[1]


def test_three_axis_mesh():
    check_op("aten.mul.Tensor", (R("d"), R("c")), values=V, meshes=[MESH_3D])
    check_op("aten.add.Tensor", (R("d"), R("a")), values=V, meshes=[MESH_3D])
    check_op("aten.gelu.default", (R("d"),), values=V, meshes=[MESH_3D])


# ---- factories ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target,args,kwargs",
    [
        ("aten.ones.default", ([4, 6],), {"dtype": torch.float64}),
        ("aten.zeros.default", ([4, 6],), {}),
        ("aten.full.default", ([4, 6], 3.0), {}),
        ("aten.empty.memory_format", ([4, 6],), {}),
        ("aten.new_ones.default", (R("a"), [4, 2]), {}),
        ("aten.new_zeros.default", (R("c"), [8]), {}),
        ("aten.new_full.default", (R("a"), [2, 2], 7.0), {}),
        ("aten.ones_like.default", (R("a"),), {}),
        ("aten.zeros_like.default", (R("a"),), {}),
        ("aten.full_like.default", (R("a"), 2.0), {}),
        ("aten.empty_like.default", (R("a"),), {}),
        ("aten.fill.Scalar", (R("a"), 5.0), {}),
    ],
)
def test_factories(target, args, kwargs):
    seen = check_op(target, args, kwargs, values=V, meshes=MESHES_2D + [MESH_3D])
    assert any(s.family == "constant" for s in seen) or target == "aten.fill.Scalar"


def test_zeros_like_passes_pending_sum_ones_like_does_not():
    assert _linearity("aten.zeros_like.default", (R("a"),)) == {(((0,),), (0,))}
    assert _linearity("aten.ones_like.default", (R("a"),)) == set()


@pytest.mark.parametrize("target,args", [("aten.arange.default", (8,)), ("aten.arange.start", (2, 10)),
                                         ("aten.scalar_tensor.default", (1.5,))])
def test_replicate_only_factories(target, args, caplog):
    node, _ = make_node(target, args, {}, V)
    with caplog.at_level("INFO", logger="autopar"):
        strategies = strategies_for(context(node, V, Mesh((2,))))
    assert [s.family for s in strategies] == ["replicate"]
    assert "no sharding rule" not in caplog.text  # they have a rule: replicated is its only answer


def test_an_op_without_a_rule_runs_replicated_and_says_so_once(caplog):
    node, _ = make_node("aten.bernoulli.p", (R("r"), 0.5), {}, V)
    with caplog.at_level("INFO", logger="autopar"):
        for _ in range(2):
            strategies = strategies_for(context(node, V, Mesh((2,))))
    assert [s.family for s in strategies] == ["replicate"]
    assert caplog.text.count("no sharding rule for aten.bernoulli.p") <= 1
