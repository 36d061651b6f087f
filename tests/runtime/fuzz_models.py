"""Random small models for fuzzing: a case is a plain dict (drawn by hypothesis in the test process,
sent to the ranks), ``build(case)`` makes the same model and inputs from it in every process.

A case stacks blocks on a (batch, seq, width) activation: linear layers (with and without bias),
MLPs with a residual, layer / RMS norms, attention (scaled dot-product, causal or not, several
heads), 1-D convolutions over the sequence, elementwise ops, views (a split into heads and back,
a transpose), reductions (a mean over the sequence that is broadcast back); inputs start from an
embedding of token ids or from float features; the loss is a cross entropy over a vocabulary or a
mean squared error. Sizes are drawn so that some divide the mesh and some do not."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

BLOCKS = ("linear", "mlp", "layernorm", "rmsnorm", "attention", "conv", "elementwise", "heads_view", "transpose",
          "seq_mean")


@st.composite
def cases(draw):
    width = draw(st.sampled_from([4, 6, 8, 12, 16]))
    heads = draw(st.sampled_from([h for h in (1, 2, 4) if width % h == 0]))
    return {
        "batch": draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
        "seq": draw(st.sampled_from([2, 3, 4, 5, 8])),
        "width": width,
        "heads": heads,
        "vocab": draw(st.sampled_from([None, 5, 8, 16])),
        "loss": draw(st.sampled_from(["ce", "mse"])),
        "blocks": draw(st.lists(st.tuples(st.sampled_from(BLOCKS), st.integers(0, 3)), min_size=1, max_size=5)),
        "mesh": draw(st.sampled_from([(2,), (4,), (2, 2)])),
        "force": draw(st.sampled_from(["none", "dp", "tp", "zero2", "zero3", "node"])),
        "seed": draw(st.integers(0, 2**16)),
        # the gradient convention: priced ("auto"), dual everywhere, or whole on every axis
        "identical": draw(st.sampled_from(["auto", "none", "all"])),
    }


class _Block(nn.Module):
    def __init__(self, kind: str, arg: int, width: int, heads: int):
        super().__init__()
        self.kind, self.heads, self.arg = kind, heads, arg
        if kind == "linear":
            self.lin = nn.Linear(width, width, bias=arg % 2 == 0)
        elif kind == "mlp":
            self.up, self.down = nn.Linear(width, width * (arg + 1)), nn.Linear(width * (arg + 1), width)
        elif kind == "layernorm":
            self.norm = nn.LayerNorm(width, elementwise_affine=arg != 3)
        elif kind == "rmsnorm":
            self.norm = nn.RMSNorm(width)
        elif kind == "attention":
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        elif kind == "conv":
            self.conv = nn.Conv1d(width, width, kernel_size=2 * (arg % 2) + 1, padding=arg % 2)

    def forward(self, x):
        k = self.kind
        if k == "linear":
            return self.lin(x)
        if k == "mlp":
            return x + self.down(F.gelu(self.up(x)))
        if k in ("layernorm", "rmsnorm"):
            return self.norm(x)
        if k == "attention":
            b, t, c = x.shape
            q, kk, v = self.qkv(x).split(c, dim=-1)
            q, kk, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, kk, v))
            y = F.scaled_dot_product_attention(q, kk, v, is_causal=self.arg % 2 == 0)
            return x + self.out(y.transpose(1, 2).reshape(b, t, c))
        if k == "conv":
            return self.conv(x.transpose(1, 2)).transpose(1, 2)
        if k == "elementwise":
            return (torch.tanh, torch.sigmoid, lambda y: y * y, F.silu)[self.arg](x)
        if k == "heads_view":
            b, t, c = x.shape
            return (x.view(b, t, self.heads, c // self.heads) * 2.0).reshape(b, t, c)
        if k == "transpose":
            return x.transpose(0, 1).contiguous().transpose(0, 1) + 1.0
        return x - x.mean(dim=1, keepdim=True)  # seq_mean


class FuzzModel(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        c = case
        self.vocab, self.loss_kind = c["vocab"], c["loss"]
        self.embed = nn.Embedding(c["vocab"], c["width"]) if c["vocab"] else nn.Linear(3, c["width"])
        self.blocks = nn.ModuleList(_Block(k, a, c["width"], c["heads"]) for k, a in c["blocks"])
        self.head = nn.Linear(c["width"], c["vocab"] or 4) if c["loss"] == "ce" else nn.Linear(c["width"], 2)

    def forward(self, x, target):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        out = self.head(h)
        if self.loss_kind == "ce":
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        return F.mse_loss(out, target)


def build(case: dict):
    """(model, (inputs, targets)) of a case, the same in every process."""
    torch.manual_seed(case["seed"])
    model = FuzzModel(case)
    b, t = case["batch"], case["seq"]
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randint(0, case["vocab"], (b, t), generator=g) if case["vocab"] else torch.randn(b, t, 3, generator=g)
    if case["loss"] == "ce":
        y = torch.randint(0, case["vocab"] or 4, (b, t), generator=g)
    else:
        y = torch.randn(b, t, 2, generator=g)
    return model, (x, y)


def force_of(case: dict, graph=None):
    """The forced strategies of a case: a hand-style layout on every axis, or one linear node forced
    to a random family (which may not exist for it: the planner must then say so, typed)."""
    import autopar

    n = 1
    for s in case["mesh"]:
        n *= s
    kind = case["force"]
    if kind == "none":
        return None
    zero = int(kind[-1]) if kind.startswith("zero") else 0
    if len(case["mesh"]) == 2 and kind != "node":  # a 2-D mesh: data parallel on axis 0, tensor on axis 1
        return autopar.Layout(dp=case["mesh"][0], tp=case["mesh"][1], zero=zero if kind != "tp" else 0)
    if kind == "dp":
        return autopar.Layout(dp=n)
    if kind == "tp":
        return autopar.Layout(tp=n)
    if kind in ("zero2", "zero3"):
        return autopar.Layout(dp=n, zero=zero)
    linears = [name for name, node in graph.nodes.items() if node.op == "call_function" and "linear" in str(node.target)]
    if not linears:
        return None
    name = linears[case["seed"] % len(linears)]
    family = ("1d-col", "1d-row", "dp", "replicate")[case["seed"] // 7 % 4]
    return {name: family}
