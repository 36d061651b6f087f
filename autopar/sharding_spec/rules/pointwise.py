"""Pointwise ops: unary and binary math, comparisons, activations, dropout, type conversions and
copies, masked_fill and where.

Every output dim may be split; each tensor operand is split like the output dims it lines up with
(right-aligned), and a broadcast dim (size 1 against a larger output, or a missing leading dim)
stays whole. A pending sum passes through where the op is linear in the operands carrying it:

    add/sub (both tensors)       every tensor operand carries the same pending sum
    mul                          exactly one operand carries it (per mesh axis), the other is whole
    div, true_divide             only the numerator, and only when it is a tensor
    neg, clone, alias, copies    the input's pending sum is the output's
    float conversions            likewise, to the same or a wider float type only (rounding each
                                 part to a narrower type is not rounding the sum)
    where(c, a, b)               a and b together (c never); where(c, a, 0) a, where(c, 0, b) b
    masked_fill(x, m, 0)         x

A Python number may stand in any operand's place (``x / 2.0``, ``2.0 / x`` as
``div.Tensor(2.0, x)``, ``2 ** x``, ``where(c, x, 0.0)``). It is no entry of ``node.inputs``, so an
operand is found by its argument position (``input_pos``), never by its place among the inputs:
in ``div.Tensor(2.0, x)`` input 0 is the denominator.

Never through dropout (each rank would drop a different part of each summand), a scalar added to a
pending sum (it would be added once per rank) or any non-linear function. Training dropout is
elementwise random: splitting it is exact in distribution, not bit-for-bit against one device.
Family: "pointwise" when anything is split or pending, else "replicate".
"""
from __future__ import annotations

from autopar.sharding_spec.rules._common import (
    FLOAT_DTYPES,
    broadcast_letters,
    input_pos,
    is_split,
    is_tensor_meta,
    letter_choices,
    letters_for,
    linear_dtype,
    out_metas,
    tensor_positions,
)
from autopar.sharding_spec.strategy import OpContext, Strategy, register

UNARY = [
    "neg", "abs", "sign", "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p",
    "reciprocal", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "sigmoid",
    "relu", "relu6", "gelu", "silu", "mish", "erf", "erfc", "floor", "ceil", "round", "trunc",
    "square", "logical_not", "bitwise_not", "isnan", "isinf", "isfinite", "nan_to_num", "hardtanh",
    "hardsigmoid", "hardswish", "leaky_relu", "elu", "softplus", "logit", "clamp", "clamp_min",
    "clamp_max", "sgn", "frac", "fill",
]
BINARY = [
    "add", "sub", "rsub", "mul", "div", "pow", "maximum", "minimum", "fmod", "remainder",
    "floor_divide", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_xor", "__and__", "__or__", "__xor__", "atan2", "hypot",
    "copysign", "xlogy", "masked_fill", "clamp", "clamp_min", "clamp_max", "lerp", "addcmul", "addcdiv",
    "true_divide", "fmax", "fmin",
]
OVERLOADS = ["default", "Tensor", "Scalar", "Tensor_Scalar", "Tensor_Tensor", "Scalar_Tensor", "self",
             "Tensor_mode", "Scalar_mode", "ScalarOther", "ScalarSelf", "Scalar_Other", "Scalar_Self",
             "decimals"]
COPIES = [  # pending sums pass through unchanged (x -> x or a plain copy of it)
    "aten.clone.default", "aten.alias.default", "aten.detach.default", "aten.detach_.default",
    "aten.contiguous.default",
    "aten.lift_fresh_copy.default", "aten.positive.default",
]
CONVERSIONS = [  # pending sums pass only float -> float
    "aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device",
    "aten.to.prim_dtype", "aten.to.prim_Device", "aten.type_as.default",
]
DROPOUT = ["aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default",
           "aten.alpha_dropout.default"]


