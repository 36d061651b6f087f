"""Which program runs a call, and how it is fed.

A ParallelModule holds one lowered program per (train/eval mode, input shapes), all sharing one
set of parameter shards: the main program (the example inputs, in the model's mode) and, for a
call in the other mode or with inputs of other shapes, one built on first use by
``autopar.compose.programs`` (trace, plan with the shards pinned, lower) and cached. ``call_key``
decides which; ``Program`` feeds it.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree


DEFAULT_MAX_PROGRAMS = 8


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

    def state_inputs(self, slot_values: list) -> list:
        return [slot_values[s] if s is not None else self.constants[i] for i, s in enumerate(self.state_slots)]


def call_key(training: bool, args, kwargs) -> tuple:
    """What decides which program runs a call: the mode, the inputs' structure, each tensor's shape
    and dtype, and every other leaf by value (export bakes those into the graph)."""
    leaves, structure = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return (bool(training), repr(structure)) + tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", repr(x)) for x in leaves
    )
