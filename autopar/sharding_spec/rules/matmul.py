"""The matmul family, driven by one einsum enumerator.

Each op is written as an einsum over letters (``"mk,kn->mn"`` for mm). Every active mesh axis is
assigned to one letter or to nothing; several axes may share a letter (in mesh order). An operand is
split on the axes of its letters and replicated on the others; axes on a contracted letter leave a
pending sum in the output. Letters play roles: batch (in every operand and the output), m (first
operand and output), n (second operand and output), k (contracted). The roles name the family:

    m only -> dp (leading m letter) / sp (a later m letter, e.g. the sequence)
    n only -> 1d-col          k only -> 1d-row
    m + n  -> 2d              m on 2+ axes + n -> 2.5d          m + n + k -> 3d
    m + k  -> 2d-mk           n + k  -> 2d-nk                   batch letters add "dp"
"""
from __future__ import annotations

import math
import string

from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import Family, OpContext, Strategy, axis_assignments, register


def _roles(inputs: list[str], output: str) -> dict[str, str]:
    roles = {}
    a, b = inputs[0], inputs[1] if len(inputs) > 1 else ""
    for ch in dict.fromkeys("".join(inputs) + output):
        in_a, in_b, in_out = ch in a, ch in b, ch in output
        if in_out and in_a and in_b:
            roles[ch] = "batch"
        elif in_out and in_a:
            roles[ch] = "m"
        elif in_out and in_b:
            roles[ch] = "n"
        elif in_out:
            roles[ch] = "batch"
        else:
            roles[ch] = "k"
    return roles


def family_of(assign: dict[str, tuple[int, ...]], roles: dict[str, str], m_order: list[str]) -> Family:
    count = {"batch": 0, "m": 0, "n": 0, "k": 0}
    for ch, axes in assign.items():
        count[roles[ch]] += len(axes)
    nb, nm, nn, nk = count["batch"], count["m"], count["n"], count["k"]
    if nm and nn and nk:
        fam = "3d"
    elif nm >= 2 and nn:
        fam = "2.5d"
    elif nm and nn:
        fam = "2d"
    elif nm and nk:
        fam = "2d-mk"
    elif nn and nk:
        fam = "2d-nk"
    elif nn:
        fam = "1d-col"
    elif nk:
        fam = "1d-row"
    elif nm:
        lead = bool(m_order) and bool(assign.get(m_order[0]))
        rest = any(assign.get(ch) for ch in m_order[1:])
        fam = "dp+sp" if lead and rest else ("dp" if lead else "sp")
    else:
        fam = "dp" if nb else "replicate"
    return Family.of("dp", fam) if nb and fam not in ("dp", "replicate") else Family(fam)


def einsum_strategies(
    equation: str,
    shapes: list[tuple[int, ...]],
    mesh,
    *,
    no_split: str = "",
    family_roles: dict[str, str] | None = None,
) -> list[tuple[list[ShardingSpec], ShardingSpec, str, float]]:
    """Every (input specs, output spec, family, compute fraction) of an einsum on ``mesh``.
    ``no_split``: letters that must stay whole (e.g. a softmax dim)."""
    lhs, out = equation.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != len(shapes):
        raise ValueError(f"equation {equation} has {len(ins)} operands but {len(shapes)} shapes were given")
    size: dict[str, int] = {}
    for letters, shape in zip(ins, shapes):
        if len(letters) != len(shape):
            raise ValueError(f"operand {letters} of {equation} does not match shape {shape}")
        for ch, s in zip(letters, shape):
            if s != 1:  # a broadcast dim of size 1 never decides the size
                size[ch] = s
            size.setdefault(ch, s)
    roles = family_roles or _roles(ins, out)
    m_order = [ch for ch in out if roles.get(ch) == "m"]
    letters = [ch for ch in dict.fromkeys("".join(ins) + out) if ch not in no_split]
    results = []
    for choice in axis_assignments(mesh, len(letters)):
        assign: dict[str, tuple[int, ...]] = {}
        for axis, c in enumerate(choice):
            if c is not None:
                assign[letters[c]] = assign.get(letters[c], ()) + (axis,)
        if any(size[ch] % math.prod(mesh.shape[a] for a in axes) for ch, axes in assign.items()):
            continue
        in_specs = []
        for letters_i, shape in zip(ins, shapes):
            # A broadcast dim (size 1 against a larger letter) stays whole on its operand.
            dims = tuple(assign.get(ch, ()) if shape[j] == size[ch] else () for j, ch in enumerate(letters_i))
            in_specs.append(ShardingSpec(shape, dims, (), mesh.ndim))
        partial = tuple(sorted(a for ch, axes in assign.items() if ch not in out for a in axes))
        out_shape = tuple(size[ch] for ch in out)
        out_spec = ShardingSpec(out_shape, tuple(assign.get(ch, ()) for ch in out), partial, mesh.ndim)
        used = [a for axes in assign.values() for a in axes]
        frac = 1.0 / math.prod(mesh.shape[a] for a in used)
        results.append((in_specs, out_spec, family_of(assign, roles, m_order), frac))
    return results


