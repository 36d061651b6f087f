"""Lowerings of the strategy families the local ATen op does not compute (``LOWERED_FAMILIES`` in
``autopar.sharding_spec.strategy``); each follows the recipe documented in its rule:

    embedding-vocab-parallel   rules/embedding.py: masked lookup with the rank's row offset; the
                               output is a pending sum over the vocabulary axes.
    loss-batch-split(mean)     rules/loss.py: the op with reduction="sum", divided by the GLOBAL
                               denominator; a pending sum over the batch axes. Cross entropy
                               over class indices runs fused (``WholeClassCrossEntropy``:
                               torch's log_softmax kernel, the gradient made in place of its
                               output): ATen's makes three logits-sized tensors, whose
                               allocation and page faults cost more than the op. A cross
                               entropy on whole classes in another family runs the same
                               (``autopar_cross_entropy``, chosen by ``codegen.lower``).
    loss-vocab-parallel        rules/loss.py: cross entropy over split classes (Megatron-style
                               max / sum-exp / target-logit all-reduces); replicated over them.
    ring, ring(causal)         rules/attention.py: scaled dot-product attention of the rank's
                               sequence shard over the whole sequence (``ring_attention``).

``lowering(node, node_plan, graph)`` says which function runs a node and with which extra keywords;
an unknown lowered family is a ``PlanError`` at codegen time, never wrong numbers at run time. The
functions here run on local shards inside ``ops.bind(groups)`` and are differentiable under the
dual-layout convention (their all-reduces are ``collectives.AllReduce``: P -> R, backward P -> R).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.codegen.ops import autopar_all_reduce, handle
from autopar.codegen.ring_attention import ring_attention
from autopar.record.gradients import whole_on
from autopar.errors import PlanError
from autopar.ir.graph import call_arg
from autopar.ir.losses import CLASS_LOSSES, fused_cross_entropy
from autopar.sharding_spec.rules import attention as attention_rule
from autopar.sharding_spec.rules import loss as loss_rule
from autopar.sharding_spec.strategy import MEAN_PARTIAL, MEAN_SPLIT, VOCAB_EMBEDDING, VOCAB_LOSS

SUM = 2
CROSS_ENTROPY = "aten.cross_entropy_loss.default"
# the positional index of ``reduction`` per loss op
REDUCTION_POS = {t: 3 for t in CLASS_LOSSES} | dict(loss_rule.ELEMENTWISE)


def _aten(target: str):
    _, name, overload = target.split(".")
    return getattr(getattr(torch.ops.aten, name), overload)


def _with_arg(args, kwargs, i, name, value):
    args, kwargs = list(args), dict(kwargs)
    if i < len(args):
        args[i] = value
    else:
        kwargs[name] = value
    return tuple(args), kwargs


# ---- vocabulary-parallel embedding ----------------------------------------------------------------
def autopar_vocab_parallel_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, *,
                                     vocab_axes):
    """embedding over a row shard of the table: rows this rank holds are looked up, the others
    give zeros, so the ranks of the vocabulary axes hold a pending sum of the full lookup."""
    rows = weight.shape[0]
    off = handle(vocab_axes).index * rows
    local = indices - off
    hit = (local >= 0) & (local < rows)
    pad = padding_idx - off if padding_idx is not None and 0 <= padding_idx - off < rows else -1
    out = torch.ops.aten.embedding.default(weight, local.masked_fill(~hit, 0), pad, scale_grad_by_freq, sparse)
    return out.masked_fill(~hit.unsqueeze(-1), 0)


# ---- losses --------------------------------------------------------------------------------------
def _sum_over(x: torch.Tensor, axes) -> torch.Tensor:
    """Differentiable all-reduce (sum) over ``axes``; the identity when there are none."""
    return autopar_all_reduce(x, axes) if axes else x


def class_denominator(target, weight, ignore_index, dtype, batch_axes, whole_target=None):
    """The mean denominator of a class-index loss: the sum of weight[target] (1 without a weight)
    over the non-ignored targets of every rank of the batch axes. ``whole_target``: the whole
    batch's targets, recomputed by the program from the user inputs (``ir.losses.counted_from_inputs``):
    counted here, without the all-reduce."""
    if whole_target is not None:
        target, batch_axes = whole_target, ()
    valid = target != ignore_index
    if weight is None:
        local = valid.sum().to(dtype)
    else:
        local = (weight[target.masked_fill(~valid, 0)] * valid).sum()
    return _sum_over(local, batch_axes)


def autopar_loss_global_mean(op: str, args, kwargs, *, batch_axes, count=None, whole_target=None, fused=False):
    """A mean-reduced loss over a batch split across ``batch_axes``: ``op`` with reduction="sum",
    divided by the global denominator (``count`` when static, else the weighted count of valid
    targets: of ``whole_target`` where the program has it, else all-reduced). A pending sum over
    ``batch_axes``; further outputs (nll's total_weight) are local sums, already pending sums.
    ``fused``: a cross entropy ``ir.losses.fused_cross_entropy`` runs fused."""
    if fused:  # one logits-sized tensor instead of three
        target, ignore_index = args[1], call_arg(args, kwargs, 4, "ignore_index", -100)
        loss = WholeClassCrossEntropy.apply(_as_autocast_loss_input(args[0]), target, ignore_index).sum()
        return loss / class_denominator(target, None, ignore_index, loss.dtype, batch_axes, whole_target)
    args, kwargs = _with_arg(args, kwargs, REDUCTION_POS[op], "reduction", SUM)
    out = _aten(op)(*args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    if count is not None:
        loss = loss / count
    else:
        target, weight = args[1], call_arg(args, kwargs, 2, "weight")
        loss = loss / class_denominator(target, weight, call_arg(args, kwargs, 4, "ignore_index", -100), loss.dtype,
                                        batch_axes, whole_target)
    return (loss, *out[1:]) if isinstance(out, tuple) else loss


def _as_autocast_loss_input(x: torch.Tensor) -> torch.Tensor:
    """The logits as autocast hands them to cross_entropy, an op it runs in float32: upcast when
    autocast is on for their device (a custom autograd Function is outside autocast's op lists;
    meta tensors, a dry run's, have no autocast)."""
    if x.dtype in (torch.float16, torch.bfloat16) and x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
        return x.float()
    return x


def autopar_cross_entropy(x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """``aten.cross_entropy_loss`` on whole classes where ``ir.losses.fused_cross_entropy`` holds
    (no class weight, no label smoothing; its arguments as ATen's), fused: forward keeps the
    log-probabilities, backward makes the logits' gradient in place of them."""
    per_sample = WholeClassCrossEntropy.apply(_as_autocast_loss_input(x), target, ignore_index)
    if reduction == loss_rule.NONE:
        return per_sample
    total = per_sample.sum()
    return total if reduction == SUM else total / class_denominator(target, None, ignore_index, total.dtype, ())


def autopar_vocab_parallel_cross_entropy(x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0, *,
                                         class_axes, batch_axes, whole: bool = False, whole_target=None):
    """cross_entropy with the class dim of ``x`` split over ``class_axes``: the per-sample loss
    log(sum exp(x - m)) + m - x[target] (``VocabParallelCrossEntropy``), replicated over the class
    axes; then ``reduction`` (mean: over the global count of valid targets, of ``whole_target``
    where the program has it). ``whole``: the class axes are identical-gradient axes (the loss's
    gradient arrives whole, not as a pending sum)."""
    if weight is not None or label_smoothing:
        raise PlanError("vocabulary-parallel cross entropy supports no class weight and no label smoothing")
    loss = VocabParallelCrossEntropy.apply(_as_autocast_loss_input(x), target, ignore_index, handle(class_axes), whole)
    if reduction == 0:
        return loss
    if reduction == SUM:
        return loss.sum()
    return loss.sum() / class_denominator(target, None, ignore_index, loss.dtype, batch_axes, whole_target)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-sample cross entropy over class-split logits, fused as Megatron fuses it: forward keeps
    one logits-sized tensor (the softmax, made in place from x - max) and three all-reduces of one
    value per sample (max, sum of exp, target logit); backward is (softmax - one_hot) * grad in
    place of that tensor, after one all-reduce of the per-sample gradient, which arrives as a
    pending sum over the class axes (the output is replicated there; see collectives.py). Written
    by autograd op by op instead, backward makes three more logits-sized tensors."""

    @staticmethod
    def forward(ctx, x, target, ignore_index, g, whole=False):
        cdim = 1 if x.dim() >= 2 else 0
        classes = x.shape[cdim]
        local_t = target - g.index * classes
        valid = target != ignore_index
        hit = (local_t >= 0) & (local_t < classes) & valid
        local_t = local_t.clamp(0, classes - 1).unsqueeze(cdim)
        m = x.amax(cdim, keepdim=True)
        soft = x - m  # (before the max is global: the local max keeps exp in range on any rank)
        picked = torch.where(hit, x.gather(cdim, local_t).squeeze(cdim), torch.zeros((), dtype=x.dtype))
        if g.size > 1:
            gm = m.clone()
            dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=g.pg)
            soft.add_(m - gm)
            m = gm
        soft.exp_()
        sum_exp = soft.sum(cdim)
        if g.size > 1:
            both = torch.stack([sum_exp, picked])
            dist.all_reduce(both, group=g.pg)
            sum_exp, picked = both[0], both[1]
        soft.div_(sum_exp.unsqueeze(cdim))
        loss = torch.where(valid, sum_exp.log() + m.squeeze(cdim) - picked, torch.zeros((), dtype=x.dtype))
        ctx.save_for_backward(soft, local_t, hit, valid)
        ctx.g, ctx.cdim, ctx.whole = g, cdim, whole
        return loss

    @staticmethod
    def backward(ctx, grad):
        soft, local_t, hit, valid = ctx.saved_tensors
        g, cdim = ctx.g, ctx.cdim
        grad = grad.contiguous().clone()
        if g.size > 1 and not ctx.whole:
            dist.all_reduce(grad, group=g.pg)
        per_sample = torch.where(valid, grad, torch.zeros((), dtype=grad.dtype)).unsqueeze(cdim)
        dx = soft.mul_(per_sample)  # the saved softmax is not needed again: reuse its memory
        dx.scatter_add_(cdim, local_t, -(per_sample * hit.unsqueeze(cdim).to(per_sample.dtype)))
        return dx, None, None, None, None


class WholeClassCrossEntropy(torch.autograd.Function):
    """Per-sample cross entropy with the class dim whole on this rank: forward is torch's own
    log_softmax kernel and the picked -log p (torch's values bit for bit); backward is
    (exp(log p) - one_hot) * grad, made in place of the saved log-probabilities. ATen's
    cross_entropy keeps the same one logits-sized tensor but makes two more in backward (nll's
    zero-filled gradient, log_softmax's); the max-subtract-exp form that the class split needs
    (``VocabParallelCrossEntropy``) takes three passes where torch's kernel takes one."""

    @staticmethod
    def forward(ctx, x, target, ignore_index):
        cdim = 1 if x.dim() >= 2 else 0
        logp = torch.log_softmax(x, cdim)
        valid = target != ignore_index
        picked = torch.where(valid, target, 0).unsqueeze(cdim)
        loss = torch.where(valid, -logp.gather(cdim, picked).squeeze(cdim), torch.zeros((), dtype=logp.dtype))
        ctx.save_for_backward(logp, picked, valid)
        ctx.cdim = cdim
        return loss

    @staticmethod
    def backward(ctx, grad):
        logp, picked, valid = ctx.saved_tensors
        per_sample = torch.where(valid, grad, torch.zeros((), dtype=grad.dtype)).unsqueeze(ctx.cdim)
        dx = logp.exp_().mul_(per_sample)  # the saved log-probabilities are not needed again
        dx.scatter_add_(ctx.cdim, picked, -per_sample)
        return dx, None, None


_SUM_OF_MEAN = {"aten.mean.default": "aten.sum.default", "aten.mean.dim": "aten.sum.dim_IntList"}


def autopar_mean_as_sum(op: str, args, kwargs, *, count: int):
    """A mean whose reduced dims are split ("reduce-partial(mean)"): the local sum divided by the
    global number of reduced elements, so the ranks' results add up to the global mean."""
    return _aten(_SUM_OF_MEAN[op])(*args, **kwargs) / count


# ---- ring attention ----------------------------------------------------------------------------------
def autopar_ring_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, *, seq_axes):
    """``aten.scaled_dot_product_attention`` over this rank's sequence shard of q, k and v (and its
    rows of the mask), the sequence split over ``seq_axes``: ring attention."""
    if dropout_p:
        raise PlanError("ring attention runs without dropout; the plan should not have chosen it")
    return ring_attention(query, key, value, handle(seq_axes), causal=bool(is_causal), scale=scale, mask=attn_mask)


# ---- which lowering runs a node ------------------------------------------------------------------
def lowering(node, node_plan, graph, identical=()):
    """(function, extra keyword arguments, how to pass the node's args) for a node whose strategy
    family needs lowering, on a plan whose gradients are whole on the ``identical`` axes. ``how``
    is "direct" (``fn(*args, **kwargs, **extra)``) or "packed" (``fn(op, args, kwargs, **extra)``)."""
    lowered = node_plan.family.lowered
    target = node.target
    if VOCAB_EMBEDDING in lowered and target == "aten.embedding.default":
        if call_arg(node.args, node.kwargs, 3, "scale_grad_by_freq", False) or call_arg(node.args, node.kwargs, 4, "sparse", False):
            raise PlanError(f"node {node.name}: vocabulary-parallel embedding with scale_grad_by_freq or sparse is not supported")
        axes = node_plan.inputs[0].dim_axes[0]
        return autopar_vocab_parallel_embedding, {"vocab_axes": tuple(axes)}, "direct"
    if VOCAB_LOSS in lowered and target == "aten.cross_entropy_loss.default":
        x_spec = node_plan.inputs[0]
        cdim = 1 if x_spec.ndim >= 2 else 0
        class_axes = tuple(x_spec.dim_axes[cdim])
        batch_axes = tuple(a for d, ax in enumerate(x_spec.dim_axes) if d != cdim for a in ax)
        extra = {"class_axes": class_axes, "batch_axes": batch_axes}
        if whole_on(class_axes, identical):
            extra["whole"] = True
        return autopar_vocab_parallel_cross_entropy, extra, "direct"
    if node_plan.family.ring and target == attention_rule.SDPA:
        return autopar_ring_sdpa, {"seq_axes": attention_rule.ring_axes(node_plan.output)}, "direct"
    if lowered == {MEAN_PARTIAL} and target in _SUM_OF_MEAN:
        shape = graph.nodes[node.inputs[0]].meta.shape
        dim = call_arg(node.args, node.kwargs, 1, "dim") if target == "aten.mean.dim" else None
        dims = range(len(shape)) if dim is None else [d % len(shape) for d in ([dim] if isinstance(dim, int) else dim)]
        return autopar_mean_as_sum, {"count": math.prod(shape[d] for d in dims)}, "packed"
    if lowered == {MEAN_SPLIT} and target in REDUCTION_POS:
        out = node_plan.output[0] if isinstance(node_plan.output, tuple) else node_plan.output
        extra = {"batch_axes": tuple(out.partial)}
        metas = [graph.nodes[i].meta for i in node.inputs]
        if target in loss_rule.ELEMENTWISE:
            extra["count"] = math.prod(torch.broadcast_shapes(*(tuple(m.shape) for m in metas[:2])))
        elif tuple(metas[1].shape) == tuple(metas[0].shape) and metas[1].dtype not in ("int64", "int32"):
            x_shape = tuple(metas[0].shape)  # probability targets: divide by the sample count
            extra["count"] = math.prod(x_shape) // x_shape[1 if len(x_shape) >= 2 else 0]
        if target == CROSS_ENTROPY and fused_cross_entropy(graph, node):  # (class indices: no static count)
            extra["fused"] = True
        return autopar_loss_global_mean, extra, "packed"
    raise PlanError(
        f"node {node.name} ({target}) uses strategy family {node_plan.family!r}, which needs a lowering that "
        "autopar's codegen does not implement; re-plan with this family excluded (autopar.plan(..., force=...))"
    )


def _register_builtins() -> None:
    try:
        from torch.fx.graph import _register_custom_builtin
    except ImportError:
        return
    for fn in (autopar_vocab_parallel_embedding, autopar_vocab_parallel_cross_entropy, autopar_loss_global_mean,
               autopar_mean_as_sum, autopar_cross_entropy):
        _register_custom_builtin(fn.__name__, f"from {__name__} import {fn.__name__}", fn)


_register_builtins()
