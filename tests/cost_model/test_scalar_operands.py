"""Save rules with a Python number in an operand's place (``x / 2.0``, ``2 ** x``, ``where(c, x, 0.0)``).

A save rule names tensor inputs by their index among the node's *tensor* inputs; a scalar operand is
no input, so the rules find operands by name. Checked three ways: every rule, on every overload of
its op and every choice of scalar operands, names only existing inputs; what the rules say is what
torch's autograd really saves (read with ``saved_tensors_hooks``); and models built around each
scalar form trace and get a saved set of existing names.
"""
import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models_zoo import SCALAR_OPS, SCALAR_OPS_EXTRA, scalar_op  # noqa: E402

from autopar.cost_model.memory import saved_for_backward  # noqa: E402
from autopar.cost_model.ops import SAVE_RULES, is_floating, is_view, operands, save_rule, tensor_inputs  # noqa: E402
from autopar.ir import Node, NodeRef, Role, TensorMeta, trace  # noqa: E402
from autopar.ir.graph import needs_grad  # noqa: E402

A = torch.ops.aten
CASES = [e for exprs in {**SCALAR_OPS, **SCALAR_OPS_EXTRA}.values() for e in exprs]


# ---- torch's ground truth ---------------------------------------------------------------------------
def torch_saved(op, args: list, kwargs: dict, grad: set[int]) -> tuple[set[int], bool]:
    """What autograd saves when ``op(*args, **kwargs)`` runs with the tensors at ``grad`` (indices
    among the tensor arguments, args then kwargs) needing a gradient: (tensor-argument indices,
    whether the output is saved). A saved view counts as its source; a Python number (wrapped into
    a 0-d tensor by torch) is none of them."""
    tensors: list[torch.Tensor] = []

    def prep(v):
        if isinstance(v, torch.Tensor):
            v = v.detach().clone().requires_grad_(len(tensors) in grad)
            tensors.append(v)
        elif isinstance(v, (list, tuple)):
            v = type(v)(prep(x) for x in v)
        return v

    args = [prep(a) for a in args]
    kwargs = {k: prep(v) for k, v in kwargs.items()}
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = op(*args, **kwargs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]

    def storage(t):
        return t.untyped_storage().data_ptr()

    saved, saves_output = set(), False
    for t in packed:
        hit = {k for k, x in enumerate(tensors) if storage(t) == storage(x)}
        saved |= hit
        saves_output |= not hit and any(storage(t) == storage(o) for o in outs)
    return saved, saves_output


def _node(target: str, args: tuple, kwargs: dict, inputs: list[str]) -> Node:
    return Node(name="n", op="call_function", target=target, inputs=inputs, args=args, kwargs=kwargs,
                meta=None, flops=0, role=Role.ACTIVATION, module_path="", module_type="")


def _refs(args, kwargs):
    """args/kwargs with every tensor replaced by a NodeRef t0, t1, ... (args, then kwargs)."""
    names = []

    def sub(v):
        if isinstance(v, torch.Tensor):
            names.append(f"t{len(names)}")
            return NodeRef(names[-1])
        if isinstance(v, (list, tuple)):
            return type(v)(sub(x) for x in v)
        return v

    a = tuple(sub(x) for x in args)
    k = {key: sub(v) for key, v in kwargs.items()}
    return a, k, names


def assert_rule_matches_torch(target: str, args: list, kwargs: dict | None = None):
    """For every non-empty set of float tensor operands needing a gradient, the save rule of
    ``target`` says exactly what torch saves."""
    kwargs = kwargs or {}
    op = getattr(getattr(A, target.split(".")[1]), target.split(".")[2])
    ref_args, ref_kwargs, names = _refs(args, kwargs)
    flat = [v for v in list(args) + list(kwargs.values()) for v in (v if isinstance(v, (list, tuple)) else [v])]
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    floats = [k for k, t in enumerate(tensors) if t.is_floating_point()]
    node = _node(target, ref_args, ref_kwargs, names)
    for r in range(1, len(floats) + 1):
        for grad in itertools.combinations(floats, r):
            want = torch_saved(op, list(args), dict(kwargs), set(grad))
            got = save_rule(target)(set(grad), len(tensors), node)
            assert (set(got[0]), bool(got[1])) == want, f"{target}{tuple(ref_args)} grad {grad}: rule {got} != torch {want}"


