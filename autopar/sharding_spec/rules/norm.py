"""Softmax and normalization layers: softmax / log_softmax, layer_norm, rms_norm; and other ops
that work along one dim kept whole: topk, sort, argsort (a router picking experts), one_hot.

Each normalizes over some dims (the softmax dim, the trailing ``normalized_shape`` dims), which stay
whole; every other dim may be split, on the output and on any statistics the op also returns
(native_layer_norm's mean and rstd). The affine weight and bias live on the normalized dims, so they
are read whole. Nothing is linear here, so no pending sum passes. RMSNorm written as plain ops
(pow, mean, add, rsqrt, mul) is covered by the pointwise and reduction rules.

Families: "norm" (a batch-like dim split; "select" for topk / sort / one_hot), "replicate".
"""
from __future__ import annotations

from autopar.sharding_spec.rules._common import input_pos, is_tensor_meta, letter_choices, letters_for, norm_dim, out_metas
from autopar.sharding_spec.strategy import OpContext, Strategy, register

SOFTMAX = ["aten._softmax.default", "aten.softmax.int", "aten._log_softmax.default", "aten.log_softmax.int",
           "aten._safe_softmax.default"]
# target -> positional index of normalized_shape
NORMS = {
    "aten.layer_norm.default": 1,
    "aten.native_layer_norm.default": 1,
    "aten.rms_norm.default": 1,
    "aten._fused_rms_norm.default": 1,
}


def whole_dims_strategies(ctx: OpContext, whole: set[int], family: str = "norm") -> list[Strategy]:
    """Input 0 and every output split on any dim but ``whole`` (outputs line up with input 0's
    leading dims; a trailing output dim of size 1 is a kept statistic dim); other inputs whole."""
    x_shape = ctx.shape_of(0)
    letters = letters_for(len(x_shape))
    x_letters = tuple(None if d in whole else ch for d, ch in enumerate(letters))
    ins = [(x_shape, x_letters)] + [
        (tuple(m.shape), (None,) * len(m.shape)) if is_tensor_meta(m) else None for m in ctx.input_metas[1:]
    ]
    outs = []
    for m in out_metas(ctx):
        if not is_tensor_meta(m):
            outs.append(None)
            continue
        shape = tuple(m.shape)
        lead = [x_letters[d] if d < len(x_shape) and shape[d] == x_shape[d] else None for d in range(len(shape))]
        outs.append((shape, tuple(lead)))
    single = not isinstance(ctx.out_meta, tuple)
    return [
        Strategy(c.inputs, c.output(single), family if c.assign else "replicate", c.split_fraction)
        for c in letter_choices(ctx.mesh, ins, outs, splittable=[ch for ch in x_letters if ch])
    ]


@register(*SOFTMAX)
def softmax_rule(ctx: OpContext) -> list[Strategy]:
    ndim = len(ctx.shape_of(0))
    return whole_dims_strategies(ctx, {norm_dim(int(ctx.arg(1, "dim")), ndim)})


@register(*NORMS)
def norm_rule(ctx: OpContext) -> list[Strategy]:
    if input_pos(ctx, 0, "input") != 0:
        return []
    ndim = len(ctx.shape_of(0))
    k = len(ctx.arg(NORMS[ctx.node.target], "normalized_shape"))
    return whole_dims_strategies(ctx, set(range(ndim - k, ndim)))


# target -> (positional index of dim, its default)
ALONG_DIM = {"aten.topk.default": (2, -1), "aten.sort.default": (1, -1), "aten.argsort.default": (1, -1)}


@register(*ALONG_DIM)
def along_dim_rule(ctx: OpContext) -> list[Strategy]:
    pos, default = ALONG_DIM[ctx.node.target]
    ndim = len(ctx.shape_of(0))
    if ndim == 0:
        return [ctx.replicated()]
    return whole_dims_strategies(ctx, {norm_dim(int(ctx.arg(pos, "dim", default)), ndim)}, "select")


@register("aten.one_hot.default")
def one_hot_rule(ctx: OpContext) -> list[Strategy]:
    # the class dim is new and trailing; the index dims split like the indices
    return whole_dims_strategies(ctx, set(), "select")
