"""Indexing and positional ops: index.Tensor (advanced indexing), index_select, gather, tril/triu,
pad / constant_pad_nd and diff.

An indexed (gathered, padded, differenced, masked-by-position) dim stays whole: a rank's local
positions are not the global ones. Everything else may be split:

    index.Tensor       x's dims that are not indexed, and the broadcast dims of the index tensors
                       (each index tensor split where it has the full size, x read whole there)
    index_select       x's other dims; the index tensor (and the output's selected dim)
    gather             the gathered dim of the index/output (x whole there); another dim only where
                       x and the index have the same size there (then both split alike)
    tril, triu         the leading (batch) dims
    pad                dims with no padding
    diff               every dim but the differenced one (prepend/append split alike)

All are linear in x (tril/triu, pad with 0, diff in every tensor operand), so a pending sum on x
passes. Family: "index" when anything is split or pending, else "replicate".
"""
from __future__ import annotations

from autopar.sharding_spec.rules._common import (
    is_tensor_meta,
    letter_choices,
    letters_for,
    linear_dtype,
    norm_dim,
    ref_positions,
    tensor_positions,
)
from autopar.sharding_spec.strategy import OpContext, Strategy, register


def _strategies(ctx: OpContext, ins, out_letters, splittable, partial_options) -> list[Strategy]:
    outs = [(tuple(ctx.out_meta.shape), tuple(out_letters))]
    if not all(linear_dtype(ctx.input_metas[k]) for o in partial_options for k in o):
        partial_options = ()
    return [
        Strategy(c.inputs, c.outputs[0], "index" if c.assign or c.partial_axes else "replicate", c.split_fraction)
        for c in letter_choices(ctx.mesh, ins, outs, splittable=splittable, partial_options=partial_options)
    ]


@register("aten.index.Tensor", "aten._unsafe_index.Tensor")
def index_rule(ctx: OpContext) -> list[Strategy]:
    x = ctx.input_metas[0]
    indices = ctx.arg(1, "indices")
    pos = ref_positions(ctx)
    if not is_tensor_meta(x) or not isinstance(indices, (list, tuple)):
        return []
    idx = {j: pos.get(("args", 1, j), pos.get(("kwargs", "indices", j))) for j, ix in enumerate(indices) if ix is not None}
    metas = {j: ctx.input_metas[p] for j, p in idx.items()}
    if not idx or any(p is None or not is_tensor_meta(m) or m.dtype not in ("int64", "int32") for p, m in zip(idx.values(), metas.values())):
        return []  # boolean masks: data-dependent shapes
    import torch

    b_shape = tuple(torch.broadcast_shapes(*(tuple(m.shape) for m in metas.values())))
    b_letters = tuple(f"b{j}" for j in range(len(b_shape)))
    x_letters = letters_for(len(x.shape))
    kept = [ch if d not in idx else None for d, ch in enumerate(x_letters)]
    first, last = min(idx), max(idx)
    adjacent = sorted(idx) == list(range(first, last + 1))
    if adjacent:
        out_letters = tuple(kept[:first]) + b_letters + tuple(kept[last + 1 :])
    else:
        out_letters = b_letters + tuple(ch for d, ch in enumerate(kept) if d not in idx)
    if len(out_letters) != len(ctx.out_meta.shape):
        return []
    ins = [None] * len(ctx.input_metas)
    ins[0] = (tuple(x.shape), tuple(kept))
    for j, p in idx.items():
        shape = tuple(metas[j].shape)
        off = len(b_shape) - len(shape)
        ins[p] = (shape, tuple(b_letters[off + d] if shape[d] == b_shape[off + d] else None for d in range(len(shape))))
    splittable = [ch for ch in kept if ch] + list(b_letters)
    return _strategies(ctx, ins, out_letters, splittable, [frozenset({0})])


@register("aten.index_select.default")
def index_select_rule(ctx: OpContext) -> list[Strategy]:
    x_shape = ctx.shape_of(0)
    dim = norm_dim(int(ctx.arg(1, "dim")), len(x_shape))
    letters = letters_for(len(x_shape))
    x_letters = tuple(None if d == dim else ch for d, ch in enumerate(letters))
    out_letters = x_letters[:dim] + ("i",) + x_letters[dim + 1 :]
    ins = [(x_shape, x_letters), (ctx.shape_of(1), ("i",) if len(ctx.shape_of(1)) == 1 else (None,) * len(ctx.shape_of(1)))]
    return _strategies(ctx, ins, out_letters, [ch for ch in out_letters if ch], [frozenset({0})])


@register("aten.gather.default")
def gather_rule(ctx: OpContext) -> list[Strategy]:
    x_shape, i_shape = ctx.shape_of(0), ctx.shape_of(1)
    if len(x_shape) != len(i_shape):
        return []
    dim = norm_dim(int(ctx.arg(1, "dim")), len(x_shape))
    letters = letters_for(len(x_shape))
    i_letters = tuple(ch if d == dim or x_shape[d] == i_shape[d] else None for d, ch in enumerate(letters))
    x_letters = tuple(None if d == dim else ch for d, ch in enumerate(i_letters))
    ins = [(x_shape, x_letters), (i_shape, i_letters)] + [None] * (len(ctx.input_metas) - 2)
    return _strategies(ctx, ins, i_letters, [ch for ch in i_letters if ch], [frozenset({0})])


@register("aten.tril.default", "aten.triu.default")
def tri_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    letters = tuple(ch if d < len(shape) - 2 else None for d, ch in enumerate(letters_for(len(shape))))
    return _strategies(ctx, [(shape, letters)], letters, [ch for ch in letters if ch], [frozenset({0})])


@register("aten.pad.default", "aten.constant_pad_nd.default")
def pad_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    pad = list(ctx.arg(1, "pad"))
    nd = len(shape)
    padded = {nd - 1 - j // 2 for j, p in enumerate(pad) if p != 0}
    letters = tuple(None if d in padded else ch for d, ch in enumerate(letters_for(nd)))
    if ctx.node.target == "aten.pad.default":
        zero = ctx.arg(2, "mode", "constant") == "constant" and ctx.arg(3, "value") in (None, 0, 0.0)
    else:
        zero = ctx.arg(2, "value", 0) in (0, 0.0)
    ins = [(shape, letters)] + [None] * (len(ctx.input_metas) - 1)
    return _strategies(ctx, ins, letters, [ch for ch in letters if ch], [frozenset({0})] if zero else [])


@register("aten.diff.default")
def diff_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    nd = len(shape)
    dim = norm_dim(int(ctx.arg(2, "dim", -1)), nd)
    letters = tuple(None if d == dim else ch for d, ch in enumerate(letters_for(nd)))
    ins = [(tuple(m.shape), letters) if is_tensor_meta(m) and len(m.shape) == nd else None for m in ctx.input_metas]
    if any(i is None for i in ins):
        return []
    return _strategies(ctx, ins, letters, [ch for ch in letters if ch], [frozenset(tensor_positions(ctx))])