X, Y, Z = (torch.rand(4, 6, generator=torch.Generator().manual_seed(s)) + 0.5 for s in range(3))
M = torch.rand(4, 6, generator=torch.Generator().manual_seed(3)) > 0.5
ORACLE_CASES = [
    # division in every form: by a number, of a number, with a rounding mode, Scalar overloads
    ("aten.div.Tensor", [X, 2.0]), ("aten.div.Tensor", [2.0, X]), ("aten.div.Tensor", [X, Y]),
    ("aten.div.Tensor_mode", [X, Y], {"rounding_mode": "floor"}), ("aten.div.Tensor_mode", [X, 2.0], {"rounding_mode": "floor"}),
    ("aten.div.Tensor_mode", [2.0, X], {"rounding_mode": "trunc"}), ("aten.div.Tensor_mode", [X, Y], {"rounding_mode": None}),
    ("aten.div.Scalar", [X, 2.0]), ("aten.div.Scalar_mode", [X, 2.0], {"rounding_mode": "trunc"}),
    ("aten.true_divide.Tensor", [2.0, X]), ("aten.true_divide.Tensor", [X, Y]),
    ("aten.mul.Tensor", [X, 2.0]), ("aten.mul.Tensor", [2.0, X]), ("aten.mul.Tensor", [X, Y]), ("aten.mul.Scalar", [X, 2.0]),
    ("aten.add.Tensor", [X, 1.0]), ("aten.add.Tensor", [2.0, X]), ("aten.sub.Tensor", [2.0, X]), ("aten.rsub.Scalar", [X, 1]),
    ("aten.rsub.Tensor", [X, Y]),
    ("aten.pow.Tensor_Scalar", [X, 2]), ("aten.pow.Scalar", [2.0, X]), ("aten.pow.Tensor_Tensor", [X, Y]),
    ("aten.fmod.Scalar", [X, 0.3]), ("aten.fmod.Tensor", [X, Y]), ("aten.remainder.Scalar", [X, 0.3]),
    ("aten.remainder.Tensor", [X, Y]), ("aten.remainder.Scalar_Tensor", [2.0, X]),
    ("aten.floor_divide.default", [X, 0.7]), ("aten.floor_divide.default", [2.0, X]), ("aten.floor_divide.default", [X, Y]),
    ("aten.copysign.Scalar", [X, -1.0]), ("aten.copysign.Tensor", [X, Y]),
    ("aten.xlogy.Scalar_Other", [X, 2.0]), ("aten.xlogy.Scalar_Self", [2.0, X]), ("aten.xlogy.Tensor", [X, Y]),
    ("aten.masked_fill.Scalar", [X, M, float("-inf")]), ("aten.masked_fill.Tensor", [X, M, torch.tensor(1.0)]),
    ("aten.clamp.default", [X, 0.9]), ("aten.clamp.default", [X, None, 0.9]), ("aten.clamp.Tensor", [X, Y, None]),
    ("aten.clamp.Tensor", [X, Y, Z]), ("aten.clamp_min.default", [X, 0.9]), ("aten.clamp_min.Tensor", [X, Y]),
    ("aten.clamp_max.default", [X, 0.9]), ("aten.clamp_max.Tensor", [X, Y]),
    ("aten.lerp.Scalar", [X, Y, 0.5]), ("aten.lerp.Tensor", [X, Y, Z]),
    ("aten.addcmul.default", [X, Y, Z], {"value": 0.5}), ("aten.addcdiv.default", [X, Y, Z], {"value": 0.5}),
    ("aten.maximum.default", [X, Y]), ("aten.minimum.default", [X, Y]), ("aten.fmax.default", [X, Y]),
    ("aten.atan2.default", [X, Y]), ("aten.hypot.default", [X, Y]), ("aten.max.other", [X, Y]),
    ("aten.where.self", [M, X, Y]), ("aten.where.ScalarOther", [M, X, 0.0]), ("aten.where.ScalarSelf", [M, 0.0, X]),
    ("aten.max.default", [X]), ("aten.max.dim", [X, 1]), ("aten.amax.default", [X, [1]]), ("aten.logsumexp.default", [X, [1]]),
    ("aten.std.correction", [X, [1]]), ("aten.var.correction", [X, [1]]),
    ("aten.gather.default", [X, 0, torch.zeros(4, 6, dtype=torch.long)]),
    ("aten.index_select.default", [X, 0, torch.tensor([2, 0])]), ("aten.index.Tensor", [X, [torch.tensor([2, 0])]]),
    ("aten.embedding.default", [X, torch.tensor([[2, 0, 1]])]),
    ("aten.mm.default", [X, Y.t()]), ("aten.addmm.default", [Z[0, :4], X, Y.t()[:, :4]]),
    ("aten.linear.default", [X, Y, Z[:, 0]]), ("aten.linear.default", [X, Y]),
    ("aten.reciprocal.default", [X]), ("aten.rsqrt.default", [X]), ("aten.exp.default", [X]), ("aten.gelu.default", [X]),
    ("aten.square.default", [X]), ("aten.neg.default", [X]), ("aten.sign.default", [X]), ("aten.round.default", [X]),
    ("aten.leaky_relu.default", [X, 0.1]), ("aten.softmax.int", [X, -1]), ("aten.cumsum.default", [X, 0]),
]


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: f"{c[0]}{tuple('T' if isinstance(a, torch.Tensor) else a for a in c[1])}")
def test_save_rule_is_what_torch_saves(case):
    assert_rule_matches_torch(case[0], case[1], case[2] if len(case) > 2 else None)


