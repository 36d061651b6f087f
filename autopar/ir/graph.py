"""The traced graph: value types (TensorMeta, Role, NodeRef), Node and Graph.

A Graph is a read-only view of one ``torch.export`` training-IR program: every fx node becomes a
``Node`` with its tensor metadata, forward FLOPs, role, owning module and layer id. Nodes are kept in
the fx topological order. Placeholders of tied-weight aliases that nothing reads are left out (they
stay in ``gm``), so each parameter tensor appears exactly once, under its canonical name.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import math
import weakref
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and size in bytes of one tensor value."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        shape = tuple(int(s) for s in t.shape)
        return cls(shape, str(t.dtype).removeprefix("torch."), math.prod(shape) * t.element_size())

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


class Role(str, enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    ACTIVATION = "activation"
    OUTPUT = "output"
    CONSTANT = "constant"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class NodeRef:
    """Stands for another node's value inside ``Node.args`` / ``Node.kwargs``."""

    name: str

    def __str__(self) -> str:
        return f"%{self.name}"


Meta = TensorMeta | tuple[TensorMeta | None, ...] | None


@dataclasses.dataclass
class Node:
    name: str
    """fx node name (unique in the graph)."""
    op: str
    """"placeholder" | "call_function" | "get_attr" | "output"."""
    target: str
    """e.g. "aten.mm.default", "operator.getitem"; for placeholders and get_attr the fx target."""
    inputs: list[str]
    """Names of the nodes this one reads, in argument order (a node read twice is listed twice)."""
    args: tuple
    """fx args with every fx.Node replaced by a NodeRef."""
    kwargs: dict
    """fx kwargs with every fx.Node replaced by a NodeRef."""
    meta: Meta
    """TensorMeta of the value, a tuple of them for multi-output ops, None for non-tensors."""
    flops: int
    """Forward FLOPs."""
    role: Role
    module_path: str
    """Innermost nn.Module path that ran this op ("" for the root)."""
    module_type: str
    """Class name of that module."""
    layer: str | None = None
    """Repeated-block id such as "transformer.h.3", or None outside any layer."""
    param_name: str | None = None
    """Canonical fully-qualified name, for parameter and buffer placeholders."""
    users: list[str] = dataclasses.field(default_factory=list)
    """Names of the nodes that read this one."""
    fx_node: torch.fx.Node | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def tensor_meta(self) -> TensorMeta | None:
        """``meta`` when the node is a single tensor, else None."""
        return self.meta if isinstance(self.meta, TensorMeta) else None

    def __str__(self) -> str:
        args = ", ".join(_fmt(a) for a in self.args)
        return f"{self.name} = {self.target}({args}) -> {_fmt_meta(self.meta)}"


def call_arg(args, kwargs, i: int, name: str, default=None):
    """Argument ``name`` of a call, positional at ``i`` or by keyword."""
    return args[i] if i < len(args) else kwargs.get(name, default)


def edge_itemsize(producer_meta, consumer) -> int:
    """Bytes per element of the value ``consumer`` reads from a producer (a getitem reads one
    element of a tuple output)."""
    meta = producer_meta
    if isinstance(meta, tuple):
        if consumer.target == "operator.getitem" and meta[consumer.args[1]] is not None:
            return meta[consumer.args[1]].itemsize
        metas = [m for m in meta if m is not None]
        return metas[0].itemsize if metas else 4
    return meta.itemsize if meta is not None else 4


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _fmt_meta(meta: Meta) -> str:
    if isinstance(meta, tuple):
        return "(" + ", ".join(_fmt_meta(m) for m in meta) + ")"
    return "-" if meta is None else str(meta)