def _letters(n: int, skip: str) -> str:
    return "".join(ch for ch in string.ascii_lowercase if ch not in skip)[:n]


def _with_bias(specs, out: ShardingSpec, bias_shape, mesh) -> ShardingSpec:
    """The spec a bias added to ``out`` must have: split like the output dims it broadcasts to, and a
    pending sum on the output's partial axes (so it is added exactly once)."""
    nd = len(bias_shape)
    dims = tuple(
        out.dim_axes[len(out.shape) - nd + j] if bias_shape[j] == out.shape[len(out.shape) - nd + j] else ()
        for j in range(nd)
    )
    return ShardingSpec(tuple(bias_shape), dims, out.partial, mesh.ndim)


def _strategies(ctx: OpContext, equation: str, operand_idx: list[int], bias_idx: int | None = None, **kw):
    shapes = [ctx.shape_of(i) for i in operand_idx]
    out = []
    for in_specs, out_spec, fam, frac in einsum_strategies(equation, shapes, ctx.mesh, **kw):
        specs: list = [None] * len(ctx.node.inputs)
        for i, s in zip(operand_idx, in_specs):
            specs[i] = s
        if bias_idx is not None:
            specs[bias_idx] = _with_bias(specs, out_spec, ctx.shape_of(bias_idx), ctx.mesh)
        out.append(Strategy(tuple(specs), out_spec, fam, frac))
    return out


@register("aten.mm.default")
def mm_rule(ctx: OpContext):
    return _strategies(ctx, "mk,kn->mn", [0, 1])


@register("aten.bmm.default")
def bmm_rule(ctx: OpContext):
    return _strategies(ctx, "bmk,bkn->bmn", [0, 1])


@register("aten.addmm.default")
def addmm_rule(ctx: OpContext):
    # addmm(bias, a, b): inputs are [bias, a, b]
    return _strategies(ctx, "mk,kn->mn", [1, 2], bias_idx=0)


@register("aten.baddbmm.default")
def baddbmm_rule(ctx: OpContext):
    return _strategies(ctx, "bmk,bkn->bmn", [1, 2], bias_idx=0)


@register("aten.linear.default")
def linear_rule(ctx: OpContext):
    x_shape = ctx.shape_of(0)
    lead = _letters(len(x_shape) - 1, "kn")
    bias = 2 if len(ctx.node.inputs) > 2 else None
    return _strategies(ctx, f"{lead}k,nk->{lead}n", [0, 1], bias_idx=bias)


def matmul_equation(a_shape, b_shape) -> str:
    """The einsum of torch.matmul for these shapes (1-D operands and broadcast batch dims included)."""
    if len(a_shape) == 1 and len(b_shape) == 1:
        return "k,k->"
    if len(b_shape) == 1:
        lead = _letters(len(a_shape) - 1, "k")
        return f"{lead}k,k->{lead}"
    if len(a_shape) == 1:
        batch = _letters(len(b_shape) - 2, "kn")
        return f"k,{batch}kn->{batch}n"
    nb = max(len(a_shape), len(b_shape)) - 2
    batch = _letters(nb, "mkn")
    a_b, b_b = batch[nb - (len(a_shape) - 2):], batch[nb - (len(b_shape) - 2):]
    return f"{a_b}mk,{b_b}kn->{batch}mn"


@register("aten.matmul.default")
def matmul_rule(ctx: OpContext):
    return _strategies(ctx, matmul_equation(ctx.shape_of(0), ctx.shape_of(1)), [0, 1])