# ---- every rule, every overload, every scalar placement ----------------------------------------------
def _placements():
    """(target, node, n) for every overload of every op in SAVE_RULES, with each Tensor argument
    either a tensor reference or a Python number (the forms torch's tracer emits)."""
    for key in sorted(SAVE_RULES):
        _, name, *overload = key.split(".")
        packet = getattr(A, name, None)
        if packet is None:
            continue
        for o in overload or packet.overloads():
            schema = getattr(packet, o)._schema
            if schema.is_mutable or o.startswith("out"):
                continue
            positional = [a for a in schema.arguments if not a.kwarg_only]
            slots = [i for i, a in enumerate(positional) if "Tensor" in str(a.type)]
            for pick in itertools.product([True, False], repeat=len(slots)):
                refs = iter(range(len(slots)))
                args = []
                for i, a in enumerate(positional):
                    if i in slots:
                        args.append(NodeRef(f"t{next(refs)}") if pick[slots.index(i)] else 2.0)
                    else:
                        args.append(a.default_value if a.has_default_value() else 0)
                names = [v.name for v in args if isinstance(v, NodeRef)]
                if names:
                    yield f"aten.{name}.{o}", _node(f"aten.{name}.{o}", tuple(args), {}, names), len(names)


def test_every_save_rule_names_only_existing_tensor_inputs():
    seen = 0
    for target, node, n in _placements():
        rule = save_rule(target)
        for r in range(1, n + 1):
            for grad in itertools.combinations(range(n), r):
                idx, out = rule(set(grad), n, node)
                assert all(0 <= k < n for k in idx), f"{target}{node.args}: grad {grad} -> {sorted(idx)} of {n}"
                assert isinstance(out, bool)
                seen += 1
    assert seen > 500


def test_operands_maps_schema_names_to_tensor_inputs():
    div = _node("aten.div.Tensor", (NodeRef("a"), 2.0), {}, ["a"])
    assert operands(div, 1) == {"self": [0]}
    rdiv = _node("aten.div.Tensor", (2.0, NodeRef("a")), {}, ["a"])
    assert operands(rdiv, 1) == {"other": [0]}
    where = _node("aten.where.ScalarSelf", (NodeRef("c"), 0.0, NodeRef("b")), {}, ["c", "b"])
    assert operands(where, 2) == {"condition": [0], "other": [1]}
    addcmul = _node("aten.addcmul.default", (NodeRef("a"), NodeRef("b")), {"tensor2": NodeRef("c"), "value": 0.5}, ["a", "b", "c"])
    assert operands(addcmul, 3) == {"self": [0], "tensor1": [1], "tensor2": [2]}
    index = _node("aten.index.Tensor", (NodeRef("x"), [None, NodeRef("i"), NodeRef("j")]), {}, ["x", "i", "j"])
    assert operands(index, 3) == {"self": [0], "indices": [1, 2]}
    assert operands(div, 2) is None  # a reference that is not a single tensor: unknown
    assert operands(_node("operator.getitem", (NodeRef("a"), 0), {}, ["a"]), 1) is None


