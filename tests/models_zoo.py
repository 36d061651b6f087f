"""Small hand-written models for tests, each ``factory(...) -> (model, example_inputs)``, written the
way users write them rather than the way ``autopar.models`` does.

    mingpt()            Karpathy's minGPT: manual causal attention that scales by division with a
                        Python number, masks with a buffer and -inf, NewGELU written as pointwise
                        math, cross-entropy loss
    vit()               a Vision Transformer as timm-style code writes it: a strided Conv2d patch
                        embedding, a class token concatenated in front, a learned position
                        parameter, nn.MultiheadAttention blocks, the head on the class token
    moe(dispatch)       a top-2 mixture-of-experts language model as hand-written code routes it:
                        softmax router, topk, an auxiliary load-balancing loss; each expert runs
                        on every token weighted by its gate ("dense"), or on the tokens sent to
                        it ("indexed": boolean-mask indexing and index_add, data-dependent shapes)
    scalar_op(expr)     ``expr`` (Python, in terms of ``h``) applied to a parameter-derived tensor
                        ``h``: one op with a Python number in some operand's place
    in_place()          a language model that writes into tensors it made, as encoder-decoder and
                        hand-written code does: T5/BART's decoder-input shift (new_zeros, slice
                        assignment, masked_fill_), a slice assignment that carries gradients, an
                        index_put_ and a one-hot scatter_, an in-place chain (mul_, add_, relu_) on an
                        activation, and a running-mean buffer updated in place

A test in ``tests/<folder>/`` imports it after
``sys.path.insert(0, str(Path(__file__).resolve().parents[1]))`` (pytest puts only the test's own
folder on the path).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- minGPT ---------------------------------------------------------------------------------------
class NewGELU(nn.Module):
    """minGPT's GELU (the tanh approximation written out)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", mask)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        att = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = NewGELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.c_proj(self.act(self.c_fc(self.ln_2(x)))))


class MinGPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float = 0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device).unsqueeze(0)  # (1, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def mingpt(*, vocab: int = 64, block_size: int = 16, n_layer: int = 2, n_head: int = 4, n_embd: int = 32,
           batch: int = 4, dropout: float = 0.0, seed: int = 0):
    """A minGPT language model and ``(idx, targets)`` of shape (batch, block_size); returns the loss."""
    return _language_model(seed, lambda: MinGPT(vocab, block_size, n_layer, n_head, n_embd, dropout), vocab, batch,
                           block_size)


def _language_model(seed: int, make, vocab: int, batch: int, seq: int):
    """``make()`` and random ``(idx, targets)`` of shape (batch, seq), from ``seed`` (the global RNG untouched)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = make()
        idx = torch.randint(0, vocab, (batch, seq))
        targets = torch.randint(0, vocab, (batch, seq))
    return model, (idx, targets)


# ---- ViT --------------------------------------------------------------------------------------------
class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, dim: int, depth: int, heads: int, classes: int):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads, 2 * dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images, labels):
        x = self.patch(images).flatten(2).transpose(1, 2)  # (B, patches, dim)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)[:, 0]), labels)


def vit(*, image: int = 8, patch: int = 4, dim: int = 32, depth: int = 2, heads: int = 4, classes: int = 10,
        batch: int = 4, seed: int = 0):
    """A small ViT and ``(images, labels)``; returns the loss."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ViT(image, patch, dim, depth, heads, classes)
        images = torch.randn(batch, 3, image, image)
        labels = torch.randint(0, classes, (batch,))
    return model, (images, labels)


