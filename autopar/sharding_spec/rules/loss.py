"""Losses: cross_entropy_loss, nll_loss (forward, nd), and elementwise losses (mse, l1, smooth_l1,
huber, binary_cross_entropy_with_logits).

Batch split (the sample dims of input and target split alike, weights whole):
    reduction="none"   the per-sample loss splits like the samples: exact, family "dp".
    reduction="sum"    each rank sums its samples, a pending sum over the batch axes: exact, "dp".
    reduction="mean"   the local op divides by the LOCAL count, which is wrong. Family
                       "loss-batch-split(mean)": codegen must run the op with reduction="sum" and
                       divide by the GLOBAL denominator, leaving a pending sum over the batch axes.
                       The denominator: cross entropy / nll with class-index targets, the sum of
                       weight[target] (1 without weight) over the non-ignored targets of all ranks,
                       an all-reduce (sum) of the local ones over the batch axes; with probability
                       targets and for elementwise losses, the global element count (static).
                       nll_loss_forward's total_weight is a local sum, exact as a pending sum.

Vocabulary (class) split of cross_entropy_loss, family "loss-vocab-parallel" (class-index targets,
no class weight, no label smoothing): the local op cannot compute it. Codegen must lower it, per
sample, with the logits' class dim split over the vocab axes and row offset ``off``::

    m = all_reduce_max(logits_local.max(class_dim))                 # global max
    s = all_reduce_sum(exp(logits_local - m).sum(class_dim))        # global sum of exp
    t = all_reduce_sum(masked pick of logits_local at target - off)  # 0 where not this rank's
    loss = log(s) + m - t   (0 where target == ignore_index), then the reduction as above

so the per-sample loss is replicated over the vocab axes (three all-reduces, which the cost model
must price). Parts of a family are joined with "+". Anything else is replicated.
"""
from __future__ import annotations

import dataclasses

from autopar.sharding_spec.rules._common import (
    broadcast_letters,
    input_pos,
    is_tensor_meta,
    letter_choices,
    letters_for,
    out_metas,
)
from autopar.sharding_spec.strategy import MEAN_SPLIT, VOCAB_LOSS, Family, OpContext, Strategy, register

NONE, MEAN, SUM = 0, 1, 2
_REDUCTION_NAMES = {"none": NONE, "mean": MEAN, "sum": SUM}


def _reduction(value) -> int:
    return _REDUCTION_NAMES[value] if isinstance(value, str) else int(value)


def _family(batch_split: bool, vocab_split: bool, reduction: int) -> Family:
    parts = []
    if batch_split:
        parts.append(MEAN_SPLIT if reduction == MEAN else "dp")
    if vocab_split:
        parts.append(VOCAB_LOSS)
    return Family.of(*parts)


def _class_loss(ctx: OpContext, reduction: int, *, weight_pos, allow_vocab: bool) -> list[Strategy]:
    """cross entropy / nll: input (N, C, d...) or (C,), target (N, d...) or like the input."""
    x, t = ctx.input_metas[0], ctx.input_metas[1]
    if not (is_tensor_meta(x) and is_tensor_meta(t)):
        return []
    x_shape = tuple(x.shape)
    cdim = 1 if len(x_shape) >= 2 else 0
    x_letters = letters_for(len(x_shape))
    cls = x_letters[cdim]
    sample = tuple(ch for d, ch in enumerate(x_letters) if d != cdim)
    probs = tuple(t.shape) == x_shape and t.dtype != "int64" and t.dtype != "int32"
    t_letters = x_letters if probs else sample
    ins = [None] * len(ctx.input_metas)
    ins[0], ins[1] = (x_shape, x_letters), (tuple(t.shape), t_letters)
    if weight_pos is not None:
        w = ctx.input_metas[weight_pos]
        ins[weight_pos] = (tuple(w.shape), (None,) * len(w.shape))
    outs = []
    for k, m in enumerate(out_metas(ctx)):
        if not is_tensor_meta(m):
            outs.append(None)
        elif k == 0 and reduction == NONE:
            outs.append((tuple(m.shape), sample))
        else:  # a reduced loss or total_weight: a scalar, a pending sum over the batch axes
            outs.append((tuple(m.shape), ()))
    if any(o is not None and len(o[0]) != len(o[1]) for o in outs):
        return []
    splittable = list(sample) + ([cls] if allow_vocab and not probs and weight_pos is None else [])
    single = not isinstance(ctx.out_meta, tuple)
    result = []
    for c in letter_choices(ctx.mesh, ins, outs, splittable=splittable):
        vocab_axes = set(c.assign.get(cls, ()))
        outputs = tuple(
            None if o is None else dataclasses.replace(o, partial=tuple(a for a in o.partial if a not in vocab_axes))
            for o in c.outputs
        )
        batch = any(ch in c.assign for ch in sample)
        fam = _family(batch, bool(vocab_axes), reduction)
        result.append(Strategy(c.inputs, outputs[0] if single else outputs, fam, c.split_fraction))
    return result


@register("aten.cross_entropy_loss.default")
def cross_entropy_rule(ctx: OpContext) -> list[Strategy]:
    reduction = _reduction(ctx.arg(3, "reduction", MEAN))
    smoothing = float(ctx.arg(5, "label_smoothing", 0.0) or 0.0)
    return _class_loss(ctx, reduction, weight_pos=input_pos(ctx, 2, "weight"), allow_vocab=smoothing == 0.0)


@register("aten.nll_loss_forward.default", "aten.nll_loss.default", "aten.nll_loss_nd.default",
          "aten.nll_loss2d_forward.default")
def nll_rule(ctx: OpContext) -> list[Strategy]:
    reduction = _reduction(ctx.arg(3, "reduction", MEAN))
    return _class_loss(ctx, reduction, weight_pos=input_pos(ctx, 2, "weight"), allow_vocab=False)


# target -> positional index of reduction
ELEMENTWISE = {
    "aten.mse_loss.default": 2,
    "aten.l1_loss.default": 2,
    "aten.smooth_l1_loss.default": 2,
    "aten.huber_loss.default": 2,
    "aten.binary_cross_entropy_with_logits.default": 4,
    "aten.binary_cross_entropy.default": 3,
}


@register(*ELEMENTWISE)
def elementwise_loss_rule(ctx: OpContext) -> list[Strategy]:
    """loss(input, target, ...): every dim is a sample dim; other tensors broadcast against it."""
    reduction = _reduction(ctx.arg(ELEMENTWISE[ctx.node.target], "reduction", MEAN))
    x_shape = ctx.shape_of(0)
    letters = letters_for(len(x_shape))
    ins = [
        (tuple(m.shape), broadcast_letters(tuple(m.shape), letters, x_shape)) if is_tensor_meta(m) else None
        for m in ctx.input_metas
    ]
    out_shape = tuple(ctx.out_meta.shape)
    outs = [(out_shape, letters if reduction == NONE else ())]
    return [
        Strategy(c.inputs, c.outputs[0], _family(bool(c.assign), False, reduction), c.split_fraction)
        for c in letter_choices(ctx.mesh, ins, outs, splittable=letters)
    ]