# ---- traced models ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(expr):
        if expr not in cache:
            model, inputs = scalar_op(expr)
            cache[expr] = trace(model, inputs)
        return cache[expr]

    return get


@pytest.mark.parametrize("expr", CASES)
def test_saved_for_backward_with_a_scalar_operand(expr, traced):
    g = traced(expr)
    saved = saved_for_backward(g)
    assert saved <= set(g.nodes), saved - set(g.nodes)
    assert "x" in saved  # h = x * w saves x for w's gradient
    assert not any(str(g.nodes[n].role) in ("parameter", "buffer") for n in saved)


@pytest.mark.parametrize("expr", CASES)
def test_traced_nodes_save_what_torch_saves(expr, traced):
    """Every differentiable node of the traced model, run on real values: the rule is torch."""
    g = traced(expr)
    ng = needs_grad(g)
    for node in g.nodes.values():
        if node.op != "call_function" or is_view(node.target) or node.name not in ng or not node.target.startswith("aten."):
            continue
        values = {name: _value(g.nodes[name].tensor_meta) for _, name in tensor_inputs(node, g)}
        feed = iter(values[n] for n in node.inputs)
        args = [_subst(a, feed) for a in node.args]
        kwargs = {k: _subst(v, feed) for k, v in node.kwargs.items()}
        assert_rule_matches_torch(node.target, args, kwargs)


def _value(meta: TensorMeta) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(meta.shape))
    dtype = getattr(torch, meta.dtype)
    if meta.dtype == "bool":
        return torch.rand(meta.shape, generator=g) > 0.5
    if is_floating(meta.dtype):
        return (torch.rand(meta.shape, generator=g) + 0.5).to(dtype)
    return torch.randint(0, 3, meta.shape, generator=g, dtype=dtype)


def _subst(v, feed):
    if isinstance(v, NodeRef):
        return next(feed)
    if isinstance(v, (list, tuple)):
        return type(v)(_subst(x, feed) for x in v)
    return v


# ---- by hand -------------------------------------------------------------------------------------------
class _Div(torch.nn.Module):
    def __init__(self, by_scalar: bool, denominator_needs_grad: bool = True):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.rand(4, 8) + 0.5)
        self.w2 = torch.nn.Parameter(torch.rand(4, 8) + 0.5)
        self.by_scalar, self.den_grad = by_scalar, denominator_needs_grad

    def forward(self, x, y):
        a = x * self.w1  # saves x (w1 needs a gradient)
        if self.by_scalar:
            return (a / 2.0).sum()
        b = y * self.w2 if self.den_grad else y + 1.0  # saves y / nothing
        return (a / b).sum()


def _trace_div(*flags):
    x, y = torch.rand(4, 8) + 0.5, torch.rand(4, 8) + 0.5
    return trace(_Div(*flags), (x, y))


def test_division_by_a_number_saves_nothing():
    # d(a / c)/da = 1 / c: the backward reads no tensor (torch keeps only the number).
    g = _trace_div(True)
    assert saved_for_backward(g) == {"x"}  # mul's, not div's
    div = next(n for n in g.nodes.values() if n.target == "aten.div.Tensor")
    assert save_rule(div.target)({0}, 1, div) == (set(), False)


def test_division_of_tensors_saves_the_denominator_and_for_its_gradient_the_numerator():
    # da = g / b reads b; db = -g a / b^2 reads a and b.
    g = _trace_div(False, True)
    assert saved_for_backward(g) == {"x", "y", "mul", "mul_1"}
    div = next(n for n in g.nodes.values() if n.target == "aten.div.Tensor")
    rule = save_rule(div.target)
    assert rule({0}, 2, div) == ({1}, False)
    assert rule({1}, 2, div) == ({0, 1}, False)
    # only the numerator needs a gradient: the denominator alone is kept
    g = _trace_div(False, False)
    assert saved_for_backward(g) == {"x", "add"}


def test_values_without_a_gradient_save_nothing():
    # A comparison's output carries no gradient: it has no backward, even on a tensor that does.
    g = trace(*scalar_op("h > 1.0"))
    assert "gt" not in needs_grad(g)
    assert saved_for_backward(g) == {"x", "to"}  # x for w's gradient, the float mask for h's
