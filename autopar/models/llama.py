"""A Llama-style decoder: RMSNorm written as plain ops, SwiGLU MLP, rotary position embeddings
from precomputed cos/sin buffers, grouped-query attention (``kv_heads`` < ``heads``, K/V repeated
with expand + reshape) and an untied lm_head. Module names follow Hugging Face
(``model.layers.2.self_attn.q_proj``), so a layer id reads ``model.layers.2``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import ConfigError
from autopar.models._common import require_divisible, require_positive, token_batch


@dataclasses.dataclass(kw_only=True)
class LlamaConfig:
    layers: int = 2
    """Number of decoder layers."""
    width: int = 64
    """Model width, d_model."""
    heads: int = 4
    """Query heads; ``width`` must be a multiple of it."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); ``heads`` must be a multiple of it."""
    hidden: int = 172
    """Inner width of the SwiGLU MLP."""
    seq: int = 32
    """Sequence length of the example inputs and of the rotary tables."""
    vocab: int = 256
    """Vocabulary size."""
    batch: int = 4
    """Batch size of the example inputs."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self):
        require_positive(self, "layers", "width", "heads", "kv_heads", "hidden", "seq", "vocab", "batch")
        require_divisible(self, "width", "heads")
        require_divisible(self, "heads", "kv_heads")
        if (self.width // self.heads) % 2:
            raise ConfigError(f"LlamaConfig: head dim width/heads ({self.width // self.heads}) must be even for rotary")
        if self.rope_theta <= 0 or self.eps <= 0:
            raise ConfigError(f"LlamaConfig: rope_theta ({self.rope_theta}) and eps ({self.eps}) must be > 0")


PRESETS = {
    "default": {},
    # ~10M parameters, for benchmarks.
    "bench": dict(layers=6, width=320, heads=8, kv_heads=4, hidden=864, seq=256, vocab=4096, batch=8),
}


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.width // cfg.heads
        self.q_proj = nn.Linear(cfg.width, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd, rep = self.head_dim, self.heads // self.kv_heads
        q = self.q_proj(x).view(B, T, self.heads, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.kv_heads, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if rep > 1:  # grouped-query attention: each kv head serves `rep` query heads
            k = k[:, :, None].expand(B, self.kv_heads, rep, T, hd).reshape(B, self.heads, T, hd)
            v = v[:, :, None].expand(B, self.kv_heads, rep, T, hd).reshape(B, self.heads, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.width, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.width, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.width, cfg.eps)
        hd = cfg.width // cfg.heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv_freq)  # (T, hd/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, hd)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed_tokens(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.model(idx))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(cfg: LlamaConfig, device) -> tuple[nn.Module, tuple]:
    return Llama(cfg), token_batch(cfg.batch, cfg.seq, cfg.vocab, device)
