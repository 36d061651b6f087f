"""Shape ops: view / reshape / flatten / unflatten, permute / transpose, expand, unsqueeze / squeeze,
slice / select / narrow, split / chunk / unbind and the getitem that follows, cat / stack.

Every one is linear, so a pending sum always passes through. Splits follow the dims:

    view, reshape     dims are grouped into runs whose sizes multiply alike on both sides; in a run
                      only the major (first non-1) dim may be split, and its split carries over to
                      the major output dim of the run when that dim divides by the ranks (a shard of
                      the major dim is a contiguous range of the run's elements). Codegen rewrites
                      the size argument to the local shape (rules._common.LOCAL_SIZE_ARGS).
    permute etc.      the split moves with its dim.
    expand            an expanded (or new) dim may be split on the output while the input is read
                      whole there: every rank expands to its local size. broadcast_tensors alike.
    squeeze           a split dim must not have local size 1, else the local squeeze would drop it.
    slice, narrow     the sliced dim stays whole unless the slice takes all of it.
    select            the selected dim stays whole.
    split, chunk      the split dim stays whole; getitem passes its element's spec through.
    cat, stack        the cat dim (the new dim) stays whole, all inputs alike elsewhere.

Family: "view" when anything is split or pending, else "replicate".
"""
from __future__ import annotations

import math

from autopar.sharding_spec.rules._common import (
    broadcast_letters,
    is_tensor_meta,
    letter_choices,
    letters_for,
    norm_dim,
    out_metas,
    tensor_positions,
)
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import OpContext, Strategy, enumerate_specs, register

ALL_IN = [frozenset({0})]


def _fam(c) -> str:
    return "view" if c.assign or c.partial_axes else "replicate"


def mapped(ctx: OpContext, in_letters, out_letters_list, *, partial=True, check=None) -> list[Strategy]:
    """Strategies of a one-input shape op given its letters (None = whole); ``check(choice)``
    rejects choices the local op would get wrong."""
    x = ctx.input_metas[0]
    ins = [(tuple(x.shape), tuple(in_letters))] + [None] * (len(ctx.input_metas) - 1)
    outs = [None if o is None else (tuple(m.shape), tuple(o)) for m, o in zip(out_metas(ctx), out_letters_list)]
    single = not isinstance(ctx.out_meta, tuple)
    splittable = [ch for ch in in_letters if ch] + [ch for o in out_letters_list if o for ch in o if ch]
    return [
        Strategy(c.inputs, c.output(single), _fam(c), c.split_fraction)
        for c in letter_choices(ctx.mesh, ins, outs, splittable=splittable, partial_options=ALL_IN if partial else ())
        if check is None or check(c)
    ]


# ---- view / reshape --------------------------------------------------------------------------------
def view_groups(a, b) -> list[tuple[list[int], list[int]]] | None:
    """Runs of dims of shapes ``a`` and ``b`` (same numel) whose sizes multiply alike."""
    if 0 in a or 0 in b or math.prod(a) != math.prod(b):
        return None
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            pa, i = a[i], i + 1
            gi.append(i - 1)
        if j < len(b):
            pb, j = b[j], j + 1
            gj.append(j - 1)
        while pa != pb:
            if pa < pb:
                pa, i = pa * a[i], i + 1
                gi.append(i - 1)
            else:
                pb, j = pb * b[j], j + 1
                gj.append(j - 1)
        groups.append((gi, gj))
    return groups


def _major(dims, shape):
    return next((d for d in dims if shape[d] != 1), None)


def reshape_spec(spec: ShardingSpec, out_shape, mesh) -> ShardingSpec | None:
    """The output spec of viewing a tensor with ``spec`` as ``out_shape``, or None if the local view
    would not produce a shard of the global one."""
    groups = view_groups(spec.shape, tuple(out_shape))
    if groups is None:
        return None
    out_axes = [()] * len(out_shape)
    for gi, gj in groups:
        mi, mj = _major(gi, spec.shape), _major(gj, out_shape)
        for d in gi:
            axes = spec.dim_axes[d]
            if not axes:
                continue
            if d != mi or mj is None or out_shape[mj] % mesh.axes_size(axes):
                return None
            out_axes[mj] = axes
    return ShardingSpec(tuple(out_shape), tuple(out_axes), spec.partial, spec.mesh_ndim)


