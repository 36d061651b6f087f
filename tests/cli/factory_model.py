"""A user's model factory for `autopar explain tests.cli.factory_model:build` style loading."""
import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, (torch.randn(8, 16),)


def broken():
    return "not a model"
