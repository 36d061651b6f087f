"""Convolutions (conv1d / conv2d / conv3d, aten.convolution), as a matmul over the channels.

The input (batch, c_in, *spatial) and the weight (c_out, c_in, *kernel) contract over c_in into the
output (batch, c_out, *spatial'), so the matmul enumerator (``matmul.einsum_strategies``) gives the
splits and names their families the same way: the batch (dp), the output channels (1d-col: weight
rows and bias split, the input whole), the input channels (1d-row: input channels and weight
columns split, a pending sum out, the bias added once), and their mixes over several mesh axes.
Spatial and kernel dims stay whole (splitting them needs a halo exchange). Grouped and transposed
convolutions split only the batch: their weight's channel dims are not the input's and output's.
"""
from __future__ import annotations

from autopar.sharding_spec.rules.matmul import einsum_strategies
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import OpContext, Strategy, register

_GROUPS_POS = {"aten.convolution.default": 8}  # conv1d/2d/3d(input, weight, bias, stride, padding, dilation, groups)


def _whole_after(spec: ShardingSpec, shape, ndim: int) -> ShardingSpec:
    """``spec`` (over the leading dims of ``shape``) with the remaining dims whole."""
    return ShardingSpec(tuple(shape), spec.dim_axes + ((),) * (len(shape) - len(spec.shape)), spec.partial, ndim)


@register("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.conv1d.padding", "aten.conv2d.padding",
          "aten.conv3d.padding", "aten.convolution.default")
def conv_rule(ctx: OpContext) -> list[Strategy]:
    target = ctx.node.target
    x_i, w_i = ctx.index_of(ctx.arg(0, "input")), ctx.index_of(ctx.arg(1, "weight"))
    bias = ctx.arg(2, "bias")
    b_i = ctx.index_of(bias) if bias is not None and hasattr(bias, "name") else None
    x, w, y = ctx.shape_of(x_i), ctx.shape_of(w_i), tuple(ctx.out_meta.shape)
    batched = len(x) == len(w)  # conv2d also takes an unbatched (c_in, h, w) input
    groups = ctx.arg(_GROUPS_POS.get(target, 6), "groups", 1)
    transposed = target == "aten.convolution.default" and bool(ctx.arg(6, "transposed", False))
    lead = "b" if batched else ""
    ndim = ctx.mesh.ndim
    if groups == 1 and not transposed:  # channels: the weight is (c_out, c_in, *kernel)
        enumerated = einsum_strategies(f"{lead}c,oc->{lead}o", [x[:len(lead) + 1], w[:2]], ctx.mesh)
    elif batched:  # the batch only
        enumerated = [([x_spec, ShardingSpec(w[:0], (), (), ndim)], out_spec, family, fraction)
                      for [x_spec], out_spec, family, fraction in einsum_strategies("b->b", [x[:1]], ctx.mesh)]
    else:
        return [ctx.replicated()]
    out = []
    for (x_spec, w_spec), out_spec, family, fraction in enumerated:
        specs: list = [None] * len(ctx.node.inputs)
        specs[x_i], specs[w_i] = _whole_after(x_spec, x, ndim), _whole_after(w_spec, w, ndim)
        out_spec = _whole_after(out_spec, y, ndim)
        if b_i is not None:  # (c_out,): split like the output channels, a pending sum where the output is one
            channel = out_spec.dim_axes[len(lead)]
            specs[b_i] = ShardingSpec(ctx.shape_of(b_i), (channel,), out_spec.partial, ndim)
        out.append(Strategy(tuple(specs), out_spec, family, fraction))
    return out
