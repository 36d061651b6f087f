"""A user's model factory for `autopar explain tests.cli.factory_model:build` style loading."""
import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, (torch.randn(8, 16),)


def broken():
    return "not a model"


class _Keyed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, x, *, scale):
        return (self.proj(x) * scale).square().mean()


def build_with_kwargs():
    """(model, args, kwargs): a model called with a keyword tensor argument."""
    return _Keyed(), (torch.randn(8, 16),), {"scale": torch.full((8, 4), 2.0)}
