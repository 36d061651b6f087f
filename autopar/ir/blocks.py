"""Layer ids and repeated-block detection.

A layer id is a module path cut after its first numeric component: the op run by
``transformer.h.3.attn.c_attn`` belongs to layer ``transformer.h.3``. Ops whose module has no
numeric component but that sit between layer ops (a ReLU applied in the parent's loop) inherit the
layer of their input in the latest layer (the latest-produced such input), when their module is the
root or an ancestor of that layer. Parameters and buffers take the layer of the module that owns them.

Two layers are the same block when their op sequences match: same targets, output shapes and
dtypes, non-tensor arguments, and inputs in the same places (the i-th op of the layer, a parameter
of the same relative name and shape, or an outside value of the same shape).

Layer units (``unit_of_nodes``) number every node by the layer it runs in, the ops before the first
layer joining it and those after the last joining that: what pipeline stages and per-layer
recomputation cut between.
"""
from __future__ import annotations

from typing import Any

from autopar.errors import PlanError
from autopar.ir.graph import Node, NodeRef, Role, TensorMeta


def layer_of_path(path: str) -> str | None:
    """``"transformer.h.3.attn.c_attn"`` -> ``"transformer.h.3"``; None without a numeric part."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def assign_layers(nodes: dict[str, Node]) -> list[str]:
    """Set ``node.layer`` on every node; return the layer ids in execution order."""
    for node in nodes.values():  # first the layers nodes name themselves
        if node.role in (Role.PARAMETER, Role.BUFFER):
            owner = node.param_name.rsplit(".", 1)[0] if "." in (node.param_name or "") else ""
            node.layer = layer_of_path(owner)
        elif node.op == "call_function":
            node.layer = layer_of_path(node.module_path)
    layers: list[str] = []
    for kind in ("call_function", "placeholder"):  # ops define the order; param-only layers last
        for node in nodes.values():
            if node.op == kind and node.layer is not None and node.layer not in layers:
                layers.append(node.layer)
    rank = {layer: i for i, layer in enumerate(layers)}
    order = {name: i for i, name in enumerate(nodes)}
    for node in nodes.values():  # then inheritance, in topological order so it chains
        if node.op == "call_function" and node.layer is None:
            node.layer = _inherited_layer(node, nodes, rank, order)
    return layers


def _inherited_layer(node: Node, nodes: dict[str, Node], rank: dict[str, int], order: dict[str, int]) -> str | None:
    """The layer of the input in the latest layer (latest produced among equals), when this node's
    module is the root or an ancestor of it. Ranking by layer first lets an op at the root that
    reads layer i's parameters directly (a lifted torch.cond operand, F.linear(x, layers[i].weight))
    join layer i rather than the layer that produced its activation input."""
    candidates = [nodes[i] for i in node.inputs if i in nodes and nodes[i].layer is not None]
    if not candidates:
        return None
    latest = max(candidates, key=lambda n: (rank[n.layer], order[n.name]))
    if node.module_path == "" or latest.layer.startswith(node.module_path + "."):
        return latest.layer
    return None


def find_blocks(nodes: dict[str, Node], layers: list[str]) -> list[list[str]]:
    """Group layers with equal signatures; groups ordered by their first layer, singletons kept."""
    ops_of: dict[str, list[Node]] = {layer: [] for layer in layers}
    for n in nodes.values():
        if n.layer is not None and n.op != "placeholder":
            ops_of[n.layer].append(n)
    groups: dict[Any, list[str]] = {}
    for layer in layers:
        groups.setdefault(layer_signature(nodes, layer, ops_of[layer]), []).append(layer)
    return list(groups.values())


def layer_signature(nodes: dict[str, Node], layer: str, ops: list[Node]) -> tuple:
    """A hashable description of a layer's ops (``ops``, in order) that ignores which layer it is."""
    index = {n.name: i for i, n in enumerate(ops)}
    prefix = layer + "."

    def token(name: str) -> tuple:
        if name in index:
            return ("op", index[name])
        src = nodes.get(name)
        meta = _freeze(src.meta) if src is not None else None
        if src is not None and src.param_name and src.param_name.startswith(prefix):
            return ("param", src.param_name[len(prefix):], meta)
        return ("outside", meta)

    return tuple(
        (n.op, n.target, _freeze(n.meta), _freeze(n.args, token), _freeze(n.kwargs, token)) for n in ops
    )


def _freeze(value: Any, token=None) -> Any:
    """Hashable form of metas and fx args; NodeRefs become ``token(name)``."""
    if isinstance(value, NodeRef):
        return token(value.name) if token else value
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, token) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v, token)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str, TensorMeta)):
        return value
    return str(value)


# ---- layer units (pipeline stages cut between them) -------------------------------------------------
def unit_of_nodes(graph) -> dict[str, int]:
    """Node name -> unit index: its layer's position; an op outside every layer joins the latest
    layer before it (0 before the first: embeddings; the last after it: head and loss)."""
    if not graph.layers:
        raise PlanError(f"{graph.model_name} has no repeated layers to cut into pipeline stages")
    index = {layer: i for i, layer in enumerate(graph.layers)}
    out, latest = {}, 0  # latest: the layer of the most recent layer op (ops between layers join it)
    for name, node in graph.nodes.items():
        if node.layer in index:
            out[name] = index[node.layer]
            if node.op == "call_function":
                latest = max(latest, index[node.layer])
        elif node.op == "placeholder":
            continue  # parameters without a layer: placed by their readers below
        else:
            out[name] = latest
    readers = node_readers(graph)
    for name in graph.nodes:
        if name not in out:
            units = [out[n] for n in readers.get(name, ()) if n in out]
            out[name] = min(units) if units else 0
    return out


def node_readers(graph) -> dict[str, list[str]]:
    readers: dict[str, list[str]] = {n: [] for n in graph.nodes}
    for name, node in graph.nodes.items():
        for i in node.inputs:
            readers.setdefault(i, []).append(name)
    return readers
