"""FLOP counts against hand-computed formulas."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.ir import TensorMeta, count_flops, trace


class Fn(nn.Module):
    def __init__(self, fn, *params: torch.Tensor):
        super().__init__()
        self.fn = fn
        self.w = nn.ParameterList(params)

    def forward(self, *xs):
        return self.fn(*xs, *self.w)


def only(graph, target):
    (node,) = [n for n in graph if n.target == target]
    return node


def test_linear_is_2mnk_ignoring_bias():
    g = trace(nn.Linear(16, 8), torch.randn(4, 5, 16))
    assert only(g, "aten.linear.default").flops == 2 * (4 * 5) * 8 * 16


@pytest.mark.parametrize(
    "fn, shapes, target, expected",
    [
        (torch.mm, [(6, 7), (7, 5)], "aten.mm.default", 2 * 6 * 5 * 7),
        (torch.matmul, [(3, 6, 7), (7, 5)], "aten.matmul.default", 2 * 3 * 6 * 5 * 7),
        (torch.bmm, [(3, 6, 7), (3, 7, 5)], "aten.bmm.default", 2 * 3 * 6 * 5 * 7),
        (lambda b, a, w: torch.addmm(b, a, w), [(5,), (6, 7), (7, 5)], "aten.addmm.default", 2 * 6 * 5 * 7),
        (lambda b, a, w: torch.baddbmm(b, a, w), [(3, 6, 5), (3, 6, 7), (3, 7, 5)], "aten.baddbmm.default", 2 * 3 * 6 * 5 * 7),
    ],
)
def test_matmul_family(fn, shapes, target, expected):
    tensors = [torch.randn(s) for s in shapes]
    g = trace(Fn(fn), tuple(tensors))
    assert only(g, target).flops == expected


def test_attention():
    B, H, L, S, E = 2, 3, 5, 7, 4
    q, k, v = torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E)
    g = trace(Fn(F.scaled_dot_product_attention), (q, k, v))
    assert only(g, "aten.scaled_dot_product_attention.default").flops == 4 * B * H * L * S * E + 5 * B * H * L * S


def test_simple_op_classes():
    def fn(x):
        y = torch.relu(x)  # elementwise: numel
        s = y.sum(dim=-1)  # reduction: input numel
        p = torch.softmax(x, dim=-1)  # 5 * numel
        n = F.layer_norm(x, (8,))  # 5 * numel
        return s, p.view(-1), n.transpose(0, 1)  # views: 0

    g = trace(Fn(fn), torch.randn(4, 8))
    flops = {n.target: n.flops for n in g if n.op == "call_function"}
    assert flops["aten.relu.default"] == 32
    assert flops["aten.sum.dim_IntList"] == 32
    assert flops["aten.softmax.int"] == 5 * 32
    assert flops["aten.layer_norm.default"] == 5 * 32
    assert flops["aten.view.default"] == flops["aten.transpose.int"] == 0


def test_table_fallbacks():
    out = TensorMeta((2, 3), "float32", 24)
    assert count_flops("aten.some_new_op.default", [], out) == 6  # unknown op: output numel
    assert count_flops("aten.mm.default", [], out) == 6  # a rule that cannot apply falls back too
    assert count_flops("aten.embedding.default", [out], out) == 0
    assert count_flops("operator.getitem", [out], out) == 0


def test_gpt_matmul_flops_by_hand(gpt):
    model, (idx, _), graph = gpt
    cfg = model.config
    B, T, C, V = cfg.batch, cfg.seq, cfg.width, cfg.vocab
    linears = [n for n in graph if n.target == "aten.linear.default"]
    for node in linears:  # each: 2 * (B*T) * out_features * in_features
        w = graph[node.inputs[1]].meta
        assert node.flops == 2 * B * T * w.shape[0] * w.shape[1]
    c_attn = next(n for n in linears if n.module_path.endswith("attn.c_attn"))
    assert c_attn.flops == 2 * B * T * C * 3 * C
    per_layer = 2 * B * T * (3 * C * C + C * C + 4 * C * C + 4 * C * C)
    assert sum(n.flops for n in linears) == cfg.layers * per_layer + 2 * B * T * C * V
    hd = C // cfg.heads
    for sdpa in (n for n in graph if n.target == "aten.scaled_dot_product_attention.default"):
        assert sdpa.flops == 4 * B * cfg.heads * T * T * hd + 5 * B * cfg.heads * T * T


def test_flops_per_layer_adds_up(gpt):
    _, _, graph = gpt
    per_layer = graph.flops_per_layer()
    assert sum(per_layer.values()) == graph.total_flops() == sum(n.flops for n in graph)
    assert list(per_layer)[:3] == graph.layers and "(outside)" in per_layer
    assert len({per_layer[layer] for layer in graph.layers}) == 1  # identical blocks, identical cost


def test_hf_gpt2_conv1d_addmm(hf_gpt2):
    _, _, graph = hf_gpt2
    addmms = [n for n in graph if n.target == "aten.addmm.default"]
    assert len(addmms) == 4 * 3
    for node in addmms:  # Conv1D: addmm(bias, x[m, k], w[k, n])
        (m, k), (_, n) = graph[node.inputs[1]].meta.shape, graph[node.inputs[2]].meta.shape
        assert node.flops == 2 * m * n * k
