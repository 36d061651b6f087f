"""The rules on real graphs: the built-in gpt, llama and mlp and transformers' GPT-2 and LLaMA.

Every call_function node has a rule (no replicated fallback), gets at least two strategies wherever
some tensor it touches can be split, and every strategy, run per rank on the node's real input
values, reproduces the node's real output. An op without a rule runs replicated with one warning.
"""
import warnings

import pytest
import torch
from rules_harness import Mesh, check_strategy

from autopar import models
from autopar.ir import Node, NodeRef, Role, TensorMeta, trace
from autopar.sharding_spec.rules import has_rule, strategies_for
from autopar.sharding_spec.strategy import OpContext, needs_lowering

# Replicated by design (see rules/constant.py): a local arange starts at 0; a 0-d tensor has no dims.
REPLICATE_ONLY = {"aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.scalar_tensor.default"}


def _hf(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "hf-gpt2":
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=48, vocab_size=64, max_position_embeddings=16)
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    return model.double().train(), {"input_ids": ids, "labels": ids, "use_cache": False}


def _built_in(name):
    if name == "mlp":
        model, inputs = models.build("mlp", layers=1, dtype=torch.float64)
        return model.train(), dict(zip(("x", "targets"), inputs))
    model, inputs = models.build(name, layers=1, width=32, heads=4, seq=8, vocab=64, batch=2, dtype=torch.float64)
    return model.train(), dict(zip(("idx", "targets"), inputs))


@pytest.fixture(scope="module", params=["gpt", "llama", "hf-gpt2", "hf-llama", "mlp"])
def traced(request):
    """(name, Graph, value of every node) for one model."""
    name = request.param
    model, kwargs = _hf(name) if name.startswith("hf") else _built_in(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, (), kwargs)
    return name, graph, _values(graph, model, kwargs)


def _values(graph, model, kwargs) -> dict:
    ep = graph.exported
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    feed = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            feed.append(kwargs[spec.arg.name])
        elif spec.target in state:
            feed.append(state[spec.target])
        else:
            feed.append(ep.constants[spec.target])
    interp = torch.fx.Interpreter(graph.gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*feed)
    return {n.name: v for n, v in interp.env.items()}


def _ctx(graph, node, mesh):
    return OpContext(node, mesh, [graph.nodes[i].meta if i in graph.nodes else None for i in node.inputs], graph)


def _splittable(graph, node) -> bool:
    metas = [graph.nodes[i].meta for i in node.inputs if i in graph.nodes] + [node.meta]
    flat = []
    for m in metas:
        flat += list(m) if isinstance(m, tuple) else [m]
    return any(isinstance(m, TensorMeta) and any(s % 2 == 0 for s in m.shape) for m in flat)


def test_every_op_has_a_rule(traced):
    name, graph, _ = traced
    ops = sorted({n.target for n in graph if n.op == "call_function"})
    missing = [t for t in ops if not has_rule(t)]
    assert not missing, f"{name}: ops without a rule (would run replicated): {missing}"


@pytest.mark.parametrize("mesh", [Mesh((2,)), Mesh((2, 2))], ids=str)
def test_every_splittable_node_has_choices(traced, mesh):
    name, graph, _ = traced
    poor = []
    for node in graph:
        if node.op != "call_function" or node.target in REPLICATE_ONLY or not _splittable(graph, node):
            continue
        strategies = strategies_for(_ctx(graph, node, mesh))
        if len(strategies) < 2:
            poor.append(f"{node}")
    assert not poor, f"{name} on {mesh}: nodes with only the replicated strategy:\n" + "\n".join(poor)


def test_every_strategy_is_exact_on_real_values(traced):
    # (2, 2) holds every one-axis strategy of (2,) twice over (on either axis) plus the two-axis ones.
    name, graph, values = traced
    mesh = Mesh((2, 2))
    checked, seen = 0, set()
    for node in graph:
        if node.op != "call_function":
            continue
        key = _signature(graph, node)
        if key in seen:  # the same op on the same shapes (q and k rotary, ...) was checked already
            continue
        seen.add(key)
        for s in strategies_for(_ctx(graph, node, mesh)):
            if needs_lowering(s.family):
                continue  # lowered by codegen; the lowering's math is tested in test_rules_nn.py
            check_strategy(node, s, values, values[node.name], mesh)
            checked += 1
    assert checked > 50


def _signature(graph, node) -> str:
    metas = [str(graph.nodes[i].meta) for i in node.inputs]
    return repr((node.target, metas, _shape_args(node.args), _shape_args(node.kwargs)))


def _shape_args(value):
    if isinstance(value, NodeRef):
        return "ref"
    if isinstance(value, (list, tuple)):
        return tuple(_shape_args(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _shape_args(v)) for k, v in value.items()))
    return repr(value)


def test_unknown_op_runs_replicated_and_is_said_once(caplog):
    node = Node(name="u", op="call_function", target="aten.no_such_op_for_tests.default", inputs=["x"],
                args=(NodeRef("x"),), kwargs={}, meta=TensorMeta((4, 6), "float32", 96), flops=0,
                role=Role.ACTIVATION, module_path="", module_type="")
    ctx = OpContext(node, Mesh((2, 2)), [TensorMeta((4, 6), "float32", 96)])
    with caplog.at_level("INFO", logger="autopar"), warnings.catch_warnings():
        warnings.simplefilter("error")  # an INFO record of the autopar logger, never a warning
        strategies = strategies_for(ctx)
        assert [str(s) for s in strategies] == ["([R, R]) -> [R, R] [replicate]"]
        assert len(strategies_for(ctx)) == 1
    assert caplog.text.count("no sharding rule for aten.no_such_op_for_tests.default") == 1