# ---- mixture of experts -------------------------------------------------------------------------------
class MoELayer(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, dispatch: str):
        super().__init__()
        self.top_k, self.dispatch = top_k, dispatch
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs = F.softmax(self.router(flat), dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = chosen == e  # (tokens, top_k)
            w = (weight * hit).sum(-1)  # this expert's gate per token (0 where not chosen)
            if self.dispatch == "dense":
                out = out + expert(flat) * w[:, None]
            else:
                rows = hit.any(-1)
                out = out.index_add(0, rows.nonzero().squeeze(-1), expert(flat[rows]) * w[rows, None])
        # Switch-style load balancing: fraction of tokens per expert times its mean router probability
        load = F.one_hot(chosen[:, 0], probs.shape[-1]).float().mean(0)
        aux = (load * probs.mean(0)).sum() * probs.shape[-1]
        return out.reshape(b, t, d), aux


class MoEModel(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int, experts: int, top_k: int, dispatch: str):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.layers = nn.ModuleList(MoELayer(dim, experts, top_k, dispatch) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = self.embed(idx)
        aux_total = 0.0
        for norm, layer in zip(self.norms, self.layers):
            y, aux = layer(norm(x))
            x = x + y
            aux_total = aux_total + aux
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.01 * aux_total


def moe(*, dispatch: str = "dense", vocab: int = 64, dim: int = 32, depth: int = 2, experts: int = 4, top_k: int = 2,
        batch: int = 4, seq: int = 8, seed: int = 0):
    """A top-k mixture-of-experts language model and ``(idx, targets)``; returns the loss."""
    return _language_model(seed, lambda: MoEModel(vocab, dim, depth, experts, top_k, dispatch), vocab, batch, seq)


# ---- writes into tensors made inside the model ------------------------------------------------------
class InPlaceLM(nn.Module):
    def __init__(self, vocab: int, dim: int, start: int = 1):
        super().__init__()
        self.start, self.vocab = start, vocab
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.onehot = nn.Linear(vocab, dim, bias=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("running", torch.zeros(dim))

    def forward(self, idx, targets):
        b, t = idx.shape
        # T5 / BART: decoder inputs are the targets shifted right, written into a fresh tensor
        dec = idx.new_zeros(idx.shape)
        dec[:, 1:] = targets[:, :-1].clone()
        dec[:, 0] = self.start
        dec.masked_fill_(dec == -100, 0)
        h = self.embed(dec)  # (B, T, C)
        # a slice assignment that carries gradients: half the features doubled, the rest zero
        half = h.shape[-1] // 2
        g = torch.zeros_like(h)
        g[..., :half] = h[..., :half] * 2.0
        # index_put_ on a fresh tensor: each sample's first position copied to its last
        first = torch.zeros_like(h)
        rows = torch.arange(b, device=h.device)
        first.index_put_((rows, torch.full_like(rows, t - 1)), h[:, 0])
        # a one-hot made with scatter_
        onehot = torch.zeros(b, t, self.vocab, dtype=h.dtype, device=h.device)
        onehot.scatter_(2, idx.unsqueeze(-1), 1.0)
        x = self.mix(g + first) + self.onehot(onehot)
        x.mul_(0.5).add_(h).relu_()
        self.running.mul_(0.9).add_(x.detach().mean((0, 1)) * 0.1)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def in_place(*, vocab: int = 16, dim: int = 8, batch: int = 4, seq: int = 6, seed: int = 0):
    """``InPlaceLM`` and ``(idx, targets)``; returns the loss."""
    return _language_model(seed, lambda: InPlaceLM(vocab, dim), vocab, batch, seq)


# ---- one op with a Python number as an operand -------------------------------------------------------
class ScalarOpModel(nn.Module):
    """``sum(expr(h))`` with ``h = x * w`` ((4, 8), positive, needs a gradient). A non-float result
    (a comparison, a bitwise op) is turned into a float and multiplied by ``h``, so the loss still
    depends on the parameter."""

    def __init__(self, expr: str, shape=(4, 8)):
        super().__init__()
        self.expr = expr
        self.fn = eval(f"lambda h: {expr}", {"torch": torch, "math": math, "F": F})  # noqa: S307 (test-only)
        self.w = nn.Parameter(torch.rand(shape, generator=torch.Generator().manual_seed(0)) + 0.5)

    def forward(self, x):
        h = x * self.w
        y = self.fn(h)
        if not y.is_floating_point():
            y = y.to(h.dtype) * h
        return y.sum()


def scalar_op(expr: str, shape=(4, 8)):
    """``ScalarOpModel(expr)`` and its input ``x`` (positive, so logs and roots are defined)."""
    x = torch.rand(shape, generator=torch.Generator().manual_seed(1)) + 0.5
    return ScalarOpModel(expr, shape), (x,)


# Per op name of ``autopar.sharding_spec.rules.pointwise.BINARY`` that has a Tensor-Scalar overload:
# expressions with a Python number in each place torch allows (``2.0 / h`` traces to reciprocal
# and mul, ``torch.div(2.0, h)`` to ``div.Tensor(2.0, h)``, ``2 ** h`` to ``pow.Scalar``).
SCALAR_OPS: dict[str, list[str]] = {
    "add": ["h + 2.0", "2.0 + h", "torch.add(h, 2.0, alpha=3)", "torch.add(2.0, h)"],
    "sub": ["h - 1", "torch.sub(h, 1.0, alpha=2)", "torch.sub(2.0, h)"],
    "rsub": ["1 - h", "torch.rsub(h, 2.0)"],
    "mul": ["h * 0.5", "0.5 * h", "torch.mul(2.0, h)"],
    "div": ["h / math.sqrt(8)", "2.0 / h", "torch.div(2.0, h)", "torch.div(h, 2, rounding_mode='floor')",
            "torch.div(2.0, h, rounding_mode='trunc')", "h.div(3.0, rounding_mode='trunc')"],
    "true_divide": ["torch.true_divide(h, 2.0)", "torch.true_divide(2.0, h)"],
    "pow": ["h ** 2", "2 ** h", "h ** 0.5", "torch.pow(h, 3.0)", "torch.pow(2.0, h)"],
    "fmod": ["torch.fmod(h, 0.7)"],
    "remainder": ["h % 0.7", "2.0 % h", "torch.remainder(2.0, h)"],
    "floor_divide": ["h // 0.7", "2.0 // h"],
    "eq": ["h == 1.0", "1.0 == h"],
    "ne": ["h != 1.0", "1.0 != h"],
    "lt": ["h < 1.0", "1.0 < h"],
    "le": ["h <= 1.0", "1.0 <= h"],
    "gt": ["h > 1.0", "1.0 > h"],
    "ge": ["h >= 1.0", "1.0 >= h"],
    "bitwise_and": ["torch.bitwise_and(h > 1, True)", "torch.bitwise_and(True, h > 1)"],
    "bitwise_or": ["torch.bitwise_or(h > 1, False)", "torch.bitwise_or(True, h > 1)"],
    "bitwise_xor": ["torch.bitwise_xor(h > 1, True)", "torch.bitwise_xor(True, h > 1)"],
    "__and__": ["(h > 1) & True", "True & (h > 1)"],
    "__or__": ["(h > 1) | False", "False | (h > 1)"],
    "__xor__": ["(h > 1) ^ True", "True ^ (h > 1)"],
    "copysign": ["torch.copysign(h, -1.0)"],
    "xlogy": ["torch.xlogy(h, 2.0)", "torch.xlogy(2.0, h)"],
    "masked_fill": ["h.masked_fill(h > 1, float('-inf')).softmax(-1)", "h.masked_fill(h > 1, 0.0)"],
    "clamp": ["torch.clamp(h, min=0.9)", "torch.clamp(h, max=0.9)", "torch.clamp(h, 0.8, 1.2)"],
    "clamp_min": ["h.clamp_min(0.9)"],
    "clamp_max": ["h.clamp_max(0.9)"],
    "lerp": ["torch.lerp(h, 2 * h, 0.5)"],
    "addcmul": ["torch.addcmul(h, h, h, value=0.5)"],
    "addcdiv": ["torch.addcdiv(h, h, h + 1, value=0.5)"],
}
# Forms of ops outside BINARY, or without a scalar overload, that users write with a number.
SCALAR_OPS_EXTRA: dict[str, list[str]] = {
    "where": ["torch.where(h > 1, h, 0.0)", "torch.where(h > 1, 0.0, h)", "torch.where(h > 1, h, -1.0)",
              "torch.where(h > 1, 1.0, 0.0)"],
    "maximum": ["torch.maximum(h, torch.tensor(1.0))", "torch.minimum(torch.tensor(1.0), h)"],
    "unary": ["torch.rsqrt(h) * 2.0", "F.leaky_relu(h - 1.0, 0.1)", "torch.round(h, decimals=1)"],
}