@register("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
          "aten.flatten.using_ints", "aten.unflatten.int")
def reshape_rule(ctx: OpContext) -> list[Strategy]:
    x, out_shape = ctx.input_metas[0], tuple(ctx.out_meta.shape)
    out = []
    for spec in enumerate_specs(tuple(x.shape), ctx.mesh, partial=linear(x)):
        o = reshape_spec(spec, out_shape, ctx.mesh)
        if o is not None:
            frac = 1.0 / math.prod(ctx.mesh.shape[a] for ax in spec.dim_axes for a in ax)
            ins = (spec,) + (None,) * (len(ctx.input_metas) - 1)
            out.append(Strategy(ins, o, "replicate" if spec.is_replicated else "view", frac))
    return out


def linear(meta) -> bool:
    return is_tensor_meta(meta) and meta.dtype != "bool"


# ---- permutations, expand, unsqueeze, squeeze -----------------------------------------------------
@register("aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.swapaxes.default",
          "aten.movedim.int", "aten.numpy_T.default")
def permute_rule(ctx: OpContext) -> list[Strategy]:
    nd = len(ctx.shape_of(0))
    letters = letters_for(nd)
    t = ctx.node.target
    if t == "aten.permute.default":
        perm = [norm_dim(int(d), nd) for d in ctx.arg(1, "dims")]
    else:
        perm = list(range(nd))
        if t in ("aten.t.default", "aten.numpy_T.default"):
            perm = perm[::-1]
        else:
            a, b = norm_dim(int(ctx.arg(1)), nd), norm_dim(int(ctx.arg(2)), nd)
            if t == "aten.movedim.int":
                perm.remove(a)
                perm.insert(b, a)
            else:
                perm[a], perm[b] = perm[b], perm[a]
    return mapped(ctx, letters, [tuple(letters[p] for p in perm)], partial=linear(ctx.input_metas[0]))


@register("aten.expand.default", "aten.expand_copy.default")
def expand_rule(ctx: OpContext) -> list[Strategy]:
    out_shape = tuple(ctx.out_meta.shape)
    letters = letters_for(len(out_shape))
    in_letters = broadcast_letters(ctx.shape_of(0), letters, out_shape)
    return mapped(ctx, in_letters, [letters], partial=linear(ctx.input_metas[0]))


@register("aten.broadcast_tensors.default")
def broadcast_tensors_rule(ctx: OpContext) -> list[Strategy]:
    """Every output has the broadcast shape; each input is split like the output dims it has in
    full (no pending sums: each output would carry only its own input's)."""
    outs = out_metas(ctx)
    if not outs or not all(is_tensor_meta(m) for m in outs):
        return []
    shape = tuple(outs[0].shape)
    letters = letters_for(len(shape))
    ins = [(tuple(m.shape), broadcast_letters(tuple(m.shape), letters, shape)) if is_tensor_meta(m) else None
           for m in ctx.input_metas]
    return [
        Strategy(c.inputs, c.output(False), _fam(c), c.split_fraction)
        for c in letter_choices(ctx.mesh, ins, [(shape, letters)] * len(outs), splittable=letters)
    ]


@register("aten.unsqueeze.default")
def unsqueeze_rule(ctx: OpContext) -> list[Strategy]:
    nd = len(ctx.shape_of(0))
    d = norm_dim(int(ctx.arg(1, "dim")), nd + 1)
    letters = letters_for(nd)
    return mapped(ctx, letters, [letters[:d] + (None,) + letters[d:]], partial=linear(ctx.input_metas[0]))


