"""Per-device memory, in bytes: parameters with their gradients and optimizer states, and the
activations a training step keeps alive.

Parameters (``param_memory``), per device::

    param + grad          local elements (by the storage spec) x the param's dtype size, twice
    optimizer states      OPTIMIZER_STATES[optimizer] fp32 values per element (Adam/AdamW: 2)
    master copy           MASTER_COPY_BYTES per element for 16-bit params (mixed precision keeps
                          an fp32 copy that the optimizer updates)

Optimizer states and the master copy are divided over ``opt_state_sharded_axes`` (ZeRO-1/2) on top
of the storage sharding; an axis that already splits the storage divides them only once. Gradients
are sharded like the storage (ZeRO-2's gradient sharding of a replicated param is not modelled
separately). Example: 1M fp32 params, AdamW, replicated: 4 + 4 + 8 = 16 MB; bf16: 2 + 2 + 8 + 4.

Activations: ``saved_for_backward`` lists the values an op's backward reads (``ops.SAVE_RULES``:
matmul operands, the input of gelu/norms, the output of relu/softmax, embedding indices, ...);
they stay alive from their op to the end of the forward. Every other value lives from its op to
its last reader. Views alias their source and cost nothing. ``activation_memory`` is the peak,
over the forward order, of the live bytes. Approximations:

- the peak is that of the forward pass; backward frees saved tensors as it goes but adds gradient
  buffers of about one activation at a time, which is not counted;
- parameters, buffers and constants are not activations (``param_memory`` counts them); user
  inputs are, from the start to their last reader;
- small saved statistics (layer-norm mean/rstd, attention logsumexp) are ignored; a dropout mask
  is counted at the output's dtype size; a multi-output op's outputs live as long as any of them;
- allocator fragmentation, workspace buffers and the CUDA context are not counted.
"""
from __future__ import annotations

import math
from typing import Mapping

from autopar.cost_model.ops import (
    alias_roots,
    is_view,
    itemsize,
    local_nbytes,
    local_numel,
    needs_grad,
    save_rule,
    tensor_inputs,
)
from autopar.errors import ConfigError

# fp32 optimizer values kept per parameter element.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "momentum": 1}
OPTIMIZER_STATE_BYTES = 4  # states are fp32 whatever the param dtype (bf16 params keep fp32 states)
# Mixed precision: 16-bit params keep an fp32 master copy next to the optimizer states.
MASTER_COPY_BYTES = 4
LOW_PRECISION_DTYPES = frozenset({"bfloat16", "float16"})

# Roles whose memory is not an activation's.
_STATIC_ROLES = frozenset({"parameter", "buffer", "constant"})


def param_memory(param_meta, storage_spec, mesh, optimizer: str = "adamw", opt_state_sharded_axes=()) -> int:
    """Bytes one device holds for one parameter: its shard, its gradient, its optimizer states and
    (16-bit params) an fp32 master copy. ``param_meta``: a TensorMeta or a parameter Node;
    ``storage_spec`` None: replicated."""
    meta = getattr(param_meta, "meta", param_meta)
    states = OPTIMIZER_STATES.get(optimizer.lower())
    if states is None:
        raise ConfigError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
    numel = local_numel(meta.shape, storage_spec, mesh)
    weights = 2 * numel * itemsize(meta.dtype)  # param + grad
    already = storage_spec.used_axes if storage_spec is not None else frozenset()
    ways = math.prod(mesh.shape[mesh.axis(a)] for a in set(opt_state_sharded_axes) if mesh.axis(a) not in already)
    per_element = states * OPTIMIZER_STATE_BYTES + (MASTER_COPY_BYTES if meta.dtype in LOW_PRECISION_DTYPES else 0)
    return weights + math.ceil(numel / ways) * per_element


