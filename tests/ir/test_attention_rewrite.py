"""``autopar.ir.attention``: decomposed attention fused into SDPA, constant causal masks folded
into ``is_causal``, repeated key/value heads given to SDPA once (``enable_gqa``), exactly where the
values (and gradients) stay, and nowhere else."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import ir
from autopar.ir import attention
from autopar.ir.attention import fold_causal_masks, fuse_attention, unexpand_kv_heads

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_zoo  # noqa: E402

SDPA = "aten.scaled_dot_product_attention.default"


class HandAttention(nn.Module):
    """Self-attention written out, in the ways models write it. ``mask``: "causal" (a tril buffer,
    filled with ``fill``), "where" (the same buffer kept by ``torch.where``, the dtype's lowest
    elsewhere), "window" (a banded buffer), "bias" (an additive constant), "row" (a constant mask
    with its first row masked whole), "input" (a boolean mask passed in, -inf).
    ``kt``: "transpose" (k.transpose(-2, -1)), or "permute" (k^T laid out directly, no transpose
    of k). ``scale``: "div", "mul", "tensor" (divided by a 0-d tensor) or "none". ``weights``: also return the attention weights.
    ``heads=0``: 3-D (batch, length, dim) with bmm."""

    def __init__(self, seq=16, dim=16, heads=2, mask="causal", fill=-math.inf, kt="transpose", scale="div",
                 dropout=0.0, weights=False):
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.mask, self.fill, self.kt, self.scale, self.weights = heads, mask, fill, kt, scale, weights
        self.drop = nn.Dropout(dropout)
        tril = torch.ones(seq, seq).tril()
        if mask == "window":
            tril = tril - torch.ones(seq, seq).tril(-4)
        if mask == "row":
            tril[0] = 0
        self.register_buffer("tri", tril)
        self.register_buffer("inv_scale", torch.tensor(0.5))
        self.register_buffer("bias", -0.1 * (torch.arange(seq)[:, None] - torch.arange(seq)[None]).abs().float())

    def forward(self, x, pad=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        if self.heads:
            shape = (b, t, self.heads, c // self.heads)
            q, v = (y.view(shape).transpose(1, 2) for y in (q, v))
            kt = k.view(shape).permute(0, 2, 3, 1) if self.kt == "permute" else k.view(shape).transpose(1, 2).transpose(-2, -1)
        else:
            kt = k.permute(0, 2, 1) if self.kt == "permute" else k.transpose(-2, -1)
        att = (q @ kt) if self.heads else torch.bmm(q, kt)
        d = q.shape[-1]
        if self.scale == "tensor":  # transformers 4.x GPT-2: a 0-d tensor, a no-op cast, a where
            att = (att / torch.full([], d ** 0.5, dtype=att.dtype)).to(att.dtype)
        elif self.scale == "buffer":  # a scale a user may load or schedule
            att = att * self.inv_scale
        else:
            att = att / math.sqrt(d) if self.scale == "div" else att * (1 / math.sqrt(d)) if self.scale == "mul" else att
        if self.mask == "where":
            att = torch.where(self.tri[:t, :t].bool(), att, torch.full([], torch.finfo(att.dtype).min, dtype=att.dtype))
        elif self.mask in ("causal", "window", "row"):
            att = att.masked_fill(self.tri[:t, :t] == 0, self.fill)
        elif self.mask == "bias":
            att = att + self.bias[:t, :t]
        elif self.mask == "input":
            att = att.masked_fill(~pad, -math.inf)
        p = self.drop(F.softmax(att, dim=-1).type(v.dtype))
        y = (p @ v) if self.heads else torch.bmm(p, v)
        y = y.transpose(1, 2).reshape(b, t, c) if self.heads else y
        out = self.proj(y).square().mean()
        return (out, p.sum()) if self.weights else out


def rewritten(model, args):
    """(how many fused, how many folded, the rewritten exported program)."""
    ep = torch.export.export(model, args, strict=False)
    return fuse_attention(ep), fold_causal_masks(ep), ep


class RepeatedKV(nn.Module):
    """Grouped-query attention with the key/value heads repeated before SDPA (the built-in LLaMA's
    and transformers' ``repeat_kv``); ``only_k``: the values' heads are repeated another way."""

    def __init__(self, heads=4, kv_heads=2, dim=16, only_k=False):
        super().__init__()
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim * kv_heads // heads)
        self.heads, self.kv_heads, self.only_k = heads, kv_heads, only_k

    def forward(self, x):
        b, t, c = x.shape
        hd, rep = c // self.heads, self.heads // self.kv_heads
        q = self.q(x).view(b, t, self.heads, hd).transpose(1, 2)
        k, v = (y.view(b, t, self.kv_heads, hd).transpose(1, 2) for y in self.kv(x).chunk(2, dim=-1))
        k = k[:, :, None].expand(b, self.kv_heads, rep, t, hd).reshape(b, self.heads, t, hd)
        v = (v.repeat(1, rep, 1, 1) if self.only_k
             else v[:, :, None].expand(b, self.kv_heads, rep, t, hd).reshape(b, self.heads, t, hd))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()


def test_repeated_key_value_heads_reach_sdpa_once():
    torch.manual_seed(0)
    model = RepeatedKV()
    ep = torch.export.export(model, X, strict=False)
    assert unexpand_kv_heads(ep) == 1
    (node,) = sdpa_nodes(ep)
    assert node.kwargs["enable_gqa"] is True
    assert [tuple(a.meta["val"].shape) for a in node.args[:3]] == [(2, 4, 16, 4), (2, 2, 16, 4), (2, 2, 16, 4)]
    assert "aten.expand.default" not in ops(ep)
    assert_same(model, ep, X)
    # values repeated head-major (v.repeat) are other heads in another order: left alone
    ep = torch.export.export(RepeatedKV(only_k=True), X, strict=False)
    assert unexpand_kv_heads(ep) == 0 and "aten.expand.default" in ops(ep)


def test_the_builtin_llama_traces_grouped_query_attention():
    from autopar import models

    model, inputs = models.build("llama", layers=2, width=64, heads=4, kv_heads=2, hidden=96, seq=16, batch=2, vocab=64)
    graph = ir.trace(model, inputs)
    sdpa = [n for n in graph.nodes.values() if n.target == SDPA]
    assert len(sdpa) == 2
    for n in sdpa:
        q, k, v = (graph.nodes[i].meta.shape for i in n.inputs[:3])
        assert n.kwargs.get("enable_gqa") and q[1] == 4 and k[1] == v[1] == 2


def assert_same(model, ep, args, tol=1e-6):
    """Loss and every parameter gradient of the rewritten program against the model's own."""
    def run(module):
        module.zero_grad()
        out = module(*args)
        loss = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else out.loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.parameters()]

    (ref, ref_g), (got, got_g) = run(model), run(ep.module())
    assert abs(got - ref) <= tol * max(1.0, abs(ref))
    for a, b in zip(ref_g, got_g, strict=True):
        assert (a - b).abs().max() <= tol * max(1.0, a.abs().max()), (a - b).abs().max()


