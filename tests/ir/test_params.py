"""Parameters carry their fully-qualified names; tied weights are one parameter."""
from __future__ import annotations

import torch

from autopar.ir import Role


def unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def check_params(model, graph):
    named = dict(model.named_parameters())  # remove_duplicate: the first (canonical) name wins
    assert set(graph.params) == set(named)
    for fqn, node_name in graph.params.items():
        node = graph[node_name]
        assert node.role is Role.PARAMETER and node.param_name == fqn
        assert node.meta.shape == tuple(named[fqn].shape)
    param_nodes = [n for n in graph if n.role is Role.PARAMETER]
    assert sorted(n.param_name for n in param_nodes) == sorted(named)
    assert graph.num_parameters() == unique_numel(model)


def test_models_params(gpt, llama, mlp, hf_llama):
    for model, _, graph in (gpt, llama, mlp, hf_llama):
        check_params(model, graph)


def test_gpt_tied_embedding(gpt):
    model, _, graph = gpt
    check_params(model, graph)
    assert graph.param_aliases["transformer.wte.weight"] == ("transformer.wte.weight", "lm_head.weight")
    assert "lm_head.weight" not in graph.params
    node = graph.param_node("lm_head.weight")
    assert node is graph.param_node("transformer.wte.weight")
    assert {graph[u].target for u in node.users} == {"aten.embedding.default", "aten.linear.default"}
    assert node.module_path == "transformer.wte" and node.layer is None
    # the unused alias placeholder stays in the fx graph but not in ours
    fx_placeholders = {n.name for n in graph.gm.graph.nodes if n.op == "placeholder"}
    dropped = fx_placeholders - set(graph.nodes)
    assert len(dropped) == 1 and len(next(n for n in graph.gm.graph.nodes if n.name in dropped).users) == 0
    assert graph.num_parameters() == unique_numel(model) < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))


def test_hf_gpt2_tied(hf_gpt2):
    model, _, graph = hf_gpt2
    check_params(model, graph)
    assert graph.param_aliases["transformer.wte.weight"] == ("transformer.wte.weight", "lm_head.weight")


def test_llama_untied(llama):
    _, _, graph = llama
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(graph.params)
    assert all(len(a) == 1 for a in graph.param_aliases.values())


def test_tied_buffers_and_unused_params():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.unused = torch.nn.Linear(4, 4)
            self.register_buffer("b", torch.ones(4))
            self.register_buffer("b_alias", self.b)

        def forward(self, x):
            return self.a(x) + self.b_alias

    from autopar.ir import trace

    model = M()
    g = trace(model, torch.randn(2, 4))
    assert g.param_aliases["b"] == ("b", "b_alias") and set(g.buffers) == {"b"}
    assert g[g.buffers["b"]].users and g[g.buffers["b"]].param_name == "b"
    assert g[g.params["unused.weight"]].users == []  # unused but real parameters stay
    assert g.num_parameters() == 40
