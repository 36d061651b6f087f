"""MODEL, as the command takes it: a built-in or published name (``name:key=value,...`` overrides
its config), ``hf:path/to/config.json[:batch=8,seq=512]`` or ``pkg.module:factory``; what
``autopar explain``, ``plan`` and ``profile --ops`` read."""
from __future__ import annotations

import importlib
import os

from autopar.errors import ConfigError


def load_model(spec: str):
    """(model, example_inputs, example_kwargs) from a built-in or published name (with overrides),
    `hf:path/to/config.json[:batch=8,seq=512]` or `pkg.module:factory`."""
    from autopar import models

    if spec.startswith("hf:"):
        path, sep, opts = spec[3:].rpartition(":")
        if not sep or "=" not in opts:  # no options: the whole rest is the path (it may hold ':')
            path, opts = spec[3:], ""
        options = parse_options(opts)
        unknown = sorted(set(options) - {"batch", "seq", "dtype"})
        if unknown:
            raise ConfigError(f"hf:... options are batch, seq and dtype; got {', '.join(unknown)}")
        return hf_model_from_config(path, **options)
    name, sep, opts = spec.partition(":")
    if sep and opts and "=" not in opts:  # pkg.module:factory
        mod_name, fn_name = name, opts
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot load model factory {spec!r}: {e}") from None
        result = factory()
        if not isinstance(result, tuple) or len(result) not in (2, 3):
            raise ConfigError(f"{spec} must return (model, example_inputs) or (model, example_inputs, example_kwargs)")
        model, inputs, *rest = result
        return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), rest[0] if rest else None
    options = parse_options(opts)
    if "dtype" in options:
        options["dtype"] = _dtype(options["dtype"])
    try:
        model, inputs = models.build(name, **options)
    except TypeError as err:
        raise ConfigError(f"model {spec!r}: {err}") from None
    return model, inputs, None


def _dtype(name):
    import torch

    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"dtype {name!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
    return value


def parse_options(opts: str) -> dict:
    """``key=value,...`` -> {key: value}, numbers and true/false read as such (a model's overrides,
    ``--layout``, ``--pipeline``)."""
    overrides = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"model option {item!r} must look like key=value")
        overrides[key] = _literal(value)
    return overrides


def hf_model_from_config(path: str, batch: int = 8, seq: int | None = None, dtype: str | None = None):
    """A transformers causal LM from a config file (no weights: built on the meta device), called
    as ``model(input_ids=..., labels=..., use_cache=False)`` with a (batch, seq) batch; seq defaults
    to the model's context length, capped at 2048; dtype to the config's (else float32)."""
    import torch

    try:
        import transformers
    except ImportError:
        raise ConfigError("hf:... models need the transformers package: pip install transformers") from None
    if not os.path.exists(path):
        raise ConfigError(f"hf:{path}: no such config file (give a config.json or a folder holding one)")
    try:
        cfg = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"hf:{path}: transformers cannot read this config ({err})") from None
    cfg.use_cache = False
    context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
    seq = int(seq) if seq is not None else min(int(context), 2048)
    want = _dtype(dtype) if dtype else (getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32)
    if isinstance(want, str):
        want = _dtype(want)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg).to(want)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"hf:{path}: transformers cannot build a causal LM from this config ({err})") from None
    ids = torch.zeros((int(batch), seq), dtype=torch.long, device="meta")
    return model, (), {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _literal(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)
