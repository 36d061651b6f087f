"""Reductions (sum, mean, amax, amin, max/min, var/std, argmax/argmin, prod, any/all, logsumexp,
vector norms) and scans (cumsum, cumprod).

Dims that are not reduced may be split; the output keeps their split, re-indexed (a reduced dim
vanishes, or stays as size 1 with keepdim). A reduced dim stays whole, except for sum: summing a
split dim leaves each rank the sum of its slice, a pending sum over the splitting axes
("reduce-partial"). Mean over a split dim needs each rank's mean rescaled by its share, which the
local op does not do: that is the lowered family "reduce-partial(mean)" (codegen multiplies the
local mean by 1 / the number of ranks splitting the reduced dims). Sum, mean and cumsum are linear, so a pending sum on the
input passes to the output. A scan's dim stays whole (a rank's prefix would miss the earlier ranks').

Families: "reduce" (only kept dims split, or a pending sum passed through), "reduce-partial"
(a reduced dim split), "replicate".
"""
from __future__ import annotations

from autopar.sharding_spec.rules._common import (
    dims_arg,
    is_tensor_meta,
    letter_choices,
    letters_for,
    linear_dtype,
    norm_dim,
    out_metas,
)
from autopar.sharding_spec.strategy import OpContext, Strategy, register

# target -> (positional index of dim, its keyword, positional index of keepdim or None, linear?)
REDUCTIONS: dict[str, tuple[int | None, str, int | None, bool]] = {
    "aten.sum.default": (None, "dim", None, True),
    "aten.sum.dim_IntList": (1, "dim", 2, True),
    "aten.mean.default": (None, "dim", None, True),
    "aten.mean.dim": (1, "dim", 2, True),
    "aten.amax.default": (1, "dim", 2, False),
    "aten.amin.default": (1, "dim", 2, False),
    "aten.max.dim": (1, "dim", 2, False),
    "aten.min.dim": (1, "dim", 2, False),
    "aten.max.default": (None, "dim", None, False),
    "aten.min.default": (None, "dim", None, False),
    "aten.argmax.default": (1, "dim", 2, False),
    "aten.argmin.default": (1, "dim", 2, False),
    "aten.var.correction": (1, "dim", None, False),
    "aten.var.dim": (1, "dim", 3, False),
    "aten.var.default": (None, "dim", None, False),
    "aten.std.correction": (1, "dim", None, False),
    "aten.std.dim": (1, "dim", 3, False),
    "aten.std.default": (None, "dim", None, False),
    "aten.var_mean.correction": (1, "dim", None, False),
    "aten.std_mean.correction": (1, "dim", None, False),
    "aten.prod.default": (None, "dim", None, False),
    "aten.prod.dim_int": (1, "dim", 2, False),
    "aten.any.default": (None, "dim", None, False),
    "aten.any.dim": (1, "dim", 2, False),
    "aten.any.dims": (1, "dim", 2, False),
    "aten.all.default": (None, "dim", None, False),
    "aten.all.dim": (1, "dim", 2, False),
    "aten.all.dims": (1, "dim", 2, False),
    "aten.logsumexp.default": (1, "dim", 2, False),
    "aten.linalg_vector_norm.default": (2, "dim", 3, False),
    "aten.count_nonzero.dim_IntList": (1, "dim", None, False),
    "aten.count_nonzero.default": (1, "dim", None, False),
}
SUMS = {"aten.sum.default", "aten.sum.dim_IntList"}  # a split reduced dim leaves a pending sum
# A split reduced dim of a mean leaves a pending sum once codegen rescales each rank's local mean
# by its share (local count / global count = 1 / ranks splitting the reduced dims): the lowered
# family "reduce-partial(mean)".
MEANS = {"aten.mean.default", "aten.mean.dim"}
SCANS = {"aten.cumsum.default": True, "aten.cumprod.default": False, "aten.logcumsumexp.default": False,
         "aten.cummax.default": False, "aten.cummin.default": False}


def reduced_dims(ctx: OpContext) -> tuple[list[int], bool]:
    """The reduced dims (normalized) and keepdim of a reduction node."""
    dim_i, dim_name, keep_i, _ = REDUCTIONS[ctx.node.target]
    ndim = len(ctx.shape_of(0))
    dims = None if dim_i is None else dims_arg(ctx.arg(dim_i, dim_name), ndim)
    keep = bool(ctx.arg(keep_i, "keepdim", False)) if keep_i is not None else bool(ctx.kwarg("keepdim", False))
    return (list(range(ndim)) if dims is None else dims), keep


@register(*REDUCTIONS)
def reduction_rule(ctx: OpContext) -> list[Strategy]:
    if not is_tensor_meta(ctx.input_metas[0]):
        return []
    in_shape = ctx.shape_of(0)
    dims, keep = reduced_dims(ctx)
    letters = letters_for(len(in_shape))
    out_letters = tuple(None if d in dims else ch for d, ch in enumerate(letters))
    if not keep:
        out_letters = tuple(ch for d, ch in enumerate(letters) if d not in dims)
    linear = REDUCTIONS[ctx.node.target][3] and linear_dtype(ctx.input_metas[0])
    outs = out_metas(ctx)
    sum_split = ctx.node.target in SUMS | MEANS and all(linear_dtype(m) for m in outs)
    splittable = [ch for d, ch in enumerate(letters) if d not in dims or sum_split]
    out_terms = [(tuple(m.shape), out_letters) if is_tensor_meta(m) and len(m.shape) == len(out_letters) else None for m in outs]
    if any(t is None for t in out_terms):
        return []
    ins = [(in_shape, letters)] + [None] * (len(ctx.input_metas) - 1)
    opts = [frozenset({0})] if linear else []
    single = not isinstance(ctx.out_meta, tuple)
    out = []
    for c in letter_choices(ctx.mesh, ins, out_terms, splittable=splittable, partial_options=opts):
        split_reduced = any(letters[d] in c.assign for d in dims)
        fam = "reduce-partial" if split_reduced else ("reduce" if c.assign or c.partial_axes else "replicate")
        if split_reduced and ctx.node.target in MEANS:
            fam = "reduce-partial(mean)"
        out.append(Strategy(c.inputs, c.output(single), fam, c.split_fraction))
    return out


@register(*SCANS)
def scan_rule(ctx: OpContext) -> list[Strategy]:
    in_shape = ctx.shape_of(0)
    dim = norm_dim(int(ctx.arg(1, "dim")), len(in_shape))
    letters = letters_for(len(in_shape))
    term = (in_shape, tuple(None if d == dim else ch for d, ch in enumerate(letters)))
    outs = out_metas(ctx)
    linear = SCANS[ctx.node.target] and linear_dtype(ctx.input_metas[0]) and all(linear_dtype(m) for m in outs)
    ins = [term] + [None] * (len(ctx.input_metas) - 1)
    single = not isinstance(ctx.out_meta, tuple)
    out = []
    for c in letter_choices(ctx.mesh, ins, [term] * len(outs), splittable=letters,
                            partial_options=[frozenset({0})] if linear else []):
        out.append(Strategy(c.inputs, c.output(single), "reduce" if c.assign or c.partial_axes else "replicate", c.split_fraction))
    return out
