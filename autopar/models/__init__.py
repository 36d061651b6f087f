"""Built-in models for tests, examples and benchmarks.

    model, example_inputs = autopar.models.build("gpt", layers=4)
    loss = model(*example_inputs)          # example_inputs = (inputs, targets) -> scalar loss

``build(..., device="meta")`` puts parameters, buffers and example inputs on the meta device, so
huge configurations can be traced and planned without memory. Weights are initialized from a fixed
seed (``seed=``, default 0) without touching the global RNG, so every rank builds the same model.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn as nn

from autopar.errors import ConfigError
from autopar.models import gpt, llama, mlp
from autopar.models._common import make_config
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLP, MLPConfig

# name -> (module with build(cfg, device) and PRESETS, config class)
REGISTRY: dict[str, tuple[ModuleType, type]] = {
    "mlp": (mlp, MLPConfig),
    "gpt": (gpt, GPTConfig),
    "llama": (llama, LlamaConfig),
}


def names() -> list[str]:
    """The names ``build`` accepts."""
    return sorted(REGISTRY)


def config(name: str, **overrides):
    """The validated config dataclass ``build(name, **overrides)`` would use."""
    if name not in REGISTRY:
        raise ConfigError(f"unknown model {name!r}; built-in models are {names()}")
    module, cls = REGISTRY[name]
    return make_config(cls, module.PRESETS, overrides)


def build(
    name: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build built-in model ``name`` and example inputs ``(inputs, targets)``.

    ``overrides`` are config fields (see ``config(name)``) plus ``size="bench"`` for a ~10M
    parameter preset. ``dtype`` applies to floating-point parameters, buffers and inputs.
    """
    cfg = config(name, **overrides)
    module, _ = REGISTRY[name]
    device = torch.device(device) if device is not None else torch.device("cpu")
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model, inputs = module.build(cfg, device)
    model = model.to(dtype=dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return model, inputs


__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "MLPConfig", "REGISTRY", "build", "config", "names"]
