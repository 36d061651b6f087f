"""Layer ids and repeated-block detection."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.ir import Role, trace
from autopar.ir.blocks import layer_of_path

N_LAYERS = 3  # as built by conftest.py


@pytest.mark.parametrize(
    "path, layer",
    [
        ("transformer.h.3.attn.c_attn", "transformer.h.3"),
        ("model.layers.12", "model.layers.12"),
        ("layers.0.experts.3", "layers.0"),
        ("transformer.ln_f", None),
        ("", None),
    ],
)
def test_layer_of_path(path, layer):
    assert layer_of_path(path) == layer


@pytest.mark.parametrize(
    "fixture, prefix",
    [("gpt", "transformer.h"), ("llama", "model.layers"), ("mlp", "layers"), ("hf_gpt2", "transformer.h"), ("hf_llama", "model.layers")],
)
def test_layers_and_one_block(request, fixture, prefix):
    _, _, graph = request.getfixturevalue(fixture)
    expected = [f"{prefix}.{i}" for i in range(N_LAYERS)]
    assert graph.layers == expected
    assert graph.blocks == [expected]
    sizes = {len(graph.nodes_in_layer(layer)) for layer in expected}
    assert len(sizes) == 1 and sizes.pop() > 0


def test_params_take_their_layer(gpt):
    _, _, graph = gpt
    assert graph[graph.params["transformer.h.1.attn.c_attn.weight"]].layer == "transformer.h.1"
    assert graph[graph.params["transformer.ln_f.weight"]].layer is None
    layer_params = [n for n in graph.nodes_in_layer("transformer.h.2") if n.role is Role.PARAMETER]
    assert len(layer_params) == 12 and all(n.param_name.startswith("transformer.h.2.") for n in layer_params)


def test_ops_in_parent_loop_inherit_layer(mlp):
    _, _, graph = mlp
    relus = [n for n in graph if n.target == "aten.relu.default"]
    assert [n.module_path for n in relus] == [""] * (N_LAYERS + 1)
    # the first ReLU follows proj_in (no layer); the others follow layers.i
    assert [n.layer for n in relus] == [None] + [f"layers.{i}" for i in range(N_LAYERS)]
    assert graph[graph.params["proj_out.weight"]].layer is None
    proj_out = next(n for n in graph if n.module_path == "proj_out")
    assert proj_out.layer is None  # a sibling module, not an ancestor: it does not inherit


class Stack(nn.Module):
    """Layers of different widths: 8->8, 8->8, 8->16, 16->16, 16->16, plus a head."""

    def __init__(self):
        super().__init__()
        dims = [(8, 8), (8, 8), (8, 16), (16, 16), (16, 16)]
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in dims)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def test_blocks_group_identical_layers_only():
    g = trace(Stack(), torch.randn(4, 8))
    assert g.layers == [f"layers.{i}" for i in range(5)]
    assert g.blocks == [["layers.0", "layers.1"], ["layers.2"], ["layers.3", "layers.4"]]
    assert g["tanh_4"].layer == "layers.4" and g["linear_5"].layer is None


def test_blocks_see_non_tensor_args():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x) * (2.0 if i == 1 else 1.0)
            return x

    g = trace(Scaled(), torch.randn(2, 8))
    assert g.blocks == [["layers.0", "layers.2"], ["layers.1"]]


def test_root_ops_reading_layer_params_join_that_layer():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:  # every op runs in the root's forward
                x = torch.tanh(nn.functional.linear(x, layer.weight, layer.bias))
            return x

    g = trace(Functional(), torch.randn(2, 8))
    ops = [n for n in g if n.op == "call_function"]
    assert all(n.module_path == "" for n in ops)
    assert [n.layer for n in ops] == ["layers.0", "layers.0", "layers.1", "layers.1", "layers.2", "layers.2"]
    assert g.blocks == [["layers.0", "layers.1", "layers.2"]]
