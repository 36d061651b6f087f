"""A nanoGPT-style decoder: token + position embeddings, pre-LN blocks, causal self-attention
through ``F.scaled_dot_product_attention``, a GELU MLP, a final LayerNorm and an lm_head tied to
the token embedding. Module names follow nanoGPT / GPT-2 (``transformer.h.3.attn.c_attn``), so a
layer id reads ``transformer.h.3``.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models._common import (
    require_divisible,
    require_positive,
    require_probability,
    token_batch,
)


@dataclasses.dataclass(kw_only=True)
class GPTConfig:
    layers: int = 2
    """Number of transformer blocks."""
    width: int = 64
    """Model (embedding) width, d_model."""
    heads: int = 4
    """Attention heads per block; ``width`` must be a multiple of it."""
    seq: int = 32
    """Sequence length of the example inputs, also the number of learned positions."""
    vocab: int = 256
    """Vocabulary size."""
    batch: int = 4
    """Batch size of the example inputs."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and residual branches (0 disables it)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""

    def __post_init__(self):
        require_positive(self, "layers", "width", "heads", "seq", "vocab", "batch")
        require_divisible(self, "width", "heads")
        require_probability(self, "dropout")


PRESETS = {
    "default": {},
    # ~10M parameters: 6 * 12 * 320^2 (blocks) + 8192 * 320 (tied embedding) + 256 * 320.
    "bench": dict(layers=6, width=320, heads=5, seq=256, vocab=8192, batch=8),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.width, 4 * cfg.width, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.width, cfg.width, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab, cfg.width),
                wpe=nn.Embedding(cfg.seq, cfg.width),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.layers)),
                ln_f=nn.LayerNorm(cfg.width, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(cfg: GPTConfig, device) -> tuple[nn.Module, tuple]:
    return GPT(cfg), token_batch(cfg.batch, cfg.seq, cfg.vocab, device)
