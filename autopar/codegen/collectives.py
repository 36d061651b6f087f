"""Resharding steps run on real process groups, differentiable.

``run_step(x, step, groups)`` applies one ``Step`` of a ``ReshardPlan`` (see
``autopar.sharding_spec.reshard``) to this rank's local shard ``x``; ``run_reshard`` applies a whole
plan. Forward results equal ``autopar.sharding_spec.simulator`` rank for rank, bit for bit: the
simulator is the reference semantics. A step's ``axes`` name its group with the first axis most
significant; torch numbers group members its own way, so every gather, scatter and exchange maps
between the two orders explicitly (``GroupHandle.pg_of_shard``).

Gradients: the dual layout convention
-------------------------------------
The local gradient of a tensor is laid out in the *dual* of its forward layout, per mesh axis:

    forward Shard(d)   ->  gradient Shard(d)      (each rank holds the gradient of its shard)
    forward Replicate  ->  gradient Partial       (the true gradient is the sum over the axis)
    forward Partial    ->  gradient Replicate     (every rank holds the whole gradient)

This is what a replicated parameter's gradient looks like before its data-parallel all-reduce, and
it makes every step's backward another step (or its local mirror image):

    all_gather(G, d)        S -> R    backward: reduce_scatter over G onto dim d       P -> S
    reduce_scatter(G, d)    P -> S    backward: all_gather over G along dim d          S -> R
    all_reduce(G)           P -> R    backward: all_reduce over G                      P -> R
    all_to_all(G, d -> e)   S -> S    backward: all_to_all over G, e -> d              S -> S
    slice(a, d)             R -> S    backward: local; the gradient chunk placed into zeros of
                                      the full local shape at this rank's offset       S -> P
    to_partial(a)           R -> P    backward: local; the gradient kept on group index 0,
                                      zeros elsewhere                                  R -> P

Each kind is a ``torch.autograd.Function`` whose backward applies the row above. Steps over a group
of one rank are identities and skip communication.

On the axes a plan makes *identical* (``Plan.identical_axes``, Megatron's tensor-parallel
convention; see ``autopar.record.gradients``) a replicated value's gradient is whole on every
rank instead, and the steps over those axes take the other backward:

    all_gather        S -> R    backward: this rank's chunk of the whole gradient (local)   R -> S
    all_reduce        P -> R    backward: the identity                                     R -> R
    slice             R -> S    backward: all_gather                                       S -> R
    to_partial        R -> P    backward: the identity                                     R -> R
    reduce_scatter, all_to_all: as above
    grad_sum          R -> R    forward: the identity; backward: all_reduce, where an op
                                that splits the axis left a replicated input a partial gradient

Which torch collective runs each step
-------------------------------------
all_gather: ``all_gather_single``; reduce_scatter: ``reduce_scatter_single``; all_to_all:
``all_to_all_single``; all_reduce: ``all_reduce`` (torch versions before the ``*_single`` names
use ``all_gather_into_tensor`` / ``reduce_scatter_tensor``). gloo in torch 2.13 runs all four
natively. A backend that reports one as unsupported falls back, once and on every rank alike, to an
emulation built from list ``all_gather`` and ``all_reduce``: all_gather via list all_gather,
reduce_scatter via all_reduce plus taking the local chunk, all_to_all via all_gather of the whole
local tensors plus taking the piece addressed to this rank. ``EMULATE`` forces the emulation for
the kinds it names (tests use it).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.codegen.groups import GroupHandle, Groups
from autopar.errors import ShardingError
from autopar.sharding_spec.reshard import STEP_KINDS, ReshardPlan, Step

# Kinds ("all_gather", "reduce_scatter", "all_to_all") to run through the emulation even where the
# backend has the native collective. Backends found lacking one are added here at run time.
EMULATE: set[str] = set()

# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old names.
_all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _unsupported(err: Exception) -> bool:
    """Whether ``err`` says the backend lacks a collective (raised before any data moves)."""
    if isinstance(err, NotImplementedError):
        return True
    text = str(err).lower()
    return "not support" in text or "unsupported" in text or "not implemented" in text


def _run_native(kind: str, native, emulated):
    if kind not in EMULATE:
        try:
            return native()
        except (RuntimeError, NotImplementedError, ValueError) as err:
            if not _unsupported(err):
                raise
            EMULATE.add(kind)
    return emulated()


# ---- raw collectives on local tensors (no autograd) -------------------------------------------
def _to_pg_order(chunks, g: GroupHandle):
    """Chunks indexed by shard index -> the same chunks indexed by torch group rank."""
    return [chunks[i] for i in g.shard_of_pg]


def _to_shard_order(chunks, g: GroupHandle):
    """Chunks indexed by torch group rank -> indexed by shard index."""
    return [chunks[k] for k in g.pg_of_shard]


def all_gather(x: torch.Tensor, dim: int, g: GroupHandle) -> torch.Tensor:
    """Concatenate the group's shards along ``dim`` in shard order. Copies: the input once where
    ``dim`` is not its leading dim (collectives send contiguous memory), the output once unless
    it lands in place (dim 0, shard order = group order)."""
    n = g.size
    xt = x.movedim(dim, 0).contiguous()  # (local_d, ...): dim d in front so chunks are contiguous
    received = {}

    def native():
        out = xt.new_empty((n * xt.shape[0],) + tuple(xt.shape[1:]))
        _all_gather_native(out, xt, group=g.pg)
        received["whole"] = out
        return list(out.chunk(n))

    def emulated():
        bufs = [torch.empty_like(xt) for _ in range(n)]
        dist.all_gather(bufs, xt, group=g.pg)
        return bufs

    pieces = _to_shard_order(_run_native("all_gather", native, emulated), g)
    if dim == 0 and g.same_order and "whole" in received:
        return received["whole"]
    return torch.cat([p.movedim(0, dim) for p in pieces], dim)


def all_reduce(x: torch.Tensor, g: GroupHandle) -> torch.Tensor:
    """The sum over the group, on every member."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=g.pg)
    return out