def total_param_memory(graph, storage_specs: Mapping | None, mesh, optimizer: str = "adamw", opt_state_sharded_axes=()) -> int:
    """``param_memory`` summed over the graph's parameters; buffers count once at their local size.
    ``storage_specs``: {node name: ShardingSpec}; missing names are replicated."""
    storage_specs = storage_specs or {}
    total = 0
    for node in graph.nodes.values():
        role = str(node.role)
        if node.op != "placeholder" or role not in ("parameter", "buffer"):
            continue
        spec = _output_spec(storage_specs.get(node.name))
        if role == "parameter":
            total += param_memory(node.meta, spec, mesh, optimizer, opt_state_sharded_axes)
        else:
            total += local_nbytes(node.meta, spec, mesh)
    return total


# ---- activations --------------------------------------------------------------------------------
def saved_for_backward(graph) -> set[str]:
    """Names of the storage-owning values (never views: a saved view keeps its source alive, so
    the source is listed) that some op's backward reads. Parameters, buffers and constants are
    left out: they are alive anyway."""
    ng = needs_grad(graph)
    roots = alias_roots(graph)
    saved: set[str] = set()
    for node in graph.nodes.values():
        if node.op != "call_function" or is_view(node.target) or node.name not in ng:
            continue  # a view, or no backward: nothing computed from a gradient-needing input, or
            # an output that carries no gradient (a comparison, an integer op)
        tin = tensor_inputs(node, graph)
        grad_idx = {k for k, (_, name) in enumerate(tin) if name in ng}
        if not grad_idx:
            continue
        idx, saves_output = save_rule(node.target)(grad_idx, len(tin), node)
        if any(not 0 <= k < len(tin) for k in idx):
            raise IndexError(
                f"the save rule of {node.target} names tensor inputs {sorted(idx)} of node {node.name!r}, "
                f"which has {len(tin)} ({[name for _, name in tin]}; args {node.args})"
            )
        for k in idx:
            saved |= roots[tin[k][1]]
        if saves_output:
            saved |= roots[node.name]
    return {n for n in saved if str(graph.nodes[n].role) not in _STATIC_ROLES}


def node_activation_bytes(node, out_spec, mesh, saved) -> int:
    """The ILP's linear memory term: the node's local bytes under ``out_spec`` when it is saved
    for backward (``saved``: from ``saved_for_backward``), else 0. Summing it over nodes gives the
    memory saved activations hold at the end of the forward, not the transient peak."""
    if node.name not in saved:
        return 0
    return local_nbytes(node.meta, _output_spec(out_spec), mesh)


def activation_timeline(graph, specs: Mapping | None, mesh) -> list[tuple[str, int]]:
    """(node name, live activation bytes while that node runs) in forward order. ``specs``:
    {node name: output ShardingSpec (a tuple for multi-output ops) or Strategy}; missing names
    are replicated."""
    specs = specs or {}
    order = list(graph.nodes.values())
    pos = {n.name: t for t, n in enumerate(order)}
    roots = alias_roots(graph)
    saved = saved_for_backward(graph)
    end_of_forward = len(order) - 1

    last = {n.name: pos[n.name] for n in order}
    for t, node in enumerate(order):
        for name in node.inputs:
            for r in roots.get(name, ()):
                last[r] = max(last[r], end_of_forward if node.op == "output" else t)
    delta = [0] * (len(order) + 1)
    for node in order:
        if roots[node.name] != frozenset({node.name}) or str(node.role) in _STATIC_ROLES:
            continue  # a view, or memory counted elsewhere
        size = local_nbytes(node.meta, _output_spec(specs.get(node.name)), mesh)
        end = end_of_forward if node.name in saved else last[node.name]
        delta[pos[node.name]] += size
        delta[end + 1] -= size
    out, live = [], 0
    for t, node in enumerate(order):
        live += delta[t]
        out.append((node.name, live))
    return out


def activation_memory(graph, specs: Mapping | None, mesh) -> int:
    """Peak live activation bytes on one device over the forward pass (see the module docstring)."""
    return max((b for _, b in activation_timeline(graph, specs, mesh)), default=0)


def _output_spec(spec):
    """A Strategy's output spec, or the spec itself."""
    return spec.output if hasattr(spec, "output") and hasattr(spec, "compute_fraction") else spec