def sdpa_nodes(ep):
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target == attention.SDPA]


def ops(ep) -> set[str]:
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


X = (torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("scale", ["div", "mul", "tensor", "none"])
@pytest.mark.parametrize("kt", ["transpose", "permute"])
@pytest.mark.parametrize("heads", [2, 0])
def test_causal_attention_written_out_becomes_causal_sdpa(scale, kt, heads):
    torch.manual_seed(0)
    model = HandAttention(scale=scale, kt=kt, heads=heads)
    fused, folded, ep = rewritten(model, X)
    assert (fused, folded) == (1, 1)
    (node,) = sdpa_nodes(ep)
    d = 16 // heads if heads else 16
    assert node.kwargs["is_causal"] is True and "attn_mask" not in node.kwargs
    assert node.kwargs["scale"] == pytest.approx(1.0 if scale == "none" else 1 / math.sqrt(d))
    assert not ops(ep) & {"aten.softmax.int", "aten.masked_fill.Scalar", "aten.eq.Scalar"}
    assert_same(model, ep, X)


def test_transformers_4_gpt2_attention_becomes_causal_sdpa():
    """A causal buffer kept by ``torch.where`` (the lowest value elsewhere), scaled by a 0-d tensor,
    casts to the dtype it already has (transformers 4.x GPT-2's eager attention)."""
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        model = HandAttention(mask="where", scale="tensor").to(dtype)
        args = (X[0].to(dtype),)
        fused, folded, ep = rewritten(model, args)
        assert (fused, folded) == (1, 1), dtype
        assert not ops(ep) & {"aten.softmax.int", "aten.where.self", "aten.div.Tensor"}
        assert_same(model, ep, args, tol=tol)


def test_a_finite_fill_folds_only_where_no_row_is_filled_whole():
    torch.manual_seed(0)
    model = HandAttention(fill=-1e9)
    assert rewritten(model, X)[:2] == (1, 1)
    assert_same(model, rewritten(model, X)[2], X)
    # a row masked whole comes out uniform under a finite fill; SDPA would differ: left as written
    fused, folded, ep = rewritten(HandAttention(mask="row", fill=-1e9), X)
    assert (fused, folded) == (0, 0) and "aten.softmax.int" in ops(ep)


def test_masks_that_are_not_causal_stay_masks():
    torch.manual_seed(0)
    for mask, kind in (("window", torch.bool), ("bias", torch.float32)):
        model = HandAttention(mask=mask)
        fused, folded, ep = rewritten(model, X)
        assert (fused, folded) == (1, 0), mask
        (node,) = sdpa_nodes(ep)
        assert node.kwargs["attn_mask"].meta["val"].dtype == kind
        assert_same(model, ep, X)


def test_a_mask_from_an_input_is_fused_but_not_folded():
    torch.manual_seed(0)
    pad = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
    pad[1, :, :, :3] = False
    pad[1, :, :3, 0] = True  # every row keeps a key
    model, args = HandAttention(mask="input"), (X[0], pad)
    fused, folded, ep = rewritten(model, args)
    assert (fused, folded) == (1, 0)
    assert_same(model, ep, args)


def test_what_would_change_is_left_as_written():
    torch.manual_seed(0)
    # dropout drawn in training; the weights read by another op
    for model in (HandAttention(dropout=0.1), HandAttention(weights=True)):
        fused, _, ep = rewritten(model, X)
        assert fused == 0 and "aten.softmax.int" in ops(ep)
    # dropout off in eval mode: fused
    model = HandAttention(dropout=0.1).eval()
    fused, folded, ep = rewritten(model, X)
    assert (fused, folded) == (1, 1)
    assert_same(model, ep, X)


def test_a_scale_read_from_a_buffer_stays_written_out():
    fused, _, ep = rewritten(HandAttention(scale="buffer"), X)
    assert fused == 0 and "aten.softmax.int" in ops(ep)


def test_masks_past_the_fold_limit_stay(monkeypatch):
    monkeypatch.setattr(attention, "FOLD_LIMIT", 100)
    fused, folded, ep = rewritten(HandAttention(), X)
    assert (fused, folded) == (1, 0)
    assert "attn_mask" in sdpa_nodes(ep)[0].kwargs


def test_mingpt_traces_to_causal_sdpa():
    model, inputs = models_zoo.mingpt(block_size=32, batch=2)
    graph = ir.trace(model, inputs)
    sdpa = [n for n in graph.nodes.values() if n.target == SDPA]
    assert len(sdpa) == 2 and all(n.kwargs.get("is_causal") for n in sdpa)
    assert not any(n.target in ("aten.softmax.int", "aten.masked_fill.Scalar") for n in graph.nodes.values())
    fused, folded, ep = rewritten(model, tuple(inputs))
    assert_same(model, ep, tuple(inputs))


def _hf_llama(impl: str):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                   attn_implementation=impl)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_transformers_causal_lm_without_padding_runs_causal_sdpa(impl):
    """transformers builds a causal mask tensor from aranges for every call; without a padding
    mask it is a constant: folded (both layers share it), and the eager attention fused."""
    model = _hf_llama(impl)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    ep = torch.export.export(model, (), kwargs, strict=False)
    assert (fuse_attention(ep), fold_causal_masks(ep)) == ((2 if impl == "eager" else 0), 2)
    assert unexpand_kv_heads(ep) == 2  # repeat_kv undone: 2 key/value heads reach SDPA
    assert all(n.kwargs.get("is_causal") and n.args[3:4] in ((), (None,)) for n in sdpa_nodes(ep))
    # the mask's ops went: nothing (16, 16) is computed any more
    assert not [n for n in ep.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
                and n.meta["val"].dim() == 4 and tuple(n.meta["val"].shape[-2:]) == (16, 16)]

    def run(module):
        module.zero_grad()
        loss = module(**kwargs).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.parameters()]

    (ref, ref_g), (got, got_g) = run(model), run(ep.module())
    assert abs(ref - got) < 1e-6 and max((a - b).abs().max() for a, b in zip(ref_g, got_g)) < 1e-6


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_transformers_padding_masks_are_kept(impl):
    model = _hf_llama(impl)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    ep = torch.export.export(model, (), {"input_ids": ids, "labels": ids, "attention_mask": mask}, strict=False)
    # the eager padding mask is added, and rows of left padding are masked whole: kept decomposed
    assert (fuse_attention(ep), fold_causal_masks(ep)) == (0, 0)
