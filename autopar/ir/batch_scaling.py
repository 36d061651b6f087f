"""A graph at another batch size, from two traces at other sizes, without tracing again.

The pipeline search prices a model at several microbatch sizes, and a trace of a large model costs
seconds (torch.export runs every op; GPT-3's 96 layers take ~6 s on this VM). The graphs of one
model at different batch sizes are the same program with other integers: sizes in the tensors'
shapes and in the ops' arguments (a view's shape, an expand's sizes, an arange's end). Each such
integer is, in the models that trace alike at every batch size, a linear function of the batch
(``b``, ``b * seq``, ``b * heads``). ``scaled_graph`` reads that function off two traces and
evaluates it at the wanted batch.

It is a prediction: a model whose code branches on the batch size, or computes a size that is not
linear in it (a capacity rounded up), can trace to another program. So it returns None where the
two traces differ in anything but integers, or where an integer does not come out whole and
positive, and its graphs serve pricing only: whatever runs is traced (``compose.pipeline``), and
the search traces its chosen microbatch size before it answers (``solver.pipeline.search``).
"""
from __future__ import annotations

from autopar.ir.flops import count_flops
from autopar.ir.graph import Graph, Node, NodeRef, TensorMeta


class _Mismatch(Exception):
    """The two traces are not one program at two batch sizes."""


def scaled_graph(first: Graph, first_batch: int, second: Graph, second_batch: int, batch: int) -> Graph | None:
    """``first`` and ``second`` (the model traced at ``first_batch`` and ``second_batch``) read at
    ``batch``: every integer that differs between them taken as linear in the batch (see the module
    docstring); None where that reading does not hold."""
    if first_batch == second_batch or list(first.nodes) != list(second.nodes):
        return None
    scale = _Scale(first_batch, second_batch, batch)
    try:
        nodes = {name: _node(a, second.nodes[name], scale) for name, a in first.nodes.items()}
    except _Mismatch:
        return None
    for node in nodes.values():
        if node.op == "call_function":
            ins = [m for m in (nodes[i].meta for i in node.inputs if i in nodes) if isinstance(m, TensorMeta)]
            node.flops = count_flops(node.target, ins, node.meta)
    return Graph(model_name=first.model_name, nodes=nodes, exported=first.exported, params=dict(first.params),
                 buffers=dict(first.buffers), param_aliases=dict(first.param_aliases), inputs=list(first.inputs),
                 outputs=list(first.outputs), layers=list(first.layers), blocks=[list(b) for b in first.blocks],
                 notes=first.notes)


class _Scale:
    def __init__(self, b1: int, b2: int, b: int):
        self.b1, self.b2, self.b = b1, b2, b

    def __call__(self, v1: int, v2: int) -> int:
        """The integer that is ``v1`` at batch b1 and ``v2`` at b2, at batch b."""
        if v1 == v2:
            return v1
        num = (v2 - v1) * (self.b - self.b1)
        if num % (self.b2 - self.b1):
            raise _Mismatch
        v = v1 + num // (self.b2 - self.b1)
        if (v1 > 0 and v2 > 0 and v <= 0) or (v1 < 0 and v2 < 0 and v >= 0):
            raise _Mismatch
        return v


def _node(a: Node, b: Node, scale: _Scale) -> Node:
    if (a.op, a.target, a.inputs, a.role, a.layer, a.param_name, a.module_path) != \
            (b.op, b.target, b.inputs, b.role, b.layer, b.param_name, b.module_path):
        raise _Mismatch
    return Node(name=a.name, op=a.op, target=a.target, inputs=list(a.inputs), args=_value(a.args, b.args, scale),
                kwargs=_value(a.kwargs, b.kwargs, scale), meta=_meta(a.meta, b.meta, scale), flops=0, role=a.role,
                module_path=a.module_path, module_type=a.module_type, layer=a.layer, param_name=a.param_name,
                users=list(a.users), fx_node=a.fx_node)


def _meta(a, b, scale: _Scale):
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_meta(x, y, scale) for x, y in zip(a, b))
    if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):
        if a.dtype != b.dtype or len(a.shape) != len(b.shape):
            raise _Mismatch
        shape = tuple(scale(x, y) for x, y in zip(a.shape, b.shape))
        if any(s < 0 for s in shape):
            raise _Mismatch
        meta = TensorMeta(shape, a.dtype, 0)
        return TensorMeta(shape, a.dtype, meta.numel * meta.itemsize)
    if a is None and b is None:
        return None
    raise _Mismatch


def _value(a, b, scale: _Scale):
    if type(a) is not type(b):
        raise _Mismatch
    if isinstance(a, bool) or a is None or isinstance(a, (str, NodeRef)):
        if a != b:
            raise _Mismatch
        return a
    if isinstance(a, int):
        return scale(a, b)
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            raise _Mismatch
        return type(a)(_value(x, y, scale) for x, y in zip(a, b))
    if isinstance(a, dict):
        if list(a) != list(b):
            raise _Mismatch
        return {k: _value(a[k], b[k], scale) for k in a}
    if isinstance(a, slice):
        return slice(_value(a.start, b.start, scale), _value(a.stop, b.stop, scale), _value(a.step, b.step, scale))
    if a != b:  # floats, dtypes, devices, memory formats: equal or not the same program
        raise _Mismatch
    return a