def reduce_scatter(x: torch.Tensor, dim: int, g: GroupHandle) -> torch.Tensor:
    """The sum over the group, split along ``dim``; this rank keeps chunk ``index``."""
    n = g.size
    if x.shape[dim] % n:
        raise ShardingError(f"reduce_scatter of dim {dim} of size {x.shape[dim]} over {n} ranks is uneven")
    xt = x.movedim(dim, 0)

    def native():
        # a copy even where the chunks are in order already: gloo may reduce into its input
        inp = torch.cat(_to_pg_order(list(xt.chunk(n)), g), 0)
        out = xt.new_empty((xt.shape[0] // n,) + tuple(xt.shape[1:]))
        _reduce_scatter_native(out, inp, group=g.pg)
        return out

    def emulated():
        total = xt.contiguous().clone()
        dist.all_reduce(total, group=g.pg)
        return total.chunk(n)[g.index]

    return _run_native("reduce_scatter", native, emulated).movedim(0, dim).contiguous()


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, g: GroupHandle) -> torch.Tensor:
    """Split along ``dst_dim`` into one piece per member (piece j to shard index j); concatenate
    the pieces received along ``src_dim`` in shard order of their senders."""
    n = g.size
    if x.shape[dst_dim] % n:
        raise ShardingError(f"all_to_all splitting dim {dst_dim} of size {x.shape[dst_dim]} over {n} ranks is uneven")
    pieces = list(x.chunk(n, dim=dst_dim))
    piece_shape = pieces[0].shape
    arrived = {}

    def native():
        # the pieces back to back in group order (the tensor itself where it already is that)
        if dst_dim == 0 and g.same_order and x.is_contiguous():
            inp = x.reshape(-1)
        else:
            inp = torch.cat([p.reshape(-1) for p in _to_pg_order(pieces, g)])
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp, group=g.pg)
        arrived["whole"] = out
        return [p.view(piece_shape) for p in _to_shard_order(list(out.chunk(n)), g)]

    def emulated():
        whole = [torch.empty_like(x.contiguous()) for _ in range(n)]
        dist.all_gather(whole, x.contiguous(), group=g.pg)
        return [w.chunk(n, dim=dst_dim)[g.index] for w in _to_shard_order(whole, g)]

    received = _run_native("all_to_all", native, emulated)
    if src_dim == 0 and g.same_order and "whole" in arrived:  # the pieces arrived back to back, in order
        return arrived["whole"].view((n * piece_shape[0],) + tuple(piece_shape[1:]))
    return torch.cat(received, dim=src_dim)