def _targets(names, overloads) -> list[str]:
    """``aten.<name>.<overload>`` for the overloads this torch has that map tensors to one tensor
    (not the scalar-math overloads, nor where(cond), which is nonzero)."""
    import torch

    out = []
    for n in names:
        packet = getattr(torch.ops.aten, n, None)
        if packet is None:
            continue
        for o in overloads:
            if o not in packet.overloads():
                continue
            schema = getattr(packet, o)._schema
            takes = any(str(a.type) in ("Tensor", "Optional[Tensor]") for a in schema.arguments)
            gives = [str(r.type) for r in schema.returns] == ["Tensor"]
            if takes and gives:
                out.append(f"aten.{n}.{o}")
    return out


def pointwise_strategies(ctx: OpContext, partial_options=(), *, ref_inputs=None) -> list[Strategy]:
    """The pointwise strategies of ``ctx``'s node. ``partial_options``: sets of input positions that
    may carry one mesh axis' pending sum together. ``ref_inputs``: the inputs that broadcast against
    the output (default every tensor input); the others are read whole (e.g. type_as's ``other``)."""
    outs = out_metas(ctx)
    tensors = tensor_positions(ctx)
    ref_inputs = tensors if ref_inputs is None else ref_inputs
    ref = next((m for m in outs if is_tensor_meta(m)), None)
    if ref is None:  # no tensor output (e.g. _assert_tensor_metadata): the first input leads
        if not tensors:
            return []
        ref = ctx.input_metas[tensors[0]]
    ref_shape = tuple(ref.shape)
    letters = letters_for(len(ref_shape))
    ins = []
    for k, m in enumerate(ctx.input_metas):
        if not is_tensor_meta(m):
            ins.append(None)
        elif k in ref_inputs and len(m.shape) <= len(ref_shape):
            ins.append((tuple(m.shape), broadcast_letters(tuple(m.shape), letters, ref_shape)))
        else:
            ins.append((tuple(m.shape), (None,) * len(m.shape)))
    out_terms = [
        (tuple(m.shape), broadcast_letters(tuple(m.shape), letters, ref_shape)) if is_tensor_meta(m) else None
        for m in outs
    ]
    numeric = [m for m in outs if is_tensor_meta(m)] + [ctx.input_metas[k] for o in partial_options for k in o]
    if not all(linear_dtype(m) for m in numeric):
        partial_options = ()
    single = not isinstance(ctx.out_meta, tuple)
    result = []
    for c in letter_choices(ctx.mesh, ins, out_terms, splittable=letters, partial_options=partial_options):
        fam = "pointwise" if is_split(c) else "replicate"
        result.append(Strategy(c.inputs, c.output(single), fam, c.split_fraction))
    return result


# ---- linearity per op ----------------------------------------------------------------------------
def _all_tensors(ctx):
    t = tensor_positions(ctx)
    return [frozenset(t)] if len(t) >= 2 else []


def _each_tensor(ctx):
    return [frozenset({k}) for k in tensor_positions(ctx)]


def _self_operand(ctx):
    """The operand passed as ``self`` (argument 0), when it is a tensor: ``div.Tensor(x, 2.0)``'s
    x, but nothing of ``div.Tensor(2.0, x)``, whose only input is the denominator."""
    p = input_pos(ctx, 0, "self")
    return [frozenset({p})] if p is not None else []


def _where(ctx):
    """where(c, a, b) is linear in (a, b) together; with a Python number for one of them, in the
    other alone when that number is 0 (a pending sum of zeros is zero)."""
    c, a, b = (input_pos(ctx, i, name) for i, name in enumerate(("condition", "self", "other")))
    if c is None:
        return []
    if a is not None and b is not None:
        return [frozenset({a, b})]
    scalar = ctx.arg(2, "other") if a is not None else ctx.arg(1, "self")
    tensor = a if a is not None else b
    if tensor is not None and isinstance(scalar, (int, float)) and not isinstance(scalar, bool) and scalar == 0:
        return [frozenset({tensor})]
    return []


