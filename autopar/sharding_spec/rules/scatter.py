"""Writes into positions of a tensor: scatter, scatter_add, index_put, index_add / index_copy /
index_fill, slice_scatter and select_scatter. Their in-place forms (``x[:, 1:] = y`` traces as a
``copy_`` into a slice; ``index_put_``, ``scatter_``) take these strategies through the registry's
in-place twins (``strategy.functional_twin``), which keep only those writing where they read.

The written positions are global, so the dims they address stay whole on every operand; every other
dim of the destination may be split, and each source operand is split alike where it has the
destination's size there (whole where it broadcasts):

    scatter(self, dim, index, src)         dims != dim where self, index and src agree in size
    index_put(self, indices, values)       self's dims the indices do not address; values alike
    index_add/copy/fill(self, dim, i, s)   dims != dim (index whole)
    slice_scatter(self, src, dim, ...)     dims != dim
    select_scatter(self, src, dim, i)      dims != dim (src has no dim ``dim``)

Adding writes (scatter_add, index_add, index_put with accumulate=True, slice/select_scatter of a
pending sum into a pending sum) are linear in the destination and the source together, so one
pending sum may pass through both. Family: "index" when anything is split or pending.
"""
from __future__ import annotations

from autopar.sharding_spec.rules._common import (
    broadcast_letters,
    input_pos,
    is_tensor_meta,
    letters_for,
    norm_dim,
    ref_positions,
)
from autopar.sharding_spec.rules.index import _strategies
from autopar.sharding_spec.strategy import OpContext, Strategy, register


def _dest(ctx: OpContext, dim: int | None):
    """(shape, letters) of ``self`` and the output: every dim but ``dim`` splittable."""
    shape = ctx.shape_of(0)
    letters = tuple(None if d == dim else ch for d, ch in enumerate(letters_for(len(shape))))
    return shape, letters


def _same_size(shape, letters, ref_shape):
    """A source operand's letters: the destination's where the sizes agree dim for dim."""
    if len(shape) != len(ref_shape):
        return (None,) * len(shape)
    return tuple(ch if s == r else None for s, r, ch in zip(shape, ref_shape, letters))


def _ins(ctx, dest, extra: dict):
    ins = [None] * len(ctx.input_metas)
    ins[0] = dest
    for p, term in extra.items():
        if p is not None and is_tensor_meta(ctx.input_metas[p]):
            ins[p] = term
    return [t if t is not None or not is_tensor_meta(m) else (tuple(m.shape), (None,) * len(m.shape))
            for t, m in zip(ins, ctx.input_metas)]


@register("aten.scatter.src", "aten.scatter.value", "aten.scatter.reduce", "aten.scatter.value_reduce",
          "aten.scatter_add.default", "aten.scatter_reduce.two")
def scatter_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    dim = norm_dim(int(ctx.arg(1, "dim")), len(shape))
    dest = _dest(ctx, dim)
    i, s = input_pos(ctx, 2, "index"), input_pos(ctx, 3, "src")
    if i is None:
        return []
    i_shape = tuple(ctx.input_metas[i].shape)
    i_letters = _same_size(i_shape, dest[1], shape)
    extra = {i: (i_shape, i_letters)}
    if s is not None:  # src is read at the index's positions: split where the index is
        s_shape = tuple(ctx.input_metas[s].shape)
        s_letters = tuple(ch if j < len(i_shape) and s_shape[j] == i_shape[j] else None for j, ch in enumerate(i_letters))
        extra[s] = (s_shape, s_letters + (None,) * (len(s_shape) - len(s_letters)))
    adds = ctx.node.target == "aten.scatter_add.default" or ctx.arg(4, "reduce") == "sum"
    partial = [frozenset({0, s})] if adds and s is not None else []
    return _strategies(ctx, _ins(ctx, dest, extra), dest[1], [c for c in dest[1] if c], partial)


@register("aten.index_put.default", "aten._unsafe_index_put.default")
def index_put_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    indices = ctx.arg(1, "indices")
    if not isinstance(indices, (list, tuple)) or not any(ix is not None for ix in indices):
        return []
    addressed = {d for d, ix in enumerate(indices) if ix is not None}
    # x[indices] ends with the dims after the last addressed one, in order, whatever the indices
    # do in front; values broadcast against it from the right. Those dims may split.
    last = max(addressed, default=-1)
    letters = tuple(ch if d > last else None for d, ch in enumerate(letters_for(len(shape))))
    dest = (shape, letters)
    v = input_pos(ctx, 2, "values")
    extra = {}
    if v is not None:
        v_shape = tuple(ctx.input_metas[v].shape)
        extra[v] = (v_shape, broadcast_letters(v_shape, letters[last + 1:], shape[last + 1:]))
    pos = ref_positions(ctx)
    for j, ix in enumerate(indices):
        p = pos.get(("args", 1, j), pos.get(("kwargs", "indices", j)))
        if p is not None:
            extra[p] = (tuple(ctx.input_metas[p].shape), (None,) * len(ctx.input_metas[p].shape))
    accumulate = bool(ctx.arg(3, "accumulate", False))
    partial = [frozenset({0, v})] if accumulate and v is not None else []
    return _strategies(ctx, _ins(ctx, dest, extra), dest[1], [c for c in dest[1] if c], partial)


@register("aten.index_add.default", "aten.index_copy.default", "aten.index_fill.int_Scalar",
          "aten.index_fill.int_Tensor")
def index_along_dim_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    dim = norm_dim(int(ctx.arg(1, "dim")), len(shape))
    dest = _dest(ctx, dim)
    extra = {input_pos(ctx, 2, "index"): None}
    src = input_pos(ctx, 3, "source")
    if src is not None and ctx.node.target != "aten.index_fill.int_Tensor":
        s_shape = tuple(ctx.input_metas[src].shape)
        extra[src] = (s_shape, _same_size(s_shape, dest[1], shape))
    partial = [frozenset({0, src})] if ctx.node.target == "aten.index_add.default" and src is not None else []
    return _strategies(ctx, _ins(ctx, dest, extra), dest[1], [c for c in dest[1] if c], partial)


@register("aten.slice_scatter.default", "aten.select_scatter.default")
def slice_scatter_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    dim = norm_dim(int(ctx.arg(2, "dim", 0)), len(shape))
    dest = _dest(ctx, dim)
    src = input_pos(ctx, 1, "src")
    extra = {}
    if src is not None:
        s_shape = tuple(ctx.input_metas[src].shape)
        if ctx.node.target == "aten.select_scatter.default":
            letters = dest[1][:dim] + dest[1][dim + 1:]
            extra[src] = (s_shape, _same_size(s_shape, letters, shape[:dim] + shape[dim + 1:]))
        else:
            extra[src] = (s_shape, _same_size(s_shape, dest[1], shape))
    partial = [frozenset({0, src})] if src is not None else []
    return _strategies(ctx, _ins(ctx, dest, extra), dest[1], [c for c in dest[1] if c], partial)
