"""Writes into tensors: the scatter family's rules and every in-place op's strategies (taken from
its functional twin), run per rank on local shards against one device. An in-place strategy must
write into the very shard it reads (the output *is* the destination), or the write is lost."""
import pytest
import torch
from rules_harness import MESH_3D, MESHES_2D, assert_shards, check_op, context, ints, make_node, run

from autopar.ir import NodeRef as R
from autopar.sharding_spec import simulator
from autopar.sharding_spec.rules import has_rule, strategies_for
from autopar.sharding_spec.strategy import functional_twin

V = {
    "a": ints(4, 6),
    "a2": ints(4, 6, seed=1),
    "b": ints(6),
    "z": torch.zeros(4, 6, dtype=torch.float64),
    "m": ints(4, 6, lo=0, hi=2, dtype=torch.bool),
    "col": ints(4, 5),
    "row": ints(6),
    "idx": torch.tensor([[0, 2, 1, 5, 3, 4]] * 4),          # scatter index along dim 1, a permutation per row
    "idx0": torch.tensor([1, 3]),                             # rows
    "vals": ints(2, 6),
    "src3": ints(4, 3),
    "pos3": torch.tensor([[0, 2, 5]] * 4),
    "d": ints(4, 6, 8),
    "dv": ints(8),
}


def fresh():
    return {k: v.clone() for k, v in V.items()}


def check_in_place(target, args, kwargs=None, meshes=MESHES_2D, min_split=1):
    """Every strategy of an in-place op: shards written in place, equal to the one-device result."""
    node, expected = make_node(target, args, kwargs, fresh())
    split = 0
    for mesh in meshes:
        strategies = strategies_for(context(node, V, mesh))
        for s in strategies:
            assert s.inputs[0] == s.output, f"{target} {s}: writes in another spec than it reads"
            shards = [simulator.shard(V[n].clone(), spec, mesh) if spec is not None else {r: V[n].clone() for r in range(mesh.size)}
                      for n, spec in zip(node.inputs, s.inputs)]
            local = {}
            for r in range(mesh.size):
                mine = [sh[r] for sh in shards]
                local[r] = run(target, args, kwargs or {}, mine)
                assert local[r].data_ptr() == mine[0].data_ptr(), f"{target} {s}: rank {r} did not write in place"
            assert_shards(local, s.output, expected, mesh, what=f"{target} {s} on {mesh}")
            split += not s.output.is_replicated
    assert split >= min_split, f"{target}: no split strategy"


@pytest.mark.parametrize("target,args", [
    ("aten.copy_.default", (R("z"), R("a"))),
    ("aten.copy_.default", (R("z"), R("b"))),
    ("aten.fill_.Scalar", (R("a"), 3.0)),
    ("aten.masked_fill_.Scalar", (R("a"), R("m"), 0.0)),
    ("aten.add_.Tensor", (R("a"), R("b"))),
    ("aten.mul_.Scalar", (R("a"), 2.0)),
    ("aten.relu_.default", (R("a"),)),
    ("aten.clamp_.default", (R("a"), -1.0, 1.0)),
    ("aten.scatter_.src", (R("a"), 1, R("idx"), R("a2"))),
    ("aten.scatter_.value", (R("z"), 1, R("pos3"), 1.0)),
    ("aten.scatter_add_.default", (R("z"), 1, R("pos3"), R("src3"))),
    ("aten.index_put_.default", (R("z"), [R("idx0")], R("vals"))),
    ("aten.index_add_.default", (R("z"), 0, R("idx0"), R("vals"))),
    ("aten.index_fill_.int_Scalar", (R("a"), 1, R("idx0"), -1.0)),
])
def test_in_place_ops_write_where_they_read(target, args):
    check_in_place(target, args)


@pytest.mark.parametrize("target,args,kwargs", [
    ("aten.slice_scatter.default", (R("a"), R("col")), {"dim": 1, "start": 1}),
    ("aten.select_scatter.default", (R("a"), R("row"), 0, 2), {}),
    ("aten.select_scatter.default", (R("d"), R("a"), 2, 3), {}),
    ("aten.scatter.src", (R("a"), 1, R("idx"), R("z")), {}),
    ("aten.scatter.value", (R("a"), 1, R("pos3"), 2.0), {}),
    ("aten.scatter_add.default", (R("a"), 1, R("pos3"), R("src3")), {}),
    ("aten.index_put.default", (R("a"), [R("idx0")], R("vals")), {}),
    ("aten.index_put.default", (R("a"), [R("idx0")], R("vals"), True), {}),
    ("aten.index_put.default", (R("d"), [None, R("idx0")], R("dv")), {}),
    ("aten.index_add.default", (R("a"), 0, R("idx0"), R("vals")), {}),
    ("aten.index_copy.default", (R("a"), 0, R("idx0"), R("vals")), {}),
    ("aten.index_fill.int_Scalar", (R("a"), 0, R("idx0"), 7.0), {}),
])
def test_scatter_family(target, args, kwargs):
    seen = check_op(target, args, kwargs, values=fresh(), meshes=MESHES_2D + [MESH_3D])
    assert any(s.family == "index" for s in seen)


def test_adding_writes_pass_a_pending_sum_and_overwrites_do_not():
    node, _ = make_node("aten.scatter_add.default", (R("a"), 1, R("pos3"), R("src3")), None, fresh())
    assert any(s.output.partial for s in strategies_for(context(node, V, MESHES_2D[0])))
    for target in ("aten.scatter.src", "aten.index_copy.default"):
        args = (R("a"), 1, R("idx"), R("z")) if target == "aten.scatter.src" else (R("a"), 0, R("idx0"), R("vals"))
        node, _ = make_node(target, args, None, fresh())
        assert not any(s.output.partial for s in strategies_for(context(node, V, MESHES_2D[0])))


def test_functional_twins():
    assert functional_twin("aten.add_.Tensor") == "aten.add.Tensor"
    assert functional_twin("aten.copy_.default") == "aten.copy.default"
    assert functional_twin("aten.add.Tensor") is None
    assert functional_twin("aten._to_copy.default") is None
    assert has_rule("aten.masked_fill_.Scalar") and has_rule("aten.index_put_.default")
    assert not has_rule("aten.bernoulli_.float")  # random in-place fills have no rule: whole
