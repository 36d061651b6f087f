"""Reduction, scan, softmax and norm rules, checked numerically per rank."""
import pytest
import torch
from rules_harness import MESH_3D, Mesh, check_op, context, ints, make_node, rand

from autopar.ir import NodeRef as R
from autopar.sharding_spec.rules import strategies_for

V = {"a": ints(4, 6, 8), "r": rand(4, 6, 8), "m": ints(4, 6, 8, lo=0, hi=2, dtype=torch.bool),
     "w": rand(8), "b": rand(8), "w2": rand(6, 8)}


@pytest.mark.parametrize(
    "target,args,kwargs",
    [
        ("aten.sum.dim_IntList", (R("a"), [1]), {}),
        ("aten.sum.dim_IntList", (R("a"), [0, 2], True), {}),
        ("aten.sum.default", (R("a"),), {}),
        ("aten.sum.dim_IntList", (R("m"), [1]), {}),
        ("aten.mean.dim", (R("a"), [-1], True), {}),
        ("aten.mean.default", (R("a"),), {}),
        ("aten.amax.default", (R("a"), [1]), {}),
        ("aten.amin.default", (R("a"), [0, 1], True), {}),
        ("aten.max.dim", (R("a"), 2), {}),
        ("aten.max.default", (R("a"),), {}),
        ("aten.argmax.default", (R("r"), 1), {}),
        ("aten.var.correction", (R("r"), [2]), {"correction": 1, "keepdim": True}),
        ("aten.var_mean.correction", (R("r"), [1]), {"correction": 0}),
        ("aten.logsumexp.default", (R("r"), [2]), {}),
        ("aten.any.dim", (R("m"), 1), {}),
        ("aten.cumsum.default", (R("a"), 1), {}),
        ("aten.cumsum.default", (R("m"), -1), {}),
    ],
)
def test_reductions(target, args, kwargs):
    whole = target == "aten.max.default"  # max over every dim: nothing may be split
    check_op(target, args, kwargs, values=V, min_strategies=1 if whole else 2)


def _families(target, args, kwargs=None, mesh=Mesh((2,))):
    node, _ = make_node(target, args, kwargs, V)
    return {(tuple(s.inputs[0].dim_axes), s.family) for s in strategies_for(context(node, V, mesh))}


def test_only_sum_and_mean_split_a_reduced_dim():
    fam = _families("aten.sum.dim_IntList", (R("a"), [1]))
    assert (((), (0,), ()), "reduce-partial") in fam
    # mean splits it only as the lowered family (codegen divides the local sum by the global count)
    mean = _families("aten.mean.dim", (R("a"), [1]))
    assert (((), (0,), ()), "reduce-partial(mean)") in mean
    assert all(f == "reduce-partial(mean)" for dims, f in mean if dims[1])
    for target, args in [("aten.amax.default", (R("a"), [1])),
                         ("aten.var.correction", (R("r"), [1])), ("aten.cumsum.default", (R("a"), 1))]:
        assert all(dims[1] == () for dims, _ in _families(target, args)), target


def test_reductions_three_axis_mesh():
    check_op("aten.sum.dim_IntList", (R("a"), [1, 2]), values=V, meshes=[MESH_3D])
    check_op("aten.mean.dim", (R("a"), [0], True), values=V, meshes=[MESH_3D])


@pytest.mark.parametrize(
    "target,args",
    [
        ("aten._softmax.default", (R("r"), -1, False)),
        ("aten.softmax.int", (R("r"), 1)),
        ("aten._log_softmax.default", (R("r"), 0, False)),
        ("aten.log_softmax.int", (R("r"), -1)),
        ("aten._safe_softmax.default", (R("r"), -1)),
        ("aten.layer_norm.default", (R("r"), [8], R("w"), R("b"), 1e-5)),
        ("aten.layer_norm.default", (R("r"), [6, 8], R("w2"))),
        ("aten.native_layer_norm.default", (R("r"), [8], R("w"), R("b"), 1e-5)),
        ("aten.rms_norm.default", (R("r"), [8], R("w"), 1e-5)),
    ],
)
def test_softmax_and_norms(target, args):
    seen = check_op(target, args, values=V)
    for s in seen:  # the normalized dims stay whole; weights are read whole
        x = s.inputs[0]
        dim = args[1] if "softmax" in target else None
        whole = [dim % 3] if dim is not None else list(range(3 - len(args[1]), 3))
        assert all(x.dim_axes[d] == () for d in whole), str(s)
        assert all(i is None or i.is_replicated for i in s.inputs[1:]), str(s)


def test_norm_three_axis_mesh():
    check_op("aten.layer_norm.default", (R("r"), [8], R("w"), R("b"), 1e-5), values=V, meshes=[MESH_3D])


# ---- ops along one dim kept whole: a router's topk, sort, argsort, one_hot ---------------------------
def test_topk_sort_and_one_hot_split_every_other_dim():
    vals = {"x": rand(4, 6, 8), "i": ints(4, 6, lo=0, hi=5, dtype=torch.int64)}
    for target, args, kwargs, dim in (  # dim: the one the op works along (None: one_hot's new class dim)
        ("aten.topk.default", (R("x"), 2), {}, -1),
        ("aten.topk.default", (R("x"), 3, 1), {}, 1),
        ("aten.topk.default", (R("x"), 2, -1, False), {}, -1),
        ("aten.sort.default", (R("x"),), {}, -1),
        ("aten.sort.default", (R("x"), 0, True), {}, 0),
        ("aten.argsort.default", (R("x"),), {"dim": 1}, 1),
        ("aten.one_hot.default", (R("i"), 5), {}, None),
    ):
        seen = check_op(target, args, kwargs, values=vals, meshes=[Mesh((2,)), Mesh((2, 2)), MESH_3D])
        assert {s.family for s in seen} == {"select", "replicate"}, target
        if dim is not None:
            assert all(not s.inputs[0].dim_axes[dim] for s in seen), target
