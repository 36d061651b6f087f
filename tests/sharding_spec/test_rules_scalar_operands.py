"""Pointwise rules with a Python number in an operand's place, and models that use such ops.

A number is no entry of ``node.inputs``: in ``div.Tensor(2.0, x)`` input 0 is the denominator. Every
strategy of every op of the models in ``models_zoo.SCALAR_OPS`` is run per rank on local shards (the
rules harness) and must reproduce the single-device result; pending sums pass only where the op is
linear in the operand carrying them; and the models plan.
"""
import sys
from pathlib import Path

import pytest
import torch
from rules_harness import MESHES_2D, Mesh, check_op, context, ints, make_node

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models_zoo import SCALAR_OPS, SCALAR_OPS_EXTRA, mingpt, scalar_op  # noqa: E402

import autopar  # noqa: E402
from autopar.ir import NodeRef as R  # noqa: E402
from autopar.ir import trace  # noqa: E402
from autopar.sharding_spec.rules.pointwise import BINARY  # noqa: E402
from autopar.sharding_spec.rules import has_rule, strategies_for  # noqa: E402

CASES = [e for exprs in {**SCALAR_OPS, **SCALAR_OPS_EXTRA}.values() for e in exprs]

V = {
    "a": ints(4, 6),
    "pos": ints(4, 6, lo=1, hi=6),
    "m": ints(4, 6, lo=0, hi=2, dtype=torch.bool),
}


def _has_scalar_form(name: str) -> bool:
    """Whether ATen has an overload of ``name`` taking a Tensor and a Scalar, returning a Tensor."""
    packet = getattr(torch.ops.aten, name, None)
    for o in packet.overloads() if packet is not None else ():
        schema = getattr(packet, o)._schema
        types = [str(a.type) for a in schema.arguments]
        if schema.is_mutable or [str(r.type) for r in schema.returns] != ["Tensor"]:
            continue
        if any("Tensor" in t for t in types) and any(t in ("number", "Optional[number]", "Scalar", "Optional[Scalar]") for t in types):
            return True
    return False


def test_every_binary_op_with_a_scalar_form_has_cases():
    assert {n for n in BINARY if _has_scalar_form(n)} == set(SCALAR_OPS)


def _partials(target, args, kwargs=None, mesh=Mesh((2,))):
    node, _ = make_node(target, args, kwargs, V)
    out = set()
    for s in strategies_for(context(node, V, mesh)):
        ins = tuple(() if x is None else x.partial for x in s.inputs)
        if s.output.partial or any(ins):
            out.add((ins, s.output.partial))
    return out


# ---- the operand a pending sum may ride on is found by argument, not by input position -------------
@pytest.mark.parametrize(
    "target,args,linear_in",
    [
        ("aten.div.Tensor", (R("a"), 2.0), True),  # (sum a_i) / 2 = sum (a_i / 2)
        ("aten.div.Tensor", (2.0, R("pos")), False),  # 2 / sum p_i != sum 2 / p_i
        ("aten.true_divide.Tensor", (R("a"), 2.0), True),
        ("aten.true_divide.Tensor", (2.0, R("pos")), False),
        ("aten.div.Tensor_mode", (R("a"), 2.0, {"rounding_mode": "floor"}), False),  # rounding is not linear
        ("aten.mul.Tensor", (R("a"), 0.5), True),
        ("aten.mul.Tensor", (0.5, R("a")), True),
        ("aten.add.Tensor", (2.0, R("a")), False),  # the number would be added once per rank
        ("aten.sub.Tensor", (2.0, R("a")), False),
        ("aten.rsub.Scalar", (R("a"), 1.0), False),
        ("aten.pow.Scalar", (2.0, R("a")), False),
        ("aten.floor_divide.default", (2.0, R("pos")), False),
        ("aten.where.ScalarOther", (R("m"), R("a"), 0.0), True),  # where(c, sum a_i, 0) = sum where(c, a_i, 0)
        ("aten.where.ScalarOther", (R("m"), R("a"), -1.0), False),
        ("aten.where.ScalarSelf", (R("m"), 0.0, R("a")), True),
        ("aten.where.ScalarSelf", (R("m"), 1.0, R("a")), False),
        ("aten.masked_fill.Scalar", (R("a"), R("m"), 0.0), True),
        ("aten.masked_fill.Scalar", (R("a"), R("m"), float("-inf")), False),
    ],
)
def test_pending_sum_rides_only_on_a_linear_tensor_operand(target, args, linear_in):
    kwargs = args[-1] if isinstance(args[-1], dict) else {}
    args = args[:-1] if kwargs else args
    inputs = [a.name for a in args if isinstance(a, R)]  # the node's inputs: numbers are none
    # on a 1-axis mesh: axis 0's pending sum on the numeric operand (not the mask) and the output
    want = {(tuple((0,) if n != "m" else () for n in inputs), (0,))} if linear_in else set()
    assert _partials(target, args, kwargs) == want
    check_op(target, args, kwargs, values=V)  # and every strategy is exact per rank


