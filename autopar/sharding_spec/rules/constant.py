"""Tensor factories: ones / zeros / empty / full, their new_* and *_like forms, random *_like,
arange, scalar_tensor.

A filled tensor is the same everywhere, so every rank can build just its shard: factories taking a
size get it rewritten to the local shape by codegen (rules._common.LOCAL_SIZE_ARGS) and may have any
split output; new_* read their ``self`` only for dtype and device, so it may have any spec while the
output is whole, or be whole while the output is split. *_like ops follow their input's split (a
pending sum passes only through zeros_like: a sum of zeros is zero). Random *_like ops are
elementwise random, exact in distribution like dropout.

arange and scalar_tensor are replicated only: a local arange would start at 0 on every rank, and a
0-d tensor has nothing to split. Their rule returns nothing, so they run replicated without the
unknown-op warning.

Family: "constant" when the output is split, "replicate" otherwise.
"""
from __future__ import annotations

import math

from autopar.sharding_spec.rules._common import is_tensor_meta, linear_dtype
from autopar.sharding_spec.rules.pointwise import pointwise_strategies
from autopar.sharding_spec.strategy import OpContext, Strategy, enumerate_specs, rep, register

SIZED = ["aten.ones.default", "aten.zeros.default", "aten.empty.memory_format", "aten.full.default"]
NEW = ["aten.new_ones.default", "aten.new_zeros.default", "aten.new_empty.default", "aten.new_full.default"]
LIKE = ["aten.ones_like.default", "aten.empty_like.default", "aten.full_like.default", "aten.rand_like.default",
        "aten.randn_like.default", "aten.randint_like.default", "aten.randint_like.low_dtype"]
REPLICATE_ONLY = ["aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.scalar_tensor.default"]


def _frac(spec, mesh) -> float:
    return 1.0 / math.prod(mesh.shape[a] for ax in spec.dim_axes for a in ax)


def _fam(spec) -> str:
    return "replicate" if spec.is_replicated else "constant"


@register(*SIZED)
def sized_rule(ctx: OpContext) -> list[Strategy]:
    ins = tuple(None for _ in ctx.input_metas)
    return [Strategy(ins, o, _fam(o), _frac(o, ctx.mesh)) for o in enumerate_specs(ctx.out_meta.shape, ctx.mesh)]


@register(*NEW)
def new_rule(ctx: OpContext) -> list[Strategy]:
    x = ctx.input_metas[0]
    if not is_tensor_meta(x):
        return []
    rest = (None,) * (len(ctx.input_metas) - 1)
    out_rep, x_rep = rep(ctx.out_meta.shape, ctx.mesh), rep(x.shape, ctx.mesh)
    out = [Strategy((x_rep,) + rest, o, _fam(o), _frac(o, ctx.mesh)) for o in enumerate_specs(ctx.out_meta.shape, ctx.mesh)]
    out += [Strategy((s,) + rest, out_rep, "replicate", 1.0) for s in enumerate_specs(x.shape, ctx.mesh, partial=True)]
    return out


@register(*LIKE)
def like_rule(ctx: OpContext) -> list[Strategy]:
    return [_as_constant(s) for s in pointwise_strategies(ctx)]


@register("aten.zeros_like.default")
def zeros_like_rule(ctx: OpContext) -> list[Strategy]:
    opts = [frozenset({0})] if linear_dtype(ctx.input_metas[0]) and linear_dtype(ctx.out_meta) else []
    return [_as_constant(s) for s in pointwise_strategies(ctx, opts)]


def _as_constant(s: Strategy) -> Strategy:
    return Strategy(s.inputs, s.output, "replicate" if s.family == "replicate" else "constant", s.compute_fraction)


@register(*REPLICATE_ONLY)
def replicate_only_rule(ctx: OpContext) -> list[Strategy]:
    return []
