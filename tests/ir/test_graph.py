"""Node metadata, roles and graph structure, checked against real executions."""
from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind

from autopar import models
from autopar.ir import Graph, Node, NodeRef, Role, TensorMeta, trace


def run_recording(graph: Graph, model, user_args: tuple) -> dict[str, object]:
    """Run the exported graph on the model's tensors; return every node's value by name."""
    ep = graph.exported
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    user = iter(user_args)
    flat = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            flat.append(next(user))
        elif spec.target in state:
            flat.append(state[spec.target])
        else:
            flat.append(ep.constants[spec.target])
    values: dict[str, object] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            values[n.name] = out = super().run_node(n)
            return out

    with torch.no_grad():
        Recorder(ep.graph_module).run(*flat)
    return values


def expected_meta(value):
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), str(value.dtype).removeprefix("torch."), value.numel() * value.element_size())
    if isinstance(value, (list, tuple)):
        return tuple(expected_meta(v) if isinstance(v, torch.Tensor) else None for v in value)
    return None


def test_tensor_meta_fields():
    m = TensorMeta.of(torch.empty(3, 4, dtype=torch.bfloat16))
    assert m == TensorMeta((3, 4), "bfloat16", 24)
    assert (m.numel, m.itemsize, m.torch_dtype, str(m)) == (12, 2, torch.bfloat16, "bfloat16[3, 4]")
    assert TensorMeta.of(torch.empty((), dtype=torch.int64)).nbytes == 8
    assert hash(m) == hash(TensorMeta((3, 4), "bfloat16", 24))  # frozen, usable as a key


def test_metadata_matches_real_execution(gpt, llama, mlp):
    for model, inputs, graph in (gpt, llama, mlp):
        values = run_recording(graph, model, inputs)
        for node in graph:
            if node.op == "output":
                continue
            assert node.meta == expected_meta(values[node.name]), node.name


def test_every_node_is_annotated(any_traced):
    _, _, graph = any_traced
    assert graph.nodes and list(graph.nodes) == [n.name for n in graph]
    for node in graph:
        assert isinstance(node, Node) and isinstance(node.role, Role)
        assert isinstance(node.flops, int) and node.flops >= 0
        assert node.fx_node is not None and node.fx_node.name == node.name
        val = node.fx_node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert isinstance(node.meta, TensorMeta)
            assert node.meta.shape == tuple(val.shape)
            assert node.meta.nbytes == node.meta.numel * node.meta.itemsize
        elif isinstance(val, (list, tuple)):
            assert isinstance(node.meta, tuple) and len(node.meta) == len(val)
        if node.op == "call_function":
            assert node.role in (Role.ACTIVATION, Role.OUTPUT)
            assert node.target and node.module_type


def test_edges_are_consistent_and_topological(any_traced):
    _, _, graph = any_traced
    position = {name: i for i, name in enumerate(graph.nodes)}
    for node in graph:
        refs = []
        _collect(node.args, refs)
        _collect(node.kwargs, refs)
        assert refs == node.inputs
        for name in node.inputs:
            assert position[name] < position[node.name]
            assert node.name in graph[name].users
        for user in node.users:
            assert node.name in graph[user].inputs


def _collect(value, out):
    if isinstance(value, NodeRef):
        out.append(value.name)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, out)


def test_roles_gpt(gpt):
    model, inputs, graph = gpt
    by_role = {r: [n for n in graph if n.role is r] for r in Role}
    assert len(by_role[Role.PARAMETER]) == len(list(model.parameters()))  # tied weight once
    assert [n.name for n in by_role[Role.INPUT]] == graph.inputs == ["idx", "targets"]
    assert graph["idx"].meta == TensorMeta((4, 32), "int64", 4 * 32 * 8)
    (loss,) = [n for n in by_role[Role.OUTPUT] if n.op == "call_function"]
    assert graph.outputs == [loss.name] and loss.target == "aten.cross_entropy_loss.default"
    assert loss.meta == TensorMeta((), "float32", 4)


def test_roles_buffers_and_constants(llama):
    _, _, graph = llama
    assert set(graph.buffers) == {"model.rope_cos", "model.rope_sin"}  # non-persistent buffers too
    for fqn, name in graph.buffers.items():
        assert graph[name].role is Role.BUFFER and graph[name].param_name == fqn

    class WithConstant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.full((4,), 2.0)  # a plain tensor attribute: a lifted constant

        def forward(self, x):
            return x * self.scale

    from autopar.ir import trace

    g = trace(WithConstant(), torch.randn(2, 4))
    assert [n.role for n in g if n.op == "placeholder"] == [Role.CONSTANT, Role.INPUT]


def test_training_ir_keeps_high_level_ops(gpt):
    _, _, graph = gpt
    targets = {n.target for n in graph}
    assert {"aten.linear.default", "aten.scaled_dot_product_attention.default", "aten.layer_norm.default"} <= targets
    assert "aten.mm.default" not in targets and "aten.native_layer_norm.default" not in targets


def test_module_paths(gpt):
    _, _, graph = gpt
    c_attn = graph["linear"]
    assert (c_attn.module_path, c_attn.module_type, c_attn.layer) == ("transformer.h.0.attn.c_attn", "Linear", "transformer.h.0")
    sdpa = next(n for n in graph if n.target == "aten.scaled_dot_product_attention.default")
    assert (sdpa.module_path, sdpa.module_type) == ("transformer.h.0.attn", "CausalSelfAttention")
    assert graph["idx"].module_path == "" and graph["idx"].module_type == "GPT"
    split = next(n for n in graph if n.target == "aten.split.Tensor")
    assert isinstance(split.meta, tuple) and len(split.meta) == 3
    assert split.args == (NodeRef("linear"), 64, 2)


def test_summary_and_str(gpt):
    _, _, graph = gpt
    s = graph.summary()
    assert s["nodes"] == len(graph.nodes) and s["layers"] == 3
    assert s["parameters"] == graph.num_parameters() and s["flops"] == graph.total_flops()
    assert s["repeated_blocks"] == [["transformer.h.0", 3]]
    text = str(graph)
    assert "transformer.h.2" in text and "(outside)" in text and "x3" in text
    assert "GPT" in repr(graph)


def test_the_graph_keeps_no_weight_of_the_model():
    """A parallelized module keeps its Graph for its life: a value held there would be a whole
    unsharded copy of the model on every rank (the exported program's state dict)."""
    model, inputs = models.build("gpt", layers=2)
    graph = trace(model, inputs)
    assert graph.exported.state_dict and all(v.is_meta for v in graph.exported.state_dict.values())
    params = {id(p) for p in model.parameters()}
    assert not any(id(v) in params for v in graph.exported.state_dict.values())
    assert all(not p.is_meta for p in model.parameters())  # the model itself is untouched
