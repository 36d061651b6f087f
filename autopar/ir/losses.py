"""What a traced graph's loss is made of, where microbatching depends on it.

A class-index loss (cross entropy, NLL) reduced by "mean" divides by the weight of its counted
targets (not ``ignore_index``; ``weight[target]`` each with class weights), which differs between
microbatches of the same batch. ``class_means`` finds such means behind a loss, and whether the loss
is one of them itself (``direct``: through casts and views) or adds them to other terms;
``state_weighing`` says whether a mean's targets or class weights come from model state rather than
from the inputs. ``autopar.codegen.loss_weights`` weighs a pipelined step's microbatches from
this; the pipeline search (``solver.microbatches.batch_mixing``) keeps one microbatch where it cannot.

``fused_cross_entropy`` says which cross entropies autopar computes in place (their memory differs).

A mean over a batch split across ranks needs the whole batch's count; ``counted_from_inputs`` says
whether every rank can count it from the user inputs it is handed whole (a program then recomputes
the targets from them instead of all-reducing the ranks' counts: one collective less per step).
"""
from __future__ import annotations

import torch.utils._pytree as pytree

from autopar.errors import ConfigError
from autopar.ir.graph import NodeRef, Role, call_arg

CLASS_LOSSES = {"aten.cross_entropy_loss.default", "aten.nll_loss_forward.default", "aten.nll_loss.default",
                "aten.nll_loss_nd.default", "aten.nll_loss2d_forward.default"}
MEAN = 1  # ATen's reduction code for "mean"
# Ops that pass a loss on unchanged (a dtype cast, a view, a copy).
_PASS_THROUGH = {"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.clone.default",
                 "aten.alias.default", "aten.view.default", "aten.reshape.default", "aten.squeeze.default",
                 "aten.squeeze.dim", "aten.squeeze.dims", "aten.unsqueeze.default", "aten.contiguous.default"}


def loss_position(graph) -> int:
    """Index of the loss among the model's flat outputs, as ``train_step`` reads it: a ``loss``
    entry of a returned dict (a transformers ModelOutput), else the first floating-point scalar."""
    out = next(n for n in graph.nodes.values() if n.op == "output")
    tree = pytree.tree_unflatten(list(range(len(out.inputs))), graph.exported.call_spec.out_spec)
    if isinstance(tree, dict) and isinstance(tree.get("loss"), int):
        return tree["loss"]
    for i, v in enumerate(out.inputs):
        meta = graph.nodes[v].meta
        if meta is not None and not isinstance(meta, tuple) and tuple(meta.shape) == () and "float" in meta.dtype:
            return i
    raise ConfigError(f"{graph.model_name} returns no scalar loss; train_step trains a model that computes its loss "
                      "in forward (e.g. pass labels to a transformers model)")


def unread_outputs(graph) -> frozenset[int]:
    """Positions among the flat outputs that training does not read: every output but the loss,
    when there is one (``train_step`` runs the loss alone; a call returns the others as the plan
    leaves them, gathered when first read: ``autopar.runtime.outputs``). None when the model
    returns no loss: the caller makes one from its outputs, so every step reads them all."""
    out = next(n for n in graph.nodes.values() if n.op == "output")
    try:
        loss = loss_position(graph)
    except ConfigError:
        return frozenset()
    return frozenset(i for i in range(len(out.inputs)) if i != loss)


def class_means(graph, loss: str) -> tuple[list, bool]:
    """(the class-index means behind node ``loss``, in graph order; whether ``loss`` is the only
    one, passed on unchanged)."""
    node = graph.nodes[loss]
    while node.target in _PASS_THROUGH or (node.target == "operator.getitem" and node.args[1] == 0):
        node = graph.nodes[node.inputs[0]]
    means = [n for n in ancestors(graph, node.name, include=True) if _is_class_mean(graph, n)]
    return means, means == [node]


def state_weighing(graph, mean) -> str | None:
    """The model state (a parameter, buffer or constant placeholder) that ``mean``'s targets or
    class weights are computed from, or None when they come from the inputs alone."""
    for value in (mean.args[1], call_arg(mean.args, mean.kwargs, 2, "weight")):
        if isinstance(value, NodeRef):
            for n in ancestors(graph, value.name, include=True):
                if n.op == "placeholder" and n.role != Role.INPUT:
                    return n.name
    return None


# ops that draw random numbers: run again to count the targets, they would draw other ones
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "exponential", "poisson", "cauchy",
           "geometric")
# what recomputing the targets may cost, in FLOPs per target (views and comparisons, not a model)
_TARGET_FLOPS = 8


def counted_from_inputs(graph, mean) -> bool:
    """Whether class mean ``mean``'s denominator can be counted on every rank from the whole user
    inputs: its targets and class weights are computed from the inputs alone, by ops that draw no
    random numbers and cost a few FLOPs per target at most."""
    if not _is_class_mean(graph, mean):
        return False
    sources = [v.name for v in (mean.args[1], call_arg(mean.args, mean.kwargs, 2, "weight")) if isinstance(v, NodeRef)]
    chain = {n.name: n for v in sources for n in ancestors(graph, v, include=True)}.values()
    for n in chain:
        if n.op == "placeholder" and n.role != Role.INPUT or n.op not in ("placeholder", "call_function"):
            return False
        if n.op == "call_function" and any(word in n.target for word in _RANDOM):
            return False
    return sum(n.flops for n in chain) <= _TARGET_FLOPS * max(1, graph.nodes[sources[0]].meta.numel)


def ancestors(graph, name: str, include: bool = False) -> list:
    """The nodes ``name`` reads, transitively, in graph order (``include``: with itself)."""
    seen, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(graph.nodes[n].inputs)
    if not include:
        seen.discard(name)
    return [graph.nodes[n] for n in graph.nodes if n in seen]


def fused_cross_entropy(graph, node) -> bool:
    """Whether autopar runs cross entropy ``node`` fused (``codegen.lowerings``): floating logits,
    class-index targets, no class weight, no label smoothing. It keeps one logits-sized tensor for
    backward and makes the logits' gradient in place of it; ATen's backward makes two more."""
    if node.op != "call_function" or node.target != "aten.cross_entropy_loss.default":
        return False
    if call_arg(node.args, node.kwargs, 2, "weight") is not None or call_arg(node.args, node.kwargs, 5, "label_smoothing", 0.0):
        return False
    x, target = (graph.nodes[name].meta for name in node.inputs[:2])
    return (x is not None and not isinstance(x, tuple) and x.torch_dtype.is_floating_point
            and target is not None and not isinstance(target, tuple) and target.dtype in ("int64", "int32"))


def _is_class_mean(graph, node) -> bool:
    """A class-index loss (integer targets) reduced by "mean"."""
    if node.target not in CLASS_LOSSES or call_arg(node.args, node.kwargs, 3, "reduction", MEAN) != MEAN:
        return False
    target = graph.nodes[node.inputs[1]].meta
    return target is not None and not isinstance(target, tuple) and target.dtype in ("int64", "int32", "uint8", "int16")
