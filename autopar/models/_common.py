"""Helpers shared by the built-in models: config validation and example-input construction."""
from __future__ import annotations

import dataclasses

import torch

from autopar.errors import ConfigError


def require_positive(cfg, *names: str) -> None:
    """Raise ConfigError unless every named int field of ``cfg`` is >= 1."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{type(cfg).__name__}.{name} must be a positive int, got {value!r}")


def require_divisible(cfg, big: str, small: str) -> None:
    """Raise ConfigError unless field ``big`` is a multiple of field ``small``."""
    a, b = getattr(cfg, big), getattr(cfg, small)
    if a % b:
        raise ConfigError(f"{type(cfg).__name__}: {big}({a}) must be divisible by {small}({b})")


def require_probability(cfg, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{type(cfg).__name__}.{name} must be in [0, 1), got {value!r}")


def make_config(cls, presets: dict[str, dict], overrides: dict):
    """Build ``cls`` from an optional ``size=`` preset plus field overrides, with clear errors."""
    overrides = dict(overrides)
    size = overrides.pop("size", "default")
    if size not in presets:
        raise ConfigError(f"{cls.__name__}: unknown size {size!r}; choose one of {sorted(presets)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"{cls.__name__}: unknown option(s) {unknown}; valid options are {sorted(fields)} and size"
        )
    return cls(**{**presets[size], **overrides})


def token_batch(batch: int, seq: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets, both (batch, seq) int64."""
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    return idx, targets