# ---- autograd Functions, one per step kind ----------------------------------------------------
def all_gather_group(xs, dims, g: GroupHandle) -> list[torch.Tensor]:
    """``all_gather(x, dim, g)`` of every ``x`` in ``xs`` in one collective: each rank sends its
    shards flattened back to back, and each full tensor is cut out of every rank's row."""
    n = g.size
    moved = [x.movedim(d, 0) for x, d in zip(xs, dims)]
    flat = xs[0].new_empty(sum(m.numel() for m in moved))
    off = 0
    for m in moved:  # each shard, its dim in front, straight into the buffer sent (one copy)
        flat[off: off + m.numel()].view(m.shape).copy_(m)
        off += m.numel()
    out = flat.new_empty(n * flat.numel())
    _all_gather_native(out, flat, group=g.pg)
    rows = _to_shard_order(list(out.chunk(n)), g)
    fulls, off = [], 0
    for m, d in zip(moved, dims):
        k = m.numel()
        fulls.append(torch.cat([r[off: off + k].view(m.shape).movedim(0, d) for r in rows], d))
        off += k
    return fulls


def reduce_scatter_group(xs, dims, g: GroupHandle) -> list[torch.Tensor]:
    """``reduce_scatter(x, dim, g)`` of every ``x`` in ``xs`` in one collective (the dual of
    ``all_gather_group``)."""
    n = g.size
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(n)]
    shapes = []
    for x, d in zip(xs, dims):
        if x.shape[d] % n:
            raise ShardingError(f"reduce_scatter of dim {d} of size {x.shape[d]} over {n} ranks is uneven")
        xt = x.movedim(d, 0)
        shapes.append((xt.shape[0] // n,) + tuple(xt.shape[1:]))
        for j, c in enumerate(_to_pg_order(list(xt.chunk(n)), g)):
            per_rank[j].append(c.reshape(-1))
    inp = torch.cat([t for r in per_rank for t in r]).contiguous()
    out = inp.new_empty(inp.numel() // n)
    _reduce_scatter_native(out, inp, group=g.pg)
    shards, off = [], 0
    for shape, d in zip(shapes, dims):
        k = math.prod(shape)
        shards.append(out[off: off + k].view(shape).movedim(0, d).contiguous())
        off += k
    return shards


class AllGatherGroup(torch.autograd.Function):
    """Several shards gathered in one collective (as FSDP gathers a block's parameters); backward:
    their pending-sum gradients reduce-scattered in one collective."""

    @staticmethod
    def forward(ctx, g, dims, *xs):
        ctx.g, ctx.dims = g, dims
        return tuple(all_gather_group(xs, dims, g))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *reduce_scatter_group(grads, ctx.dims, ctx.g))


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return all_gather(x, dim, g)

    @staticmethod
    def backward(ctx, grad):  # P -> S
        return ReduceScatter.apply(grad, ctx.dim, ctx.g), None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return reduce_scatter(x, dim, g)

    @staticmethod
    def backward(ctx, grad):  # S -> R
        return AllGather.apply(grad, ctx.dim, ctx.g), None, None


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return all_reduce(x, g)

    @staticmethod
    def backward(ctx, grad):  # P -> R
        return AllReduce.apply(grad, ctx.g), None


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, g):
        ctx.src_dim, ctx.dst_dim, ctx.g = src_dim, dst_dim, g
        return all_to_all(x, src_dim, dst_dim, g)

    @staticmethod
    def backward(ctx, grad):  # S -> S, the other way
        return AllToAll.apply(grad, ctx.dst_dim, ctx.src_dim, ctx.g), None, None, None


class Slice(torch.autograd.Function):
    """Keep chunk ``index`` of ``n`` along ``dim`` (R -> S); backward pads it back with zeros (S -> P)."""

    @staticmethod
    def forward(ctx, x, dim, index, n):
        if x.shape[dim] % n:
            raise ShardingError(f"slice of dim {dim} of size {x.shape[dim]} into {n} chunks is uneven")
        size = x.shape[dim] // n
        ctx.dim, ctx.start, ctx.size, ctx.full = dim, index * size, size, x.shape
        return x.narrow(dim, index * size, size).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.full)
        full.narrow(ctx.dim, ctx.start, ctx.size).copy_(grad)  # in place: slice_scatter would copy ``full`` again
        return full, None, None, None