def _float_to_float(ctx):
    """A pending sum survives a conversion only to the same or a wider float type: rounding each
    part to a narrower type is not rounding their sum (and the parts may cancel)."""
    m_in, m_out = ctx.input_metas[0] if ctx.input_metas else None, ctx.out_meta
    if not (is_tensor_meta(m_in) and is_tensor_meta(m_out)):
        return []
    if m_in.dtype in FLOAT_DTYPES and m_out.dtype in FLOAT_DTYPES:
        if m_in.dtype == m_out.dtype or _WIDTH[m_out.dtype] > _WIDTH[m_in.dtype]:
            return [frozenset({0})]
    return []


_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


LINEAR = {
    "aten.add.Tensor": _all_tensors,
    "aten.sub.Tensor": _all_tensors,
    "aten.rsub.Tensor": _all_tensors,
    "aten.mul.Tensor": _each_tensor,
    "aten.mul.Scalar": _self_operand,
    "aten.div.Tensor": _self_operand,
    "aten.div.Scalar": _self_operand,
    "aten.true_divide.Tensor": _self_operand,
    "aten.true_divide.Scalar": _self_operand,
    "aten.neg.default": _self_operand,
    "aten.where.self": _where,
    "aten.where.ScalarOther": _where,
    "aten.where.ScalarSelf": _where,
}


@register(*sorted(set(_targets(UNARY, OVERLOADS)) | set(_targets(BINARY, OVERLOADS)) | set(_targets(["where"], OVERLOADS))))
def pointwise_rule(ctx: OpContext) -> list[Strategy]:
    target = ctx.node.target
    if target.startswith("aten.masked_fill."):
        value, x = ctx.arg(2, "value"), input_pos(ctx, 0, "self")
        opts = [frozenset({x})] if x is not None and isinstance(value, (int, float)) and value == 0 else []
    else:
        opts = LINEAR.get(target, lambda _c: [])(ctx)
    return pointwise_strategies(ctx, opts)


@register(*COPIES)
def copy_rule(ctx: OpContext) -> list[Strategy]:
    return pointwise_strategies(ctx, _self_operand(ctx))


@register("aten.copy.default")
def copy_into_rule(ctx: OpContext) -> list[Strategy]:
    """copy(self, src): src broadcast into self's shape and dtype."""
    return pointwise_strategies(ctx)


@register(*[t for t in CONVERSIONS if t != "aten.type_as.default"])
def conversion_rule(ctx: OpContext) -> list[Strategy]:
    return pointwise_strategies(ctx, _float_to_float(ctx))


@register("aten.type_as.default")
def type_as_rule(ctx: OpContext) -> list[Strategy]:
    """type_as(x, other): other only lends its dtype; it is read split like x when shapes match,
    else whole."""
    same = len(ctx.input_metas) > 1 and is_tensor_meta(ctx.input_metas[1]) and tuple(ctx.input_metas[1].shape) == tuple(ctx.out_meta.shape)
    return pointwise_strategies(ctx, _float_to_float(ctx), ref_inputs=[0, 1] if same else [0])


@register(*DROPOUT)
def dropout_rule(ctx: OpContext) -> list[Strategy]:
    """Elementwise random: every split is exact in distribution; no pending sum passes."""
    return pointwise_strategies(ctx)


@register("aten._assert_tensor_metadata.default")
def assert_metadata_rule(ctx: OpContext) -> list[Strategy]:
    """A dtype/device/layout check with no output: any spec of the input, unless it also checks
    sizes or strides (then whole)."""
    if any(ctx.arg(i, name) is not None for i, name in ((1, "size"), (2, "stride"))):
        return []
    return pointwise_strategies(ctx, [frozenset({0})] if ctx.input_metas and linear_dtype(ctx.input_metas[0]) else [])
