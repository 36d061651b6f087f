"""A plain MLP regressor: ``proj_in`` (width -> hidden), ``layers`` identical hidden Linear layers
held in a ModuleList with the ReLU applied in the parent's loop, and ``proj_out`` (hidden -> width).
Layer ids read ``layers.1``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models._common import require_positive


@dataclasses.dataclass(kw_only=True)
class MLPConfig:
    layers: int = 2
    """Number of hidden (hidden -> hidden) Linear layers in the ModuleList."""
    width: int = 32
    """Input and output features."""
    hidden: int = 64
    """Hidden features."""
    batch: int = 8
    """Batch size of the example inputs."""
    bias: bool = True
    """Whether the Linear layers carry a bias."""

    def __post_init__(self):
        require_positive(self, "layers", "width", "hidden", "batch")


PRESETS = {
    "default": {},
    "bench": dict(layers=8, width=1024, hidden=1024, batch=64),
}


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        self.proj_in = nn.Linear(cfg.width, cfg.hidden, bias=cfg.bias)
        self.layers = nn.ModuleList(nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias) for _ in range(cfg.layers))
        self.proj_out = nn.Linear(cfg.hidden, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = torch.relu(self.proj_in(x))  # (B, hidden)
        for layer in self.layers:
            x = torch.relu(layer(x))
        out = self.proj_out(x)  # (B, width)
        if targets is None:
            return out
        return F.mse_loss(out, targets)


def build(cfg: MLPConfig, device) -> tuple[nn.Module, tuple]:
    x = torch.randn(cfg.batch, cfg.width, device=device)
    targets = torch.randn(cfg.batch, cfg.width, device=device)
    return MLP(cfg), (x, targets)
