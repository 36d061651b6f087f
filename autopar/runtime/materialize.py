"""Build only this rank's shard of every parameter and buffer.

Three sources, in the order ``local_state`` tries them for each tensor:

    state_dict      a full (unsharded) state dict, keys of the original model (any alias of a tied
                    weight): each tensor is sliced to the rank's shard.
    a real model    its parameters and buffers are sliced the same way.
    a meta model    (parameters on the meta device) materialized one module at a time: the
                    module's own tensors are created on CPU, initialized by its
                    ``reset_parameters()`` (when it has one) and then ``init_fn(module)`` (when
                    given), sliced, and freed before the next module. Modules are visited
                    children first, like ``Module.apply``, so with the same seed the values equal
                    ``model.apply(reset, then init_fn)`` run on a real copy.

The limit of the meta path: one module's own tensors (for example a whole embedding table) exist
at full size on the CPU for a moment; the shards kept stay small. The user's model is never
changed: initialization runs on a shallow copy of each module that shares nothing but its
children (still on meta, where any init is a no-op). Buffers a module computes in ``__init__``
(like rotary tables) are lost on the meta device; ``init_fn`` must recompute them.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from autopar.errors import ConfigError
from autopar.ir.precision import kept_dtype


def shard_of(full: torch.Tensor, spec, mesh, rank: int) -> torch.Tensor:
    """The rank's shard of ``full`` under storage ``spec`` (a copy, so ``full`` can be freed)."""
    if tuple(full.shape) != tuple(spec.shape):
        raise ConfigError(f"a tensor of shape {tuple(full.shape)} cannot be sharded by {spec} (shape {spec.shape})")
    if spec.partial:
        raise ConfigError(f"storage spec {spec} holds a pending sum; parameters are stored split or replicated")
    return full.detach()[spec.local_slices(mesh, rank)].clone()


def _post_order(module: nn.Module, prefix: str = ""):
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


def _is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta


def meta_shards(model: nn.Module, wanted: dict[int, tuple], mesh, rank: int, init_fn=None) -> dict[int, torch.Tensor]:
    """Shards of the meta tensors of ``model`` named in ``wanted`` (id(tensor) -> storage spec),
    keyed by id, materialized module by module (see the module docstring). A spec of None
    initializes the tensor without keeping it, so that the random stream, and so the kept values,
    are those of initializing the whole model (a pipeline stage keeps only its own layers)."""
    out: dict[int, torch.Tensor] = {}
    for path, module in _post_order(model):
        own = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
        own = {k: t for k, t in own.items() if _is_meta(t) and id(t) in wanted}
        if not own:
            continue
        if init_fn is None and not hasattr(module, "reset_parameters"):
            raise ConfigError(
                f"module {path or '(root)'} ({type(module).__name__}) has tensors on the meta device but no "
                "reset_parameters(); pass init_fn=fn to autopar.parallelize (called on each module, like Module.apply)"
            )
        work = copy.copy(module)  # shares the children (still on meta); own tensors replaced below
        work._parameters = dict(module._parameters)
        work._buffers = dict(module._buffers)
        for k, t in own.items():
            real = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            if k in module._parameters:
                work._parameters[k] = nn.Parameter(real, requires_grad=t.requires_grad)
            else:
                work._buffers[k] = real
        with torch.no_grad():
            if hasattr(work, "reset_parameters"):
                work.reset_parameters()
            if init_fn is not None:
                init_fn(work)
        for k, t in own.items():
            if wanted[id(t)] is None:
                continue
            value = work._parameters[k] if k in work._parameters else work._buffers[k]
            out[id(t)] = shard_of(value, wanted[id(t)], mesh, rank)  # a tied tensor: the last init wins
        del work
    return out


def local_state(model: nn.Module, graph, plan, mesh, rank: int, *, state_dict=None, init_fn=None,
                device=None, placeholders=None) -> dict[str, torch.Tensor]:
    """Placeholder name -> this rank's shard, for every parameter and buffer placeholder of
    ``graph`` (or those in ``placeholders``: a pipeline stage's), under the storage specs of ``plan``."""
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    by_placeholder = {ph: fqn for fqn, ph in {**graph.params, **graph.buffers}.items()}
    if placeholders is not None:
        others = [_source(fqn, graph, named, None) for ph, fqn in by_placeholder.items() if ph not in placeholders]
        by_placeholder = {ph: fqn for ph, fqn in by_placeholder.items() if ph in placeholders}
    else:
        others = []
    specs, sources = {}, {}
    for ph, fqn in by_placeholder.items():
        if fqn not in plan.params:
            raise ConfigError(f"the plan has no storage for {fqn}; it was made for another model")
        specs[ph] = plan.params[fqn].storage
        sources[ph] = _source(fqn, graph, named, state_dict)
    if device is not None and torch.device(device).type == "meta":  # shapes only (a dry run): nothing to initialize
        return {ph: shard_of(t.to("meta"), specs[ph], mesh, rank) for ph, t in sources.items()}
    wanted = {id(t): None for t in others if _is_meta(t)}
    wanted.update({id(t): specs[ph] for ph, t in sources.items() if _is_meta(t)})
    from_meta = meta_shards(model, wanted, mesh, rank, init_fn) if wanted else {}
    out = {}
    for ph, t in sources.items():
        shard = from_meta[id(t)] if _is_meta(t) else shard_of(t, specs[ph], mesh, rank)
        out[ph] = shard.to(device) if device is not None else shard
    return out


def _source(fqn: str, graph, named: dict, state_dict):
    aliases = graph.param_aliases.get(fqn, (fqn,))
    for a in aliases if state_dict is not None else ():
        if a in state_dict:
            return state_dict[a]
    for a in aliases:
        if a in named:
            return named[a]
    raise ConfigError(f"the model has no parameter or buffer {fqn}")


def in_precision(shards: dict, graph, precision) -> dict:
    """The shards as the module keeps them under ``precision`` (``ir.precision.kept_dtype``)."""
    if precision is None:
        return shards
    params = set(graph.params.values())
    return {ph: t.to(kept_dtype(t.dtype, ph in params, precision)) for ph, t in shards.items()}
