"""Which microbatch weights a pipelined step needs (``autopar.codegen.loss_weights``): the class-index
means behind the loss, read from the traced graph, and their denominators computed from the inputs
(labels shifted and padded inside the model, class weights, ignored targets)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import ir, models
from autopar.codegen.loss_weights import loss_denominators
from autopar.errors import ConfigError


def _loss_node(graph):
    out = next(n for n in graph.nodes.values() if n.op == "output")
    return out.inputs[0]


class _Classifier(nn.Module):
    """A linear classifier whose loss is picked by ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(8, 5)
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]))

    def forward(self, x, y):
        logits = self.fc(x)
        if self.kind == "mse":
            return F.mse_loss(logits, F.one_hot(y.clamp(min=0), 5).float())
        if self.kind == "ce + aux":
            return F.cross_entropy(logits, y) + 0.1 * logits.pow(2).mean()
        if self.kind == "buffer weight":
            return F.cross_entropy(logits, y, weight=self.class_weight)
        if self.kind == "input weight":
            return F.cross_entropy(logits, y, weight=x[0, :5].abs() + 1)
        if self.kind == "nll float":
            return F.nll_loss(F.log_softmax(logits, -1), y, ignore_index=3).float()
        return F.cross_entropy(logits, y, ignore_index=-1)


def _inputs(batch=6):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (batch,), generator=g)
    y[::2] = -1
    return torch.randn(batch, 8, generator=g), y


def test_the_mean_is_found_through_casts_and_its_count_follows_the_ignored_targets():
    x, y = _inputs()
    for kind, ignored in (("ce", -1), ("nll float", 3)):
        y2 = y.clamp(min=0) if kind == "nll float" else y
        graph = ir.trace(_Classifier(kind), (x, y2))
        d = loss_denominators(graph, _loss_node(graph))
        assert d is not None and d.direct and len(d.means) == 1, kind
        for rows in (slice(0, 3), slice(3, 6), slice(0, 6)):
            assert float(d([x[rows], y2[rows]])[0]) == float((y2[rows] != ignored).sum()), kind


def test_class_weights_from_the_inputs_weigh_the_count():
    x, y = _inputs()
    graph = ir.trace(_Classifier("input weight"), (x, y))
    d = loss_denominators(graph, _loss_node(graph))
    w = x[0, :5].abs() + 1
    valid = y != -100
    assert float(d([x, y])[0]) == pytest.approx(float((w.double()[y.masked_fill(~valid, 0)] * valid).sum()))


def test_a_mean_among_other_terms_is_not_direct_and_other_losses_need_no_weights():
    x, y = _inputs()
    graph = ir.trace(_Classifier("ce + aux"), (x, y.clamp(min=0)))
    d = loss_denominators(graph, _loss_node(graph))
    assert d is not None and not d.direct
    graph = ir.trace(_Classifier("mse"), (x, y))
    assert loss_denominators(graph, _loss_node(graph)) is None


def test_class_weights_held_by_the_model_are_refused():
    x, y = _inputs()
    graph = ir.trace(_Classifier("buffer weight"), (x, y.clamp(min=0)))
    with pytest.raises(ConfigError, match=r"weighed by .*class_weight.* model state.*Pipeline\(microbatches=1\)"):
        loss_denominators(graph, _loss_node(graph))


def test_labels_shifted_inside_the_model_are_counted_as_the_model_counts_them():
    """transformers' causal LM loss pads the labels by one ignored position and shifts them: the
    count is that of labels[:, 1:] that are not -100."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=32, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.masked_fill(torch.arange(8) < torch.tensor([[0], [3], [7], [1]]), -100)
    graph = ir.trace(model, (), {"input_ids": ids, "labels": labels})
    d = loss_denominators(graph, _loss_node(graph))
    assert d is not None and d.direct
    order = {name: i for i, name in enumerate(graph.inputs)}
    feed = [None] * len(order)
    for name, t in (("input_ids", ids), ("labels", labels)):
        feed[next(i for n, i in order.items() if name in n)] = t
    for rows in (slice(0, 2), slice(2, 4)):
        got = d([t[rows] for t in feed])[0]
        assert float(got) == float((labels[rows, 1:] != -100).sum())


def test_the_built_in_models_read_one_mean():
    for name in ("gpt", "llama"):
        model, inputs = models.build(name, layers=1)
        graph = ir.trace(model, inputs)
        d = loss_denominators(graph, _loss_node(graph))
        assert d is not None and d.direct, name
        assert float(d(list(inputs))[0]) == inputs[1].numel()
