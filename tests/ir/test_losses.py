"""``ir.losses``: which class-index means every rank can count from the whole user inputs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import ir
from autopar.ir.losses import counted_from_inputs


class Head(nn.Module):
    """A linear head and a cross entropy whose targets come from ``targets`` as ``how`` says."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(6, 5)
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, 5))
        self.register_buffer("offset", torch.ones((), dtype=torch.long))

    def forward(self, x, targets):
        logits = self.lin(x)  # (B, T, 5)
        weight, reduction = None, "mean"
        if self.how == "shifted":  # next-token targets, flattened
            logits, targets = logits[:, :-1], targets[:, 1:]
        elif self.how == "padded":  # the padding marked from the inputs themselves
            targets = targets.masked_fill(x[..., 0] > 1.0, -100)
        elif self.how == "from the model":
            targets = logits.argmax(-1)
        elif self.how == "from state":
            targets = (targets + self.offset) % 5
        elif self.how == "buffer weight":
            weight = self.class_weight
        elif self.how == "random":
            targets = targets.masked_fill(torch.rand(targets.shape) < 0.1, -100)
        elif self.how == "sum":
            reduction = "sum"
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=weight, ignore_index=-100,
                               reduction=reduction)


@pytest.mark.parametrize("how, counted", [
    ("plain", True), ("shifted", True), ("padded", True),
    ("from the model", False), ("from state", False), ("buffer weight", False), ("random", False), ("sum", False),
])
def test_counted_from_inputs(how, counted):
    g = torch.Generator().manual_seed(0)
    graph = ir.trace(Head(how), (torch.randn(4, 3, 6, generator=g), torch.randint(0, 5, (4, 3), generator=g)))
    loss = next(n for n in graph.nodes.values() if n.target == "aten.cross_entropy_loss.default")
    assert counted_from_inputs(graph, loss) is counted
    others = [n for n in graph.nodes.values() if n is not loss]
    assert not any(counted_from_inputs(graph, n) for n in others)  # only a class mean is counted