def _stable(value: Any) -> Any:
    """A repr-able form of fx args that never includes memory addresses."""
    if isinstance(value, (list, tuple)):
        return tuple(_stable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _stable(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str, NodeRef)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    return type(value).__qualname__


OUTSIDE = "(outside)"
"""Key of ``Graph.flops_per_layer()`` for nodes that belong to no layer."""


def per_graph(analysis):
    """``analysis(graph)`` computed once per graph (a traced graph is read-only): the planner asks
    for the same reads of one graph in every ILP it builds (a GPT-3 search builds ~60). Callers
    must not change what it returns."""
    results: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @functools.wraps(analysis)
    def cached(graph):
        try:
            return results[graph]
        except KeyError:
            out = results[graph] = analysis(graph)
            return out

    return cached


@per_graph
def needs_grad(graph) -> frozenset[str]:
    """Names of the nodes whose value needs a gradient in backward: every floating-point parameter
    (all parameters are assumed trainable), and every floating-point value computed from one.
    User inputs, buffers and constants need none."""
    out: set[str] = set()
    for node in graph.nodes.values():
        metas = node.meta if isinstance(node.meta, tuple) else (node.meta,)
        floating = any(m is not None and m.torch_dtype.is_floating_point for m in metas)
        if node.op == "placeholder":
            if node.role == Role.PARAMETER and floating:
                out.add(node.name)
        elif node.op == "call_function" and floating and any(i in out for i in node.inputs):
            out.add(node.name)
    return frozenset(out)


def runs_backward(node, grad) -> bool:
    """Whether backward runs through ``node``: a gradient flows to one of its inputs (one in
    ``grad``, ``needs_grad`` of its graph)."""
    return any(i in grad for i in node.inputs)


class Graph:
    """A traced model. Build one with ``autopar.ir.trace``."""

    def __init__(
        self,
        *,
        model_name: str,
        nodes: dict[str, Node],
        exported: torch.export.ExportedProgram,
        params: dict[str, str],
        buffers: dict[str, str],
        param_aliases: dict[str, tuple[str, ...]],
        inputs: list[str],
        outputs: list[str],
        layers: list[str],
        blocks: list[list[str]],
        notes: tuple[str, ...] = (),
    ):
        self.model_name = model_name
        self.notes = tuple(notes)  # what tracing changed about the call (said once, by explain)
        self.nodes = nodes
        self.exported = exported
        self.gm: torch.fx.GraphModule = exported.graph_module
        self.params = params
        self.buffers = buffers
        self.param_aliases = param_aliases
        self.inputs = inputs
        self.outputs = outputs
        self.layers = layers
        self.blocks = blocks

    # ---- queries --------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def __iter__(self):
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def param_node(self, fqn: str) -> Node:
        """The placeholder node of parameter or buffer ``fqn`` (any alias of a tied tensor)."""
        for canonical, aliases in self.param_aliases.items():
            if fqn in aliases:
                fqn = canonical
                break
        name = self.params.get(fqn) or self.buffers[fqn]
        return self.nodes[name]

    def nodes_in_layer(self, layer: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.layer == layer]

    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes.values())

    def num_parameters(self) -> int:
        """Elements over unique parameters (a tied weight counts once)."""
        return sum(self.nodes[name].meta.numel for name in self.params.values())

    def param_bytes(self) -> int:
        """Bytes over unique parameters: what the gradient reducer's buckets hold at most."""
        return sum(self.nodes[name].meta.nbytes for name in self.params.values())

    def flops_per_layer(self) -> dict[str, int]:
        """FLOPs per layer id in layer order, then ``OUTSIDE`` ("(outside)") for the rest."""
        out = {layer: 0 for layer in self.layers}
        out[OUTSIDE] = 0
        for n in self.nodes.values():
            out[n.layer if n.layer is not None else OUTSIDE] += n.flops
        return out

    def fingerprint(self) -> str:
        """sha256 over op sequence, shapes, dtypes, param names and non-tensor args."""
        h = hashlib.sha256()
        for n in self.nodes.values():
            key = (n.op, n.target, n.inputs, _fmt_meta(n.meta), n.param_name, n.role.value)
            h.update(repr((key, _stable(n.args), _stable(n.kwargs))).encode())
        return h.hexdigest()

    def summary(self) -> dict:
        return {
            "model": self.model_name,
            "nodes": len(self.nodes),
            "ops": sum(n.op == "call_function" for n in self.nodes.values()),
            "parameters": self.num_parameters(),
            "parameter_tensors": len(self.params),
            "buffers": len(self.buffers),
            "flops": self.total_flops(),
            "layers": len(self.layers),
            "repeated_blocks": [[b[0], len(b)] for b in self.blocks if len(b) > 1],
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"Graph({self.model_name}: {s['nodes']} nodes, {s['parameters']:,} params, "
            f"{s['flops']:,} flops, {s['layers']} layers)"
        )

    def __str__(self) -> str:
        lines = [repr(self), f"{'layer':<28} {'nodes':>6} {'params':>12} {'GFLOP':>10}"]
        per_layer = self.flops_per_layer()
        for layer, flops in per_layer.items():
            nodes = [n for n in self.nodes.values() if (n.layer or OUTSIDE) == layer]
            params = sum(n.meta.numel for n in nodes if n.role is Role.PARAMETER)
            lines.append(f"{layer:<28} {len(nodes):>6} {params:>12,} {flops / 1e9:>10.4f}")
        for block in self.blocks:
            if len(block) > 1:
                lines.append(f"repeated block x{len(block)}: {block[0]} .. {block[-1]}")
        return "\n".join(lines)
