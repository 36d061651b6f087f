"""Which values share memory, and which reads must not be copies.

The training IR keeps PyTorch's in-place ops: T5 builds its decoder inputs as

    new_zeros = aten.new_zeros(labels, [4, 16])
    slice_2 = aten.slice.Tensor(new_zeros, 1, 1)       # a view of new_zeros
    copy_ = aten.copy_(slice_2, shifted_labels)        # writes into new_zeros through the view
    masked_fill_ = aten.masked_fill_(new_zeros, ...)   # reads (and writes) the written tensor

A write lands in its base only through the views between them. If a plan reads ``slice_2`` (or
``new_zeros`` on its way to ``slice_2``) in another layout, the program writes into a fresh copy made
by a collective and the base never sees it: a wrong number with no error. So every edge on the path
from a written argument back to the tensor that owns the memory is an *in-place read*: the reader
must take the value exactly as its producer holds it (``in_place_reads``), and the planner offers
only strategies that do.

Aliasing is read off the ATen schemas (``Tensor(a!) self`` is written, ``Tensor(a) self -> Tensor(a)``
is a view), so every op, known or not, is covered. ``detach_`` writes metadata only and counts as a
view; ``operator.getitem`` of a view op's list output (``split``, ``unbind``) aliases its input.
"""
from __future__ import annotations

import functools

import torch

from autopar.ir.graph import per_graph

# in-place ops that change no values (only autograd metadata)
_METADATA_ONLY = frozenset({"aten.detach_.default"})


@functools.lru_cache(maxsize=None)
def _schema_alias(target: str) -> tuple[tuple[str, ...], frozenset[str], str | None]:
    """(argument names, names of written arguments, name of the argument the output aliases)."""
    parts = target.split(".")
    if parts[0] != "aten" or len(parts) != 3:
        return (), frozenset(), None
    try:
        schema = getattr(getattr(torch.ops.aten, parts[1]), parts[2])._schema
    except AttributeError:
        return (), frozenset(), None
    names = tuple(a.name for a in schema.arguments)
    written = frozenset(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    if target in _METADATA_ONLY:
        written = frozenset()
    aliased = None
    for a in schema.arguments:
        info = a.alias_info
        if info is not None and schema.returns and any(
            r.alias_info is not None and (r.alias_info.before_set & info.before_set or not r.alias_info.before_set)
            for r in schema.returns
        ):
            aliased = a.name
            break
    return names, written, aliased


def _positions(node, arg_name: str) -> list[int]:
    """The positions in ``node.inputs`` of the node references schema argument ``arg_name`` holds."""
    from autopar.ir.graph import NodeRef

    names = _schema_alias(node.target)[0]
    pos, out = 0, []

    def walk(value, owner):
        nonlocal pos
        if isinstance(value, NodeRef):
            if owner == arg_name:
                out.append(pos)
            pos += 1
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, owner)

    for i, a in enumerate(node.args):
        walk(a, names[i] if i < len(names) else None)
    for k, v in node.kwargs.items():
        walk(v, k)
    return out


def written_positions(node) -> list[int]:
    """Positions in ``node.inputs`` that ``node`` writes in place (``copy_``'s self, ``add.out``'s out)."""
    if node.op != "call_function":
        return []
    written = _schema_alias(node.target)[1]
    return [p for name in sorted(written) for p in _positions(node, name)]


def aliased_position(node, graph) -> int | None:
    """The position in ``node.inputs`` whose memory ``node``'s output shares (a view's source, an
    in-place op's destination), or None where the output is fresh memory."""
    if node.op != "call_function" or not node.inputs:
        return None
    if node.target == "operator.getitem":
        src = graph.nodes[node.inputs[0]]
        return 0 if aliased_position(src, graph) is not None else None
    aliased = _schema_alias(node.target)[2]
    if aliased is None:
        return None
    pos = _positions(node, aliased)
    return pos[0] if len(pos) == 1 else None


def write_paths(graph) -> dict[str, list[tuple[str, int]]]:
    """In-place node -> the reads (reader, input position) from its written argument back, view by
    view, to the tensor that owns the memory; the owner is the source of the last read."""
    out: dict[str, list[tuple[str, int]]] = {}
    for node in graph.nodes.values():
        for pos in written_positions(node):
            path = out.setdefault(node.name, [])
            reader, p = node, pos
            while (reader.name, p) not in path:
                path.append((reader.name, p))
                src = graph.nodes[reader.inputs[p]]
                q = aliased_position(src, graph)
                if q is None:
                    break
                reader, p = src, q
    return out


@per_graph
def in_place_reads(graph) -> frozenset[tuple[str, int]]:
    """(reader, input position) of every read that must see its producer's memory itself: a
    written argument, and each view between it and the tensor that owns the memory."""
    return frozenset(read for path in write_paths(graph).values() for read in path)


def written_bases(graph) -> dict[str, str]:
    """In-place node -> the value that owns the memory it writes (``copy_`` -> ``new_zeros``)."""
    out = {}
    for writer, path in write_paths(graph).items():
        reader, pos = path[-1]
        out[writer] = graph.nodes[reader].inputs[pos]
    return out


def written_values(graph, nodes) -> dict[str, tuple[str, int]]:
    """Value -> the in-place read (reader, position) among ``nodes``' reads that a pipeline stage
    running ``nodes`` makes its own copy of the value for, when the value comes from another
    stage: one read per value, the last in sorted order. Codegen makes the copy and the solver
    plans the stage's reads from it, so both ask here."""
    inside = set(nodes)
    return {graph.nodes[r].inputs[p]: (r, p) for r, p in sorted(in_place_reads(graph)) if r in inside}
