"""Which parameters stored split are gathered together: one collective per (layer, mesh axes), as
FSDP groups a block's parameters. Codegen emits the groups; the cost model prices the same ones."""
from __future__ import annotations

from autopar.ir.graph import Role

# steps that move no bytes between ranks and act on each element where it lies: they commute with
# a gather over other axes, so a read whose route is a gather and these runs the group's gather
LOCAL_AFTER_GATHER = ("slice", "to_partial")


def grouped_route(steps) -> tuple[int, list[int]] | None:
    """(the position of the gather, the positions of the steps run on what it gathers, in the
    order they run) of a parameter read's reshard ``steps`` that a group's one all-gather can
    serve: exactly one all_gather, only ``to_partial`` before it (it touches no dimension, so it
    runs after the gather alike) and only local steps (``LOCAL_AFTER_GATHER``) after it; None for
    any other route."""
    at = [i for i, s in enumerate(steps) if s.kind == "all_gather"]
    if len(at) != 1:
        return None
    i = at[0]
    if any(s.kind != "to_partial" for s in steps[:i]) or any(s.kind not in LOCAL_AFTER_GATHER for s in steps[i + 1:]):
        return None
    return i, [j for j in range(len(steps)) if j != i]


def param_gather_groups(graph, edges, inside=None, least: int = 2) -> tuple[dict, dict]:
    """How the runtime gathers parameters stored split and used whole (ZeRO-3 / FSDP edges: one
    all-gather, and local steps around it: ``grouped_route``): grouped per (layer, mesh axes), as
    FSDP groups a block's parameters, one collective per group in forward and one reduce-scatter
    in backward. ``inside``: the nodes of the program (default: all). Returns (group key ->
    [(parameter, its first edge)] in program order, (consumer, input position) -> group key), for
    groups of ``least`` or more parameters (the runtime groups two or more; a lone parameter's
    gather is an ordinary reshard, whose backward is the same reduce-scatter)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    inside = set(graph.nodes) if inside is None else inside
    members: dict = {}  # key -> {parameter: first edge}
    readers: dict = {}  # key -> [(consumer, position)]
    for e in sorted(edges, key=lambda e: order.get(e.dst, -1)):
        src = graph.nodes.get(e.src)
        if (src is None or src.op != "placeholder" or src.role != Role.PARAMETER or e.src not in inside
                or e.dst not in inside):
            continue
        route = grouped_route(e.steps)
        if route is None:
            continue
        key = (graph.nodes[e.dst].layer, tuple(e.steps[route[0]].axes))
        members.setdefault(key, {}).setdefault(e.src, e)
        readers.setdefault(key, []).append((e.dst, e.position))
    groups = {k: list(m.items()) for k, m in members.items() if len(m) >= least}
    return groups, {r: k for k in groups for r in readers[k]}