class ToPartial(torch.autograd.Function):
    """Group index 0 keeps the value, the others hold zeros (R -> P); backward alike (R -> P)."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.keep = keep
        return x.clone() if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.keep else torch.zeros_like(grad)), None


# ---- the identical-gradient convention (steps over identical axes) -----------------------------
def _chunk(grad: torch.Tensor, dim: int, g: GroupHandle) -> torch.Tensor:
    size = grad.shape[dim] // g.size
    return grad.narrow(dim, g.index * size, size).contiguous()


class AllGatherWhole(AllGather):
    """all_gather whose output gradient is whole on every rank: backward keeps this rank's chunk."""

    @staticmethod
    def backward(ctx, grad):
        return _chunk(grad, ctx.dim, ctx.g), None, None


class AllGatherGroupWhole(AllGatherGroup):
    """``AllGatherGroup`` with whole output gradients: backward keeps each one's chunk."""

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(_chunk(gr, d, ctx.g) for gr, d in zip(grads, ctx.dims)))


class AllReduceWhole(AllReduce):
    """all_reduce (P -> R) whose output gradient is whole: it is the gradient of every summand."""

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SliceWhole(torch.autograd.Function):
    """slice (R -> S) whose input gradient must be whole: backward all-gathers the chunks."""

    @staticmethod
    def forward(ctx, x, dim, g):
        if x.shape[dim] % g.size:
            raise ShardingError(f"slice of dim {dim} of size {x.shape[dim]} into {g.size} chunks is uneven")
        ctx.dim, ctx.g = dim, g
        return _chunk(x, dim, g)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.g), None, None


class ToPartialWhole(ToPartial):
    """to_partial (R -> P) with whole gradients on both sides: backward is the identity."""

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GradShare(torch.autograd.Function):
    """Identity forward; backward keeps the gradient where ``keep`` and zeros it elsewhere: a whole
    gradient becomes a pending share (for a reducer that sums it; the backward seed of an output)."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.keep else torch.zeros_like(grad)), None


class GradSum(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient (Megatron's "f"): an op that splits an
    identical axis gives its replicated input a partial gradient, made whole here."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.g), None


# ---- steps and plans --------------------------------------------------------------------------
def run_step(x: torch.Tensor, step: Step, groups: Groups) -> torch.Tensor:
    """This rank's shard after ``step``, given its shard ``x`` before it. Differentiable."""
    mesh = groups.mesh
    step.before.check_mesh(mesh)
    want = step.before.local_shape(mesh)
    if tuple(x.shape) != want:
        raise ShardingError(
            f"step {step} expects a local shard of shape {want} (spec {step.before} of global shape "
            f"{step.before.shape} on {mesh}) but got {tuple(x.shape)}"
        )
    if step.kind not in STEP_KINDS:
        raise ShardingError(f"unknown resharding step kind {step.kind!r}; expected one of {STEP_KINDS}")
    g = groups.handle(step.axes)
    if g.size == 1:
        return x
    if step.kind == "all_gather":
        return AllGather.apply(x, step.src_dim, g)
    if step.kind == "reduce_scatter":
        return ReduceScatter.apply(x, step.dst_dim, g)
    if step.kind == "all_reduce":
        return AllReduce.apply(x, g)
    if step.kind == "all_to_all":
        return AllToAll.apply(x, step.src_dim, step.dst_dim, g)
    if step.kind == "slice":
        return Slice.apply(x, step.dst_dim, g.index, g.size)
    return ToPartial.apply(x, g.index == 0)


def run_reshard(x: torch.Tensor, plan: ReshardPlan, groups: Groups) -> torch.Tensor:
    """This rank's shard under ``plan.dst``, given its shard under ``plan.src``. Differentiable."""
    for step in plan.steps:
        x = run_step(x, step, groups)
    return x
