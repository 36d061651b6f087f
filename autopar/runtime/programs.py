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

    def state_inputs(self, slot_values: list) -> list:
        return [slot_values[s] if s is not None else self.constants[i] for i, s in enumerate(self.state_slots)]

    def loss_only(self) -> fx.GraphModule:
        """The program with the loss as its one output, for ``train_step``: the other outputs'
        resharding to whole values (e.g. a language model's logits all-gathered, batch x seq x
        vocab) is left out, since nothing reads them."""
        if self.loss_gm is None:
            self.loss_gm = _keep_output(self.lowered.gm, loss_position(self.graph))
        return self.loss_gm


# what the output edges emit after a value is made: removable when nothing else reads them
_OUTPUT_CHAIN = (*ops.STEP_FUNCTIONS.values(), ops.autopar_backward_seed)


def _keep_output(gm: fx.GraphModule, index: int) -> fx.GraphModule:
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
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="AutoparLossProgram")


def call_key(training: bool, args, kwargs) -> tuple:
    """What decides which program runs a call: the mode, the inputs' structure, each tensor's shape
    and dtype, and every other leaf by value (export bakes those into the graph)."""
    leaves, structure = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return (bool(training), repr(structure)) + tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", repr(x)) for x in leaves
    )
