"""``ir.batch_scaling``: a graph at another batch size read off two traces, against a real trace."""
import warnings

import pytest
import torch
import torch.nn as nn

from autopar import ir, models
from autopar.ir.batch_scaling import scaled_graph

warnings.simplefilter("ignore")


def _traces(make_inputs, model, batches):
    return {b: ir.trace(model, make_inputs(b)) for b in batches}


@pytest.mark.parametrize("name", ["gpt", "llama", "mlp"])
def test_built_in_models_scale_to_their_real_trace(name):
    model, inputs = models.build(name, **({"layers": 2} if name != "mlp" else {}))

    def at(b):
        return tuple(t[:1].expand(b, *t.shape[1:]).contiguous() for t in inputs)

    g = _traces(at, model, (2, 3, 8))
    scaled = scaled_graph(g[2], 2, g[3], 3, 8)
    assert scaled is not None and scaled.fingerprint() == g[8].fingerprint()
    assert scaled.total_flops() == g[8].total_flops()
    assert [n.meta for n in scaled] == [n.meta for n in g[8]]
    # down as well as up, and from any two sizes
    assert scaled_graph(g[8], 8, g[3], 3, 2).fingerprint() == g[2].fingerprint()


def test_a_transformers_model_with_an_attention_mask_scales():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)

    def trace(b):
        ids = torch.randint(0, 64, (b, 8), generator=torch.Generator().manual_seed(b))
        mask = torch.ones(b, 8, dtype=torch.long)
        return ir.trace(model, (), {"input_ids": ids, "attention_mask": mask, "labels": ids})

    g2, g4, g6 = trace(2), trace(4), trace(6)
    assert scaled_graph(g2, 2, g4, 4, 6).fingerprint() == g6.fingerprint()


class BatchBranch(nn.Module):
    """Code that branches on the batch size, or sizes a buffer by its square: not one program at
    every batch size, which the scaled graph cannot know (the search traces what it picks)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if self.how == "branch" and x.shape[0] > 4:
            y = torch.tanh(y)
        if self.how == "square":
            y = y.sum() + x.new_ones(x.shape[0] ** 2).sum()
        if self.how == "float":  # a mean written by hand: 1 / batch, a float in the graph
            y = y.sum() * (1.0 / x.shape[0])
        return y.sum()


@pytest.mark.parametrize("how", ["branch", "square", "float"])
def test_what_is_not_linear_in_the_batch_is_refused_or_differs_from_the_trace(how):
    model = BatchBranch(how)
    g = _traces(lambda b: (torch.randn(b, 4),), model, (2, 3, 8))
    scaled = scaled_graph(g[2], 2, g[3], 3, 8)
    if how == "float":
        assert scaled is None  # 1/2 and 1/3: floats that differ, not integers to scale
    else:
        assert scaled is None or scaled.fingerprint() != g[8].fingerprint()


def test_traces_of_different_programs_are_refused():
    a = ir.trace(BatchBranch("branch"), (torch.randn(2, 4),))
    b = ir.trace(BatchBranch("branch"), (torch.randn(8, 4),))  # takes the tanh branch: another program
    assert scaled_graph(a, 2, b, 8, 4) is None
    assert scaled_graph(a, 2, a, 2, 4) is None  # one batch size says nothing about the others
