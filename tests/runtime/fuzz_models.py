"""Random small models for fuzzing: a case is a plain dict (drawn by hypothesis in the test process,
sent to the ranks), ``build(case)`` makes the same model and inputs from it in every process.

A case stacks blocks on a (batch, seq, width) activation: linear layers (with and without bias),
MLPs with a residual, layer / RMS norms, attention (scaled dot-product, causal or not, several
heads, optionally under an additive float mask the model builds once from positions), 1-D
convolutions over the sequence, elementwise ops, views (a split into heads and back, a transpose),
reductions (a mean over the sequence that is broadcast back), a position embedding read through an
integer tensor the model builds once, and writes into tensors made inside the model (``WRITES``: a
T5-style shift into ``new_zeros`` by slice assignment, ``index_put_``, ``masked_fill_``, a one-hot
``scatter_``, an in-place chain on an activation); inputs start from an embedding of token ids or
from float features; the loss is a cross entropy over a vocabulary or a mean squared error. A case
may run as a 2-stage pipeline under any schedule (the mask and the positions then cross stages).
Sizes are drawn so that some divide the mesh and some do not."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

WRITES = ("shift_write", "index_put", "masked_fill_", "scatter_", "inplace_chain")
BLOCKS = ("linear", "mlp", "layernorm", "rmsnorm", "attention", "conv", "elementwise", "heads_view", "transpose",
          "seq_mean", "positions") + WRITES
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


@st.composite
def cases(draw):
    width = draw(st.sampled_from([4, 6, 8, 12, 16]))
    heads = draw(st.sampled_from([h for h in (1, 2, 4) if width % h == 0]))
    # one case in four a 2-stage pipeline (interleaved: 2 stages of 2 virtual stages each)
    pipeline = draw(st.sampled_from((None,) * 12 + SCHEDULES))
    min_blocks = {None: 1, "interleaved-1f1b": 4}.get(pipeline, 2)
    return {
        "batch": draw(st.sampled_from([2, 4, 6, 8] if pipeline else [1, 2, 3, 4, 6, 8])),
        "seq": draw(st.sampled_from([2, 3, 4, 5, 8])),
        "width": width,
        "heads": heads,
        "vocab": draw(st.sampled_from([None, 5, 8, 16])),
        "loss": draw(st.sampled_from(["ce", "mse"])),
        "blocks": draw(st.lists(st.tuples(st.sampled_from(BLOCKS), st.integers(0, 3)), min_size=min_blocks,
                                max_size=max(5, min_blocks))),
        "mask": draw(st.booleans()),
        "mesh": draw(st.sampled_from([(2,), (4,), (2, 2)])),
        # a pipeline plans its stages' layouts itself
        "force": "none" if pipeline else draw(st.sampled_from(["none", "dp", "tp", "zero2", "zero3", "node"])),
        "pipeline": pipeline,
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
        elif kind == "positions":
            self.pos = nn.Embedding(8, width)
        elif kind in ("index_put", "inplace_chain", "scatter_"):
            self.lin = nn.Linear(width, width)

    def forward(self, x, mask, positions):
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
            if mask is not None:
                y = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask)
            else:
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
        if k == "positions":  # an integer tensor made once by the model, read here
            return x + self.pos(positions)
        if k == "shift_write":  # T5's decoder-input shift, on an activation: new_zeros, slice writes
            y = x.new_zeros(x.shape)
            y[:, 1:] = x[:, :-1]
            y[:, 0] = float(self.arg)
            return x + y
        if k == "index_put":  # positions picked by an integer index, written into a fresh tensor
            idx = torch.arange(0, x.shape[1], 2, device=x.device)
            y = torch.zeros_like(x)
            v = self.lin(x)[:, idx]
            if self.arg == 0:
                y[:, idx] = v  # index_put_ with the batch dim left alone
            elif self.arg == 1:
                y[:, idx] += v
            else:  # each sample addressed by an arange over the batch (its own row)
                rows = torch.arange(x.shape[0], device=x.device)[:, None]
                y.index_put_((rows, idx[None, :]), v, accumulate=self.arg == 3)
            return x + y
        if k == "masked_fill_":  # a data-dependent mask, written in place into a copy
            y = x.clone()
            y.masked_fill_(x > 0.5 * self.arg, 0.0)
            return y
        if k == "inplace_chain":  # in-place ops on an activation, each writing into the last
            h = self.lin(x)
            h.mul_(0.5).add_(x).tanh_()
            return h
        if k == "scatter_":  # a one-hot of each position's largest feature
            y = torch.zeros_like(x).scatter_(2, self.lin(x).argmax(-1, keepdim=True), 1.0)
            return x + y * x
        return x - x.mean(dim=1, keepdim=True)  # seq_mean


class FuzzModel(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        c = case
        self.vocab, self.loss_kind, self.mask = c["vocab"], c["loss"], c.get("mask", False)
        self.embed = nn.Embedding(c["vocab"], c["width"]) if c["vocab"] else nn.Linear(3, c["width"])
        self.blocks = nn.ModuleList(_Block(k, a, c["width"], c["heads"]) for k, a in c["blocks"])
        self.head = nn.Linear(c["width"], c["vocab"] or 4) if c["loss"] == "ce" else nn.Linear(c["width"], 2)

    def forward(self, x, target):
        h = self.embed(x)
        b, t = h.shape[:2]
        positions = (torch.arange(t, device=h.device) % 8).expand(b, t)
        mask = None
        if self.mask:  # an additive float mask from positions: causal, a view broadcast over heads
            ar = torch.arange(t, device=h.device)
            mask = torch.zeros(t, t, device=h.device).masked_fill(ar[None, :] > ar[:, None], float("-inf"))[None, None]
        for block in self.blocks:
            h = block(h, mask, positions)
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
