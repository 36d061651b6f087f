"""Table lookups past the table: a sequence longer than the model's positions, a token id beyond
the vocabulary. torch.export traces them without looking at values, and the first real step fails
with an IndexError deep in a rank's program; ``check_lookups`` reads the rows the example call
looks up, where they come from the inputs, buffers and constants alone (not from parameters), and
says which table, which row and why."""
from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind
from torch.fx import _pytree as fx_pytree

from autopar.errors import ConfigError
from autopar.ir.aliasing import written_bases

_LOOKUPS = ("aten.embedding.default",)


def check_lookups(graph, model, example_inputs, example_kwargs) -> None:
    """ConfigError where the example call looks up a row past a table's end (module docstring)."""
    lookups = [n for n in graph.nodes.values() if n.target in _LOOKUPS and len(n.inputs) >= 2]
    if not lookups:
        return
    exported = graph.exported
    leaves = fx_pytree.tree_flatten_spec((tuple(example_inputs), dict(example_kwargs or {})), exported.call_spec.in_spec)
    if any(isinstance(x, torch.Tensor) and (x.is_meta or isinstance(x, torch._subclasses.fake_tensor.FakeTensor))
           for x in leaves):
        return  # a meta-device or fake call has no values to read
    if any(b.is_meta or isinstance(b, torch._subclasses.fake_tensor.FakeTensor) for b in model.buffers()):
        return
    known = _known_values(graph, model, exported, leaves)
    written = set(written_bases(graph).values())  # evaluated alone, their writes would be missed
    values: dict = {}
    for node in lookups:
        if _ancestors(graph, node.inputs[1]) & written:
            continue
        index = _evaluate(graph, node.inputs[1], known, values)
        if not isinstance(index, torch.Tensor) or index.is_meta or not index.numel() or index.is_floating_point():
            continue
        rows = graph.nodes[node.inputs[0]].meta.shape[0]
        top = int(index.max())
        if top < rows:
            continue
        from_inputs = [n for n in _ancestors(graph, node.inputs[1]) if n in graph.inputs]
        if from_inputs:
            why = (f"an id in {', '.join(from_inputs)} is past the table: keep ids below {rows}, or build the model "
                   "with a larger table")
        else:
            why = (f"positions the model counts itself: the sequence is longer than its {rows} positions; shorten the "
                   "inputs, or build the model for longer sequences")
        raise ConfigError(f"{node.module_path or graph.model_name} looks up row {top} of a table of {rows} rows: {why}")


def _known_values(graph, model, exported, leaves) -> dict:
    """Placeholder name -> value for the user inputs, buffers and constants (never parameters)."""
    out, user = {}, iter(leaves)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for spec in exported.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            out[name] = next(user)
        elif spec.kind == InputKind.BUFFER and spec.target in buffers:
            out[name] = buffers[spec.target]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            out[name] = exported.constants.get(spec.target)
    return out


def _ancestors(graph, name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += graph.nodes[n].inputs
    return seen


def _evaluate(graph, name: str, known: dict, values: dict):
    """The value of node ``name`` computed from ``known`` placeholders, or None where it needs
    anything else (a parameter, an op that fails on these values)."""
    if name in values:
        return values[name]
    node = graph.nodes[name]
    value = None
    if node.op == "placeholder":
        value = known.get(name)
    elif node.op == "call_function" and node.fx_node is not None:
        args = [_evaluate(graph, i, known, values) for i in node.inputs]
        if all(a is not None for a in args):
            feed = iter(args)
            fx = node.fx_node
            call_args = torch.fx.node.map_arg(fx.args, lambda _: next(feed))
            call_kwargs = torch.fx.node.map_arg(fx.kwargs, lambda _: next(feed))
            try:
                with torch.no_grad():
                    value = fx.target(*call_args, **call_kwargs)
            except Exception:  # an op these values do not suit: nothing to say about this lookup
                value = None
    values[name] = value
    return value
