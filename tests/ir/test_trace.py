"""trace(): meta models, fingerprints, input forms and failures."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar.models
from autopar.errors import TraceError
from autopar.ir import Graph, TensorMeta, trace


def test_meta_model_traces_with_full_shapes():
    B, T, C, V = 8, 1024, 1024, 50304
    model, inputs = autopar.models.build("gpt", device="meta", layers=2, width=C, heads=16, seq=T, vocab=V, batch=B)
    assert all(p.is_meta for p in model.parameters()) and all(t.is_meta for t in inputs)
    g = trace(model, inputs)
    lm_head = next(n for n in g if n.op == "call_function" and n.module_path == "lm_head")
    assert lm_head.meta == TensorMeta((B, T, V), "float32", B * T * V * 4)
    assert lm_head.flops == 2 * B * T * C * V
    assert g.num_parameters() == sum(p.numel() for p in model.parameters())
    assert g.blocks == [["transformer.h.0", "transformer.h.1"]]


def test_meta_llama_bf16():
    model, inputs = autopar.models.build("llama", device="meta", dtype=torch.bfloat16, width=512, heads=8, kv_heads=2)
    g = trace(model, inputs)
    q_proj, k_proj = (
        next(n for n in g if n.op == "call_function" and n.module_path == f"model.layers.0.self_attn.{p}")
        for p in ("q_proj", "k_proj")
    )
    assert q_proj.meta == TensorMeta((4, 32, 512), "bfloat16", 4 * 32 * 512 * 2)
    assert k_proj.meta.shape == (4, 32, 2 * 64)


def test_fingerprint():
    def graph(**kw) -> Graph:
        model, inputs = autopar.models.build("mlp", **kw)
        return trace(model, inputs)

    a = graph(seed=1)
    fp = a.fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert fp == a.fingerprint() == graph(seed=2).fingerprint()  # values do not matter
    assert graph(batch=16).fingerprint() != fp  # a shape does
    assert graph(dtype=torch.float64).fingerprint() != fp  # so does a dtype

    class Renamed(nn.Module):
        def __init__(self, name):
            super().__init__()
            setattr(self, name, nn.Linear(4, 4))
            self.name = name

        def forward(self, x):
            return getattr(self, self.name)(x)

    x = torch.randn(2, 4)
    assert trace(Renamed("fc"), x).fingerprint() == trace(Renamed("fc"), x).fingerprint()
    assert trace(Renamed("fc"), x).fingerprint() != trace(Renamed("proj"), x).fingerprint()


def test_input_forms_and_kwargs():
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert trace(lin, x).fingerprint() == trace(lin, (x,)).fingerprint() == trace(lin, [x]).fingerprint()

    class KW(nn.Module):
        def forward(self, x, *, scale=None):
            return x * scale

    g = trace(KW(), (x,), {"scale": torch.ones(4)})
    assert g.inputs == ["x", "scale"] and g.model_name == "KW"


def test_hf_kwargs_and_outputs(hf_gpt2):
    _, _, graph = hf_gpt2
    assert graph.inputs == ["input_ids", "labels"]
    loss, logits = (graph[o] for o in graph.outputs)
    assert loss.meta.shape == () and logits.meta.shape == (2, 16, 128)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def test_untraceable_model_raises_trace_error():
    with pytest.raises(TraceError) as info:
        trace(DataDependent(), torch.randn(3, 4))
    msg = str(info.value)
    assert "DataDependent" in msg
    assert "data-dependent" in msg
    assert "x.sum() > 0" in msg  # the user's line
    assert "torch.where" in msg and "torch.cond" in msg  # what to try
    assert info.value.__cause__ is not None


def test_other_failures_name_the_model():
    class Broken(nn.Module):
        def forward(self, x):
            return x @ torch.ones(5, 5)  # shape mismatch

    with pytest.raises(TraceError, match="Broken") as info:
        trace(Broken(), torch.randn(3, 4))
    assert "x @ torch.ones(5, 5)" in str(info.value)  # the user's line, found in the traceback
    assert "runs eagerly" in str(info.value) and info.value.__cause__ is not None


class _TwoInputs(nn.Module):
    def forward(self, a, b=None):
        return a * 2 - b


@pytest.mark.parametrize("call", ["same object", "keyword", "view"])
def test_aliased_example_inputs_trace_as_separate_inputs(call):
    """torch.export merges inputs that share memory into one placeholder; a model traced with
    ``labels=input_ids`` would then read input_ids for its labels on every later call."""
    x = torch.randn(4)
    args, kwargs = {"same object": ((x, x), {}), "keyword": ((x,), {"b": x}), "view": ((x,), {"b": x[:]})}[call]
    g = trace(_TwoInputs(), args, kwargs)
    sub = next(n for n in g if n.op == "call_function" and "sub" in n.target)
    mul = next(n for n in g if n.op == "call_function" and "mul" in n.target)
    assert mul.inputs[0] != sub.inputs[1]  # a feeds the mul, b the sub
    ones, zeros = torch.ones(4), torch.zeros(4)
    out = g.exported.module()(ones, zeros) if call == "same object" else g.exported.module()(ones, b=zeros)
    assert out.tolist() == [2.0] * 4


def test_data_dependent_shapes_are_a_trace_error_that_says_what_to_do():
    """A mixture of experts that runs each expert on the tokens routed to it (nonzero, boolean-mask
    indexing) has sizes that depend on values; the dense-dispatch one traces."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models_zoo import moe

    model, inputs = moe(dispatch="indexed")
    with pytest.raises(TraceError, match=r"aten\.nonzero\.default in layers\.0 makes a tensor whose size depends on "
                                         r"tensor values.*dispatch densely"):
        trace(model, inputs)
    model, inputs = moe(dispatch="dense")
    graph = trace(model, inputs)
    assert {"aten.topk.default", "aten.one_hot.default"} <= {n.target for n in graph}
