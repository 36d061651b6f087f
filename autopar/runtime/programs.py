"""Which program runs a call, and how it is fed.

A ParallelModule holds one lowered program per (train/eval mode, input shapes), all sharing one
set of parameter shards: the main program (the example inputs, in the model's mode) and, for a
call in the other mode or with inputs of other shapes, one built on first use by
``autopar.compose.programs`` (trace, plan with the shards pinned, lower) and cached. ``call_key``
decides which; ``Program`` feeds it.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.codegen import ops
from autopar.ir.losses import loss_position

@dataclasses.dataclass(eq=False)
class Program:
    """A lowered program and how to feed it. ``state_slots[i]``: the module slot feeding its i-th
    state input, or None for a constant of its own (``constants[i]``)."""

    graph: object
    plan: object
    lowered: object
    state_slots: list
    constants: dict
    in_spec: object
    out_spec: object
    loss_gm: object = None  # the program returning the loss alone (``loss_only``), built on first use
    loss_sum_axes: tuple = ()  # the mesh axes of the closing sum ``loss_only`` leaves to its caller

    def state_inputs(self, slot_values: list) -> list:
        return [slot_values[s] if s is not None else self.constants[i] for i, s in enumerate(self.state_slots)]

    def loss_only(self) -> fx.GraphModule:
        """The program with the loss as its one output, for ``train_step``: the other outputs'
        resharding to whole values (e.g. a language model's logits all-gathered, batch x seq x
        vocab) is left out, since nothing reads them. Its loss is this rank's part where the plan
        closes it with all-reduces whose backward is the identity (the data-parallel sum of a
        mean): the caller sums it over ``loss_sum_axes`` (``start_loss_sum``) off the critical path,
        so that forward and backward run without a barrier between them."""
        if self.loss_gm is None:
            self.loss_gm, self.loss_sum_axes = _keep_output(self.lowered.gm, loss_position(self.graph))
        return self.loss_gm


def start_loss_sum(loss: torch.Tensor, axes: tuple, groups):
    """Start summing the detached ``loss`` over the mesh ``axes`` (``Program.loss_sum_axes``) on
    ``groups``, as one asynchronous all-reduce; returns the tensor the sum lands in and a function
    that waits for it."""
    total = loss.detach().clone()
    if not axes:
        return total, lambda: None
    with ops.bind(groups):
        g = ops.handle(axes)
    if g.size == 1:
        return total, lambda: None
    work = dist.all_reduce(total, group=g.pg, async_op=True)
    return total, work.wait


# what the output edges emit after a value is made: removable when nothing else reads them
_OUTPUT_CHAIN = (*ops.STEP_FUNCTIONS.values(), ops.autopar_backward_seed)


def _keep_output(gm: fx.GraphModule, index: int) -> tuple[fx.GraphModule, tuple]:
    """``gm`` returning output ``index`` alone, and the mesh axes of the closing sums taken out of it."""
    graph = copy.deepcopy(gm.graph)
    out = next(n for n in graph.nodes if n.op == "output")
    values = list(out.args[0])
    out.args = ((values[index],),)
    # drop each other output's own chain (its steps and backward seed), up to the value it starts from
    for v in values[:index] + values[index + 1:]:
        while isinstance(v, fx.Node) and v.op == "call_function" and v.target in _OUTPUT_CHAIN and not v.users:
            src = v.args[0]
            graph.erase_node(v)
            v = src
    sums = _take_closing_sums(graph, values[index])
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="AutoparLossProgram"), sums


def _take_closing_sums(graph: fx.Graph, kept) -> tuple:
    """Take the whole-gradient all-reduces that close the kept output (just before its backward
    seed) out of ``graph``: forward the output is then this rank's part, backward is unchanged (their
    backward is the identity). Returns the mesh axes they summed over, in order (one sum over all of
    them is theirs)."""
    seed = kept if isinstance(kept, fx.Node) and kept.target is ops.autopar_backward_seed else None
    v = seed.args[0] if seed is not None else kept
    axes: set = set()
    while (isinstance(v, fx.Node) and v.op == "call_function" and v.target is ops.autopar_all_reduce
           and v.kwargs.get("whole") and len(v.users) == 1):
        src = v.args[0]
        axes.update(v.kwargs["axes"])
        v.replace_all_uses_with(src)
        graph.erase_node(v)
        v = src
    return tuple(sorted(axes))


def call_key(training: bool, args, kwargs) -> tuple:
    """What decides which program runs a call: the mode, the inputs' structure, each tensor's shape
    and dtype, and every other leaf by value (export bakes those into the graph)."""
    leaves, structure = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return (bool(training), repr(structure)) + tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", repr(x)) for x in leaves
    )
