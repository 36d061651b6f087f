"""Shared machinery of the non-matmul rules: argument access, a letter-driven enumerator and the
table of size arguments that codegen rewrites to local sizes.

Most ops are described by letters, as an einsum is: every tensor dim that must stay split the same
way on every tensor carries the same letter, a dim that must stay whole carries None. The enumerator
assigns each active mesh axis to one splittable letter, to nothing, or to a pending sum, and builds
the specs. A pending sum is an option only where the op is linear in some of its inputs: each
``partial_options`` entry names the inputs that carry the axis' pending sum together (add: all of
them; mul: any one). An axis on a letter that no output carries leaves a pending sum in the output
(a split contraction, e.g. sum over a split dim).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterator, Sequence

from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import OpContext, active_axes

Letters = tuple  # tuple[str | None, ...], one entry per tensor dim
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


# ---- arguments ----------------------------------------------------------------------------------
def ref_positions(ctx: OpContext) -> dict[tuple, int]:
    """Where each NodeRef of the args sits in ``node.inputs``: path -> position. A path is
    ``("args", i)`` / ``("args", i, j)`` for an entry of a list argument / ``("kwargs", name)``.
    The IR lists references depth-first, args then kwargs, so the n-th reference is input n."""
    out: dict[tuple, int] = {}

    def walk(value, path):
        if type(value).__name__ == "NodeRef":
            out[path] = len(out)
        elif isinstance(value, (list, tuple)):
            for j, v in enumerate(value):
                walk(v, path + (j,))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, path + (k,))

    for i, a in enumerate(ctx.node.args):
        walk(a, ("args", i))
    for k, v in ctx.node.kwargs.items():
        walk(v, ("kwargs", k))
    return out


def input_pos(ctx: OpContext, i: int, name: str | None = None) -> int | None:
    """Position in ``node.inputs`` of the tensor passed as positional arg ``i`` (or keyword ``name``),
    None when that argument is not a tensor or not given."""
    pos = ref_positions(ctx)
    if ("args", i) in pos:
        return pos[("args", i)]
    if name is not None and ("kwargs", name) in pos:
        return pos[("kwargs", name)]
    return None


def is_tensor_meta(meta) -> bool:
    return meta is not None and hasattr(meta, "shape") and not isinstance(meta, tuple)


def tensor_positions(ctx: OpContext) -> list[int]:
    return [k for k, m in enumerate(ctx.input_metas) if is_tensor_meta(m)]


def out_metas(ctx: OpContext) -> list:
    """The output metas as a list (one entry per output; None for a non-tensor output)."""
    m = ctx.out_meta
    if isinstance(m, tuple):
        return list(m)
    return [m]


def norm_dim(d: int, ndim: int) -> int:
    return d + max(ndim, 1) if d < 0 else d


def dims_arg(value, ndim: int) -> list[int] | None:
    """A dim or list of dims, normalized and sorted; None or [] means every dim."""
    if value is None:
        return None
    if isinstance(value, int):
        value = [value]
    if len(value) == 0:
        return None
    return sorted({norm_dim(int(d), ndim) for d in value})


def linear_dtype(meta) -> bool:
    """Whether a pending sum of this tensor is meaningful (numbers, not booleans)."""
    return is_tensor_meta(meta) and meta.dtype != "bool"


def letters_for(n: int, offset: int = 0) -> tuple[str, ...]:
    return tuple(f"d{offset + j}" for j in range(n))


def broadcast_letters(shape: Sequence[int], ref_letters: Letters, ref_shape: Sequence[int]) -> Letters:
    """Letters of an operand broadcast against ``ref_shape`` (right-aligned): a dim of the same
    size shares the reference letter, a size-1 (broadcast) dim stays whole."""
    off = len(ref_shape) - len(shape)
    return tuple(ref_letters[off + j] if off + j >= 0 and shape[j] == ref_shape[off + j] else None for j in range(len(shape)))


# ---- the enumerator -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Choice:
    """One enumerated strategy before it becomes a Strategy: specs plus what each axis does."""

    inputs: tuple[ShardingSpec | None, ...]
    outputs: tuple[ShardingSpec | None, ...]
    assign: dict  # letter -> mesh axes splitting it (mesh order)
    partial_axes: tuple[int, ...]  # axes holding a pending sum carried from the inputs
    split_fraction: float  # 1 / ranks sharing one piece of the work

    def output(self, single: bool):
        return self.outputs[0] if single else tuple(self.outputs)


def letter_choices(
    mesh,
    ins: Sequence[tuple[Sequence[int], Letters] | None],
    outs: Sequence[tuple[Sequence[int], Letters] | None],
    *,
    splittable: Sequence[str],
    partial_options: Sequence[frozenset[int]] = (),
    partial_outputs: Sequence[int] | None = None,
    reduced_partial_outputs: Sequence[int] | None = None,
) -> Iterator[Choice]:
    """Every assignment of active mesh axes to a splittable letter, nothing, or a pending sum
    (option k: inputs ``partial_options[k]`` carry it, and the outputs ``partial_outputs``, default
    all). A letter no output carries is a contraction: its axes become pending sums on the outputs
    ``reduced_partial_outputs`` (default all). Splits must be even on every tensor carrying the letter."""
    sizes: dict[str, list[int]] = {}
    for t in list(ins) + list(outs):
        if t is None:
            continue
        for s, ch in zip(t[0], t[1]):
            if ch is not None:
                sizes.setdefault(ch, []).append(int(s))
    letters = [ch for ch in dict.fromkeys(splittable) if ch in sizes]
    out_letters = {ch for t in outs if t is not None for ch in t[1] if ch is not None}
    n_out = len(outs)
    p_outs = set(range(n_out) if partial_outputs is None else partial_outputs)
    r_outs = set(range(n_out) if reduced_partial_outputs is None else reduced_partial_outputs)
    act = active_axes(mesh)
    options = [None] + [("L", ch) for ch in letters] + [("P", k) for k in range(len(partial_options))]
    for combo in itertools.product(options, repeat=len(act)):
        assign: dict[str, tuple[int, ...]] = {}
        carried: dict[int, list[int]] = {}  # input -> partial axes
        out_partial: dict[int, list[int]] = {o: [] for o in range(n_out)}
        p_axes = []
        for axis, opt in zip(act, combo):
            if opt is None:
                continue
            if opt[0] == "L":
                assign[opt[1]] = assign.get(opt[1], ()) + (axis,)
                if opt[1] not in out_letters:
                    for o in r_outs:
                        out_partial[o].append(axis)
            else:
                p_axes.append(axis)
                for i in partial_options[opt[1]]:
                    carried.setdefault(i, []).append(axis)
                for o in p_outs:
                    out_partial[o].append(axis)
        if any(s % mesh.axes_size(axes) for ch, axes in assign.items() for s in sizes[ch]):
            continue
        in_specs = tuple(
            None if t is None else _spec(t, assign, carried.get(i, ()), mesh) for i, t in enumerate(ins)
        )
        out_specs = tuple(None if t is None else _spec(t, assign, out_partial[o], mesh) for o, t in enumerate(outs))
        frac = 1.0 / math.prod(mesh.shape[a] for axes in assign.values() for a in axes)
        yield Choice(in_specs, out_specs, assign, tuple(p_axes), frac)


def _spec(term, assign, partial, mesh) -> ShardingSpec:
    shape, letters = term
    dims = tuple(assign.get(ch, ()) if ch is not None else () for ch in letters)
    return ShardingSpec(tuple(shape), dims, tuple(partial), mesh.ndim)


def is_split(choice: Choice) -> bool:
    return bool(choice.assign) or bool(choice.partial_axes)


# ---- size arguments codegen rewrites ------------------------------------------------------------
# target -> (positional index, keyword name) of a size list that describes the OUTPUT shape. Codegen
# (and the rule tests) replace it with the output's local shape, so every rank builds its shard.
LOCAL_SIZE_ARGS: dict[str, tuple[int, str]] = {
    "aten.view.default": (1, "size"),
    "aten._unsafe_view.default": (1, "size"),
    "aten.reshape.default": (1, "shape"),
    "aten.expand.default": (1, "size"),
    "aten.new_ones.default": (1, "size"),
    "aten.new_zeros.default": (1, "size"),
    "aten.new_empty.default": (1, "size"),
    "aten.new_full.default": (1, "size"),
    "aten.ones.default": (0, "size"),
    "aten.zeros.default": (0, "size"),
    "aten.empty.memory_format": (0, "size"),
    "aten.full.default": (0, "size"),
}


def localize_args(target: str, args: tuple, kwargs: dict, out_spec, mesh) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with global size arguments replaced by local ones for ``out_spec`` (the
    op's output spec). Only the targets in LOCAL_SIZE_ARGS, ``aten.unflatten.int`` and a whole-dim
    ``aten.narrow.default`` (its length) have any; every
    other argument of a sharded op is the same on every rank as in the single-device graph."""
    args, kwargs = tuple(args), dict(kwargs)
    if target == "aten.narrow.default" and len(args) > 3:
        # A narrow that keeps a split dim whole (the rule allows no other): its length is local.
        dim = norm_dim(int(args[1]), len(out_spec.shape))
        if out_spec.dim_axes[dim]:
            args = args[:3] + (out_spec.local_shape(mesh)[dim],) + args[4:]
        return args, kwargs
    if target == "aten.unflatten.int":
        dim = norm_dim(int(args[1]), len(out_spec.shape) - len(args[2]) + 1)
        local = out_spec.local_shape(mesh)
        args = args[:2] + (list(local[dim : dim + len(args[2])]),) + args[3:]
        return args, kwargs
    if target not in LOCAL_SIZE_ARGS:
        return args, kwargs
    i, name = LOCAL_SIZE_ARGS[target]
    local = list(out_spec.local_shape(mesh))
    if i < len(args):
        args = args[:i] + (local,) + args[i + 1 :]
    else:
        kwargs[name] = local
    return args, kwargs