@register("aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims")
def squeeze_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    nd = len(shape)
    letters = letters_for(nd)
    dims = ctx.arg(1, "dim")
    cand = range(nd) if dims is None else [norm_dim(int(d), nd) for d in ([dims] if isinstance(dims, int) else dims)]
    gone = {d for d in cand if shape[d] == 1}
    mesh = ctx.mesh

    def keeps_local_dims(c) -> bool:  # a split candidate dim of local size 1 would be squeezed
        return all(shape[d] // mesh.axes_size(c.assign.get(letters[d], ())) != 1 for d in cand if d not in gone)

    out_letters = tuple(ch for d, ch in enumerate(letters) if d not in gone)
    return mapped(ctx, letters, [out_letters], partial=linear(ctx.input_metas[0]), check=keeps_local_dims)


# ---- slicing -------------------------------------------------------------------------------------------
def _slice_is_full(size, start, end, step) -> bool:
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return max(start, 0) == 0 and end >= size and (step or 1) == 1


@register("aten.slice.Tensor", "aten.narrow.default", "aten.select.int")
def slice_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    nd = len(shape)
    letters = letters_for(nd)
    t = ctx.node.target
    dim = norm_dim(int(ctx.arg(1, "dim", 0)), nd)
    if t == "aten.slice.Tensor":
        full = _slice_is_full(shape[dim], ctx.arg(2, "start"), ctx.arg(3, "end"), ctx.arg(4, "step", 1))
    elif t == "aten.narrow.default":
        full = _slice_is_full(shape[dim], ctx.arg(2, "start"), ctx.arg(2, "start") + ctx.arg(3, "length"), 1)
    else:
        full = False
    if any(not isinstance(a, (int, type(None))) for a in ctx.node.args[1:]):
        return []  # a slice bound computed at run time
    in_letters = letters if full else tuple(None if d == dim else ch for d, ch in enumerate(letters))
    out_letters = in_letters if t != "aten.select.int" else in_letters[:dim] + in_letters[dim + 1 :]
    return mapped(ctx, in_letters, [out_letters], partial=linear(ctx.input_metas[0]))


@register("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.unbind.int",
          "aten.tensor_split.sections")
def split_rule(ctx: OpContext) -> list[Strategy]:
    shape = ctx.shape_of(0)
    nd = len(shape)
    letters = letters_for(nd)
    unbind = ctx.node.target == "aten.unbind.int"
    dim = norm_dim(int(ctx.arg(1 if unbind else 2, "dim", 0)), nd)
    in_letters = tuple(None if d == dim else ch for d, ch in enumerate(letters))
    out_l = in_letters[:dim] + in_letters[dim + 1 :] if unbind else in_letters
    return mapped(ctx, in_letters, [out_l] * len(out_metas(ctx)), partial=linear(ctx.input_metas[0]))


@register("operator.getitem")
def getitem_rule(ctx: OpContext) -> list[Strategy]:
    """getitem(tuple_value, i): its input spec is the spec of element i (what it reads)."""
    src, i = ctx.input_metas[0], ctx.arg(1)
    if not isinstance(src, tuple) or not isinstance(i, int) or not is_tensor_meta(src[i]):
        return []
    out = []
    for spec in enumerate_specs(tuple(src[i].shape), ctx.mesh, partial=linear(src[i])):
        fam = "replicate" if spec.is_replicated else "view"
        out.append(Strategy((spec,), spec, fam, 1.0 / math.prod(ctx.mesh.shape[a] for ax in spec.dim_axes for a in ax)))
    return out


# ---- joining -------------------------------------------------------------------------------------------
@register("aten.cat.default", "aten.stack.default", "aten.concat.default", "aten.concatenate.default")
def cat_rule(ctx: OpContext) -> list[Strategy]:
    out_shape = tuple(ctx.out_meta.shape)
    nd = len(out_shape)
    letters = letters_for(nd)
    stack = ctx.node.target == "aten.stack.default"
    dim = norm_dim(int(ctx.arg(1, "dim", 0)), nd)
    out_letters = tuple(None if d == dim else ch for d, ch in enumerate(letters))
    in_letters = out_letters[:dim] + out_letters[dim + 1 :] if stack else out_letters
    tensors = tensor_positions(ctx)
    ins = []
    for k, m in enumerate(ctx.input_metas):
        if not is_tensor_meta(m):
            ins.append(None)
        elif len(m.shape) != len(in_letters):
            return []  # a legacy empty 1-d input
        else:
            ins.append((tuple(m.shape), in_letters))
    opts = [frozenset(tensors)] if all(linear(ctx.input_metas[k]) for k in tensors) else []
    return [
        Strategy(c.inputs, c.outputs[0], _fam(c), c.split_fraction)
        for c in letter_choices(ctx.mesh, ins, [(out_shape, out_letters)], splittable=letters, partial_options=opts)
    ]
