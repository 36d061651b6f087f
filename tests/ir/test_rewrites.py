"""``autopar.ir.rewrites``: merges of leading dims around a linear kept apart, values unchanged."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

import autopar
from autopar import ir
from autopar.ir.rewrites import keep_leading_dims
from autopar.solver.microbatches import batch_mixing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_zoo  # noqa: E402


class _Rows(nn.Module):
    """A linear over (T, B, C) merged into rows; ``other``: the merged rows are read elsewhere too."""

    def __init__(self, other: bool = False):
        super().__init__()
        self.fc, self.other = nn.Linear(6, 5), other

    def forward(self, x):
        t, b, c = x.shape
        rows = x.reshape(t * b, c)
        y = self.fc(rows).view(t, b, 5)
        return y.sum() + (rows.sum() if self.other else 0)


def test_the_merge_is_kept_apart_and_the_values_stay():
    x = torch.randn(3, 4, 6)
    for other, kept in ((False, 1), (True, 0)):
        model = _Rows(other)
        ep = torch.export.export(model, (x,), strict=False)
        assert keep_leading_dims(ep.graph_module) == kept
        assert torch.equal(ep.module()(x), model(x))
    graph = ir.trace(_Rows(), (x,))
    linear = next(n for n in graph.nodes.values() if n.target == "aten.linear.default")
    assert linear.meta.shape == (3, 4, 5) and graph.nodes[linear.inputs[0]].meta.shape == (3, 4, 6)


def test_multihead_attention_keeps_its_batch_a_dim_of_its_own():
    """``nn.MultiheadAttention`` merges (time, batch) into rows before its output projection: with
    the rewrite the batch splits through it, so microbatches are allowed and data parallelism
    reshards nothing inside attention."""
    model, inputs = models_zoo.vit()
    graph = ir.trace(model, inputs)
    assert batch_mixing(graph, inputs[0].shape[0]) is None
    plan = autopar.plan(model, autopar.Mesh((4,)), inputs, pipeline=False, force=autopar.Layout(dp=4), graph=graph)
    inside = [e for e in plan.edges if ".attn" in (graph.nodes[e.dst].module_path or "") and e.steps]
    assert not any(st.kind == "all_to_all" for e in inside for st in e.steps), [(e.src, e.dst) for e in inside]
