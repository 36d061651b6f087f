"""How a pipelined step weighs its microbatches' losses.

A step of ``m`` microbatches sums their losses, each weighed so that the sum is the whole batch's
loss. For a mean over samples every microbatch weighs 1 / m. A class-index loss (cross entropy, NLL)
with reduction "mean" divides by the weight of its counted targets instead: those not equal to
``ignore_index`` (padding), each weighing ``weight[target]`` when the loss has class weights. Its
microbatches then count differently, and the batch's loss is ``sum_k d_k * loss_k / D`` (``d_k``:
microbatch k's denominator, ``D`` their sum), not the plain average of the ``loss_k``.

``loss_denominators`` reads from the traced graph how the loss's targets are computed from the
model's inputs (labels shifted, padded, flattened) and returns a program that computes each
microbatch's denominator from the step's inputs, before the schedule runs. A loss that adds other
terms to such a mean is weighed 1 / m, which is exact only while its microbatches count equally;
the program says which case it is, and the runtime refuses a step where it would not be exact.
"""
from __future__ import annotations

import dataclasses

import torch

from autopar.codegen.lower import _subst
from autopar.codegen.lowerings import _aten
from autopar.errors import ConfigError
from autopar.ir.graph import NodeRef, call_arg
from autopar.ir.losses import class_means, state_weighing


@dataclasses.dataclass
class LossDenominators:
    """The class-index means the loss reads, and the graph that computes their targets.
    ``direct``: the loss is one such mean (through casts and views), so microbatch k weighs
    ``d_k / D``; otherwise each mean must count equally in every microbatch (weights 1 / m)."""

    graph: object
    means: list  # the class-loss nodes
    direct: bool

    def __call__(self, inputs: list) -> list[torch.Tensor]:
        """Each mean's denominator (a float64 scalar) on one microbatch's flattened user inputs."""
        env = dict(zip(self.graph.inputs, inputs))
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), None)
        out = []
        for node in self.means:
            target = self._value(node.args[1], env, device)
            weight = self._value(call_arg(node.args, node.kwargs, 2, "weight"), env, device)
            ignore_index = call_arg(node.args, node.kwargs, 4, "ignore_index", -100)
            valid = target != ignore_index
            if weight is None:
                out.append(valid.sum(dtype=torch.float64))
            else:
                out.append((weight.to(torch.float64)[target.masked_fill(~valid, 0)] * valid).sum())
        return out

    def _value(self, value, env: dict, device):
        """``value`` with the graph's ops that compute it from the inputs in ``env`` run (each once)."""
        if not isinstance(value, NodeRef):
            return value
        if value.name not in env:
            node = self.graph.nodes[value.name]
            # the inputs in reading order, as codegen feeds a node's args (``lower._subst``)
            feed = iter([self._value(NodeRef(i), env, device) for i in node.inputs])
            args, kwargs = _subst(tuple(node.args), feed, device), _subst(dict(node.kwargs), feed, device)
            env[value.name] = args[0][args[1]] if node.target == "operator.getitem" else _aten(node.target)(*args, **kwargs)
        return env[value.name]


def loss_denominators(graph, loss: str) -> LossDenominators | None:
    """The denominators of the class-index means behind output node ``loss`` (see the module
    docstring), or None when it reads none (every microbatch weighs 1 / m). ConfigError when their
    targets or class weights depend on model state rather than on the inputs alone."""
    means, direct = class_means(graph, loss)
    if not means:
        return None
    for mean in means:
        state = state_weighing(graph, mean)
        if state is not None:
            raise ConfigError(
                f"the loss {mean.name} ({mean.target}) is a mean over targets weighed by {state}, model state: a "
                "pipelined step cannot weigh its microbatches by it yet. Use Pipeline(microbatches=1) or pipeline=False")
    return LossDenominators(graph, means, direct)
