"""ParallelModule: one rank's part of a parallelized model, called like the original.

It owns this rank's parameter and buffer shards, registered under the original (canonical) names,
so ``pmodel.parameters()`` feeds any torch.optim optimizer, and runs the lowered program
(``autopar.codegen.lower``) with them and the caller's inputs::

    pmodel(*args, **kwargs)
      -> (args, kwargs) bound to the traced signature and flattened like the example inputs
      -> program(*shards, *inputs) inside ops.bind(groups)
      -> the flat outputs put back into the original structure (tensor, tuple, ModelOutput, ...)

Gradient synchronisation: under the dual-layout convention a parameter stored replicated over an
active mesh axis ends backward with a pending-sum gradient there; a hook on the parameter
all-reduces each incoming gradient over those axes *before* it is accumulated into ``.grad``, so a
plain ``loss.backward(); opt.step()`` loop, and gradient accumulation over several backwards, see
the true gradient.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import _pytree as fx_pytree

from autopar.codegen import collectives as C
from autopar.codegen import ops
from autopar.errors import ConfigError
from autopar.ir.graph import Role


class ParallelModule(nn.Module):
    """See the module docstring. Built by ``autopar.parallelize``; ``.plan``, ``.code``,
    ``.mesh``, ``.groups``, ``full_state_dict()``."""

    def __init__(self, *, graph, plan, lowered, groups, shards: dict, state_keys: list[str],
                 signature: inspect.Signature | None, requires_grad: dict[str, bool], constants: dict):
        super().__init__()
        object.__setattr__(self, "_ap", _State(graph, plan, lowered, groups, state_keys, signature))
        fqn_of = {ph: fqn for fqn, ph in {**graph.params, **graph.buffers}.items()}
        persistent = set(state_keys)
        self._ap.slots = []  # per state placeholder: (owner module, attribute name)
        for ph in lowered.state:
            node = graph.nodes[ph]
            if node.role == Role.CONSTANT:
                owner, attr = self._owner("_autopar_constants." + ph)
                owner.register_buffer(attr, constants[ph], persistent=False)
            elif node.role == Role.PARAMETER:
                owner, attr = self._owner(fqn_of[ph])
                owner.register_parameter(attr, nn.Parameter(shards[ph], requires_grad=requires_grad.get(ph, True)))
            else:
                owner, attr = self._owner(fqn_of[ph])
                owner.register_buffer(attr, shards[ph], persistent=fqn_of[ph] in persistent)
            self._ap.slots.append((owner, attr))
        self._add_grad_sync_hooks(fqn_of)

    # ---- construction helpers ----------------------------------------------------------------
    def _owner(self, fqn: str) -> tuple[nn.Module, str]:
        """The (created on demand) container module that holds ``fqn``, and the last name part."""
        *path, attr = fqn.split(".")
        mod: nn.Module = self
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        return mod, attr

    def _add_grad_sync_hooks(self, fqn_of) -> None:
        groups = self._ap.groups
        for (owner, attr), ph in zip(self._ap.slots, self._ap.lowered.state):
            p = owner._parameters.get(attr)
            pp = self._ap.plan.params.get(fqn_of.get(ph, ""))
            if p is None or pp is None or pp.grad_sync is None or not p.requires_grad:
                continue
            kind, axes, _ = pp.grad_sync
            if kind != "all_reduce":
                raise ConfigError(f"parameter {pp.name}: gradient sync {kind!r} (family {pp.family}) is not supported by the runtime yet")
            g = groups.handle(tuple(axes))
            if g.size > 1:
                p.register_hook(lambda grad, g=g: C.all_reduce(grad, g))

    # ---- calling -------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        ap = self._ap
        args, kwargs = self._normalize(args, kwargs)
        try:
            flat = fx_pytree.tree_flatten_spec((args, kwargs), ap.in_spec)
        except Exception as err:
            raise ConfigError(f"{ap.graph.model_name} was traced with inputs shaped like {ap.in_spec}; this call does not match ({err})") from None
        self._check_inputs(flat)
        flat = [x.to(ap.device) if isinstance(x, torch.Tensor) and ap.device is not None else x for x in flat]
        state = [owner._parameters[a] if a in owner._parameters else owner._buffers[a] for owner, a in ap.slots]
        with ops.bind(ap.groups):
            out = ap.lowered.gm(*state, *flat)
        return pytree.tree_unflatten(list(out), ap.out_spec)

    def _check_inputs(self, flat) -> None:
        graph = self._ap.graph
        for x, name in zip(flat, self._ap.lowered.inputs):
            meta = graph.nodes[name].meta
            if hasattr(meta, "shape") and isinstance(x, torch.Tensor) and tuple(x.shape) != tuple(meta.shape):
                raise ConfigError(
                    f"input {name} has shape {tuple(x.shape)} but {graph.model_name} was parallelized for {tuple(meta.shape)}; "
                    "autopar plans are for fixed shapes: pass inputs shaped like example_inputs, or parallelize again"
                )

    def _normalize(self, args, kwargs):
        """(args, kwargs) arranged like the traced call: as many positional arguments and the same
        keywords, whichever way the caller passed them."""
        sig = self._ap.signature
        n_pos, keys = self._ap.n_pos, self._ap.kw_keys
        if sig is None or (len(args) == n_pos and set(kwargs) == set(keys)):
            return tuple(args), dict(kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as err:
            raise ConfigError(f"cannot call {self._ap.graph.model_name} this way: {err}") from None
        bound.apply_defaults()
        names = list(sig.parameters)
        values = dict(bound.arguments)
        pos = tuple(values.pop(n) for n in names[:n_pos] if n in values)
        return pos, {k: values[k] for k in keys if k in values}

    # ---- views ---------------------------------------------------------------------------------
    @property
    def plan(self):
        return self._ap.plan

    @property
    def code(self) -> str:
        """This rank's program as Python (the same text on every rank)."""
        return self._ap.lowered.gm.code

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self._ap.lowered.gm

    @property
    def mesh(self):
        return self._ap.groups.mesh

    @property
    def groups(self):
        return self._ap.groups

    def local_state(self) -> dict[str, torch.Tensor]:
        """Canonical fqn -> this rank's shard, for parameters and buffers."""
        fqn_of = {ph: fqn for fqn, ph in {**self._ap.graph.params, **self._ap.graph.buffers}.items()}
        out = {}
        for (owner, a), ph in zip(self._ap.slots, self._ap.lowered.state):
            if ph in fqn_of:
                out[fqn_of[ph]] = owner._parameters[a] if a in owner._parameters else owner._buffers[a]
        return out

    def storage_spec(self, fqn: str):
        """The storage spec of parameter or buffer ``fqn`` (canonical name)."""
        return self._ap.plan.params[fqn].storage

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict with the original model's keys (tied aliases included), on
        every rank. A collective: call it on every rank."""
        ap = self._ap
        full = {fqn: ops.gather_full(t.detach(), self.storage_spec(fqn), ap.groups) for fqn, t in self.local_state().items()}
        out = {}
        for key in ap.state_keys:
            canon = ap.canonical.get(key, key)
            if canon in full:
                out[key] = full[canon]
        return out


class _State:
    """Everything a ParallelModule needs that is not a tensor (kept out of the module tree)."""

    def __init__(self, graph, plan, lowered, groups, state_keys, signature):
        self.graph, self.plan, self.lowered, self.groups = graph, plan, lowered, groups
        self.state_keys = list(state_keys)
        self.signature = signature
        self.canonical = {a: canon for canon, names in graph.param_aliases.items() for a in names}
        spec = graph.exported.call_spec
        self.in_spec, self.out_spec = spec.in_spec, spec.out_spec
        self.n_pos = self.in_spec.children_specs[0].num_children
        self.kw_keys = list(self.in_spec.children_specs[1].context)
        self.device = None
        self.slots: list = []