@pytest.mark.parametrize("target", ["aten.xlogy.Scalar_Self", "aten.round.decimals", "aten.true_divide.Tensor",
                                    "aten.remainder.Scalar_Tensor", "aten.bitwise_and.Scalar_Tensor",
                                    "aten.where.ScalarSelf", "aten.detach_.default"])
def test_scalar_first_forms_have_rules(target):
    assert has_rule(target)


# ---- models around every scalar form -------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(expr):
        if expr not in cache:
            model, inputs = scalar_op(expr)
            cache[expr] = (model, inputs, trace(model, inputs))
        return cache[expr]

    return get


def _values(graph, node) -> dict:
    """Integer-valued inputs of the node's dtypes (floats >= 1, so logs, roots and divisions are
    defined and exact enough)."""
    out = {}
    for name in node.inputs:
        meta = graph.nodes[name].tensor_meta
        dtype = getattr(torch, meta.dtype)
        if meta.dtype == "bool":
            out[name] = ints(*meta.shape, lo=0, hi=2, dtype=torch.bool)
        elif dtype.is_floating_point:
            out[name] = ints(*meta.shape, lo=1, hi=5, dtype=dtype)
        else:
            out[name] = ints(*meta.shape, lo=0, hi=3, dtype=dtype)
    return out


@pytest.mark.parametrize("expr", CASES)
def test_every_strategy_of_a_scalar_op_model_is_exact_per_rank(expr, traced):
    _, _, g = traced(expr)
    checked = 0
    for node in g.nodes.values():
        if node.op != "call_function":
            continue
        assert has_rule(node.target), f"{expr}: no rule for {node.target}"
        if node.tensor_meta is None:
            continue
        check_op(node.target, node.args, node.kwargs, values=_values(g, node), meshes=MESHES_2D, min_strategies=1)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("expr", CASES)
def test_a_scalar_op_model_plans(expr, traced):
    model, inputs, _ = traced(expr)
    plan = autopar.plan(model, autopar.Mesh((2,)), inputs)
    assert plan.summary()["step_time_s"] > 0


# ---- minGPT ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt():
    # Attention dropout in training keeps minGPT's attention decomposed (ir/attention.py fuses it
    # otherwise), so its scalar ops (the div by sqrt(hs), the masked_fill) reach the rules.
    return mingpt(dropout=0.1)


def test_mingpt_traces_with_its_scalar_ops(gpt):
    model, inputs = gpt
    g = trace(model, inputs)
    targets = {n.target for n in g.nodes.values()}
    assert {"aten.div.Tensor", "aten.masked_fill.Scalar", "aten.pow.Tensor_Scalar"} <= targets
    div = next(n for n in g.nodes.values() if n.target == "aten.div.Tensor")
    assert len(div.inputs) == 1 and isinstance(div.args[1], float)  # att / math.sqrt(hs)


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)])
def test_mingpt_plans(gpt, shape):
    model, inputs = gpt
    plan = autopar.plan(model, autopar.Mesh(shape), inputs)
    summary = plan.summary()
    assert summary["step_time_s"] > 0 and summary["memory_bytes_per_device"] > 0
