"""Built-in models for tests, examples and benchmarks.

    model, example_inputs = autopar.models.build("gpt", layers=4)
    loss = model(*example_inputs)          # example_inputs = (inputs, targets) -> scalar loss

``build(..., device="meta")`` puts parameters, buffers and example inputs on the meta device, so
huge configurations can be traced and planned without memory. Published shapes have names of their
own (``PUBLISHED``: ``gpt2-xl``, ``gpt3-175b``, ``llama2-7b``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``): they
build on the meta device in bfloat16 unless told otherwise, with the batch of their training runs. Weights are initialized from a fixed
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

# Published shapes: name -> (built-in, config fields). Widths, depths, heads, vocabularies and
# context lengths from the papers and model cards; the batch is the training batch in sequences
# (GPT-2: 512 x 1024 tokens; GPT-3 175B: 3.2M tokens; Llama 2: 4M tokens; Llama 3 8B and 70B: 4M
# tokens chosen; Llama 3 405B: 16M tokens, its final pre-training batch).
PUBLISHED: dict[str, tuple[str, dict]] = {
    "gpt2-xl": ("gpt", dict(layers=48, width=1600, heads=25, seq=1024, vocab=50257, batch=512)),
    "gpt3-175b": ("gpt", dict(layers=96, width=12288, heads=96, seq=2048, vocab=51200, batch=1536)),
    "llama2-7b": ("llama", dict(layers=32, width=4096, heads=32, kv_heads=32, hidden=11008, seq=4096, vocab=32000,
                                batch=1024)),
    "llama3-8b": ("llama", dict(layers=32, width=4096, heads=32, kv_heads=8, hidden=14336, seq=8192, vocab=128256,
                                batch=512, rope_theta=500000.0)),
    "llama3-70b": ("llama", dict(layers=80, width=8192, heads=64, kv_heads=8, hidden=28672, seq=8192, vocab=128256,
                                 batch=512, rope_theta=500000.0)),
    # the paper's last stage of pre-training: 16M tokens a step at 8192 tokens a sequence
    "llama3-405b": ("llama", dict(layers=126, width=16384, heads=128, kv_heads=8, hidden=53248, seq=8192,
                                  vocab=128256, batch=2048, rope_theta=500000.0)),
}


def names() -> list[str]:
    """The names ``build`` accepts."""
    return sorted(REGISTRY) + sorted(PUBLISHED)


def config(name: str, **overrides):
    """The validated config dataclass ``build(name, **overrides)`` would use."""
    if name in PUBLISHED:
        base, fields = PUBLISHED[name]
        return config(base, **{**fields, **overrides})
    if name not in REGISTRY:
        raise ConfigError(f"unknown model {name!r}; built-in models are {names()}")
    module, cls = REGISTRY[name]
    return make_config(cls, module.PRESETS, overrides)


def build(
    name: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    **overrides,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build built-in model ``name`` and example inputs ``(inputs, targets)``.

    ``overrides`` are config fields (see ``config(name)``) plus ``size="bench"`` for a ~10M
    parameter preset. ``dtype`` applies to floating-point parameters, buffers and inputs (default
    float32; bfloat16 for a published shape, which also defaults to the meta device).
    """
    cfg = config(name, **overrides)
    published = name in PUBLISHED
    module, _ = REGISTRY[PUBLISHED[name][0] if published else name]
    dtype = dtype if dtype is not None else (torch.bfloat16 if published else torch.float32)
    device = torch.device(device) if device is not None else torch.device("meta" if published else "cpu")
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model, inputs = module.build(cfg, device)
    model = model.to(dtype=dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return model, inputs


__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "MLPConfig", "PUBLISHED", "REGISTRY", "build", "config",
           "names"]
