"""Which parameters stored split are gathered together: one collective per (layer, mesh axes), as
FSDP groups a block's parameters. Codegen emits the groups; the cost model prices the same ones."""
from __future__ import annotations

from autopar.ir.graph import Role

def param_gather_groups(graph, edges, inside=None, least: int = 2) -> tuple[dict, dict]:
    """How the runtime gathers parameters stored split and used whole (ZeRO-3 / FSDP edges: one
    all-gather step): grouped per (layer, mesh axes), as FSDP groups a block's parameters, one
    collective per group in forward and one reduce-scatter in backward. ``inside``: the nodes of
    the program (default: all). Returns (group key -> [(parameter, its first edge)] in program
    order, (consumer, input position) -> group key), for groups of ``least`` or more parameters
    (the runtime groups two or more; a lone parameter's gather is an ordinary reshard, whose
    backward is the same reduce-scatter)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    inside = set(graph.nodes) if inside is None else inside
    members: dict = {}  # key -> {parameter: first edge}
    readers: dict = {}  # key -> [(consumer, position)]
    for e in sorted(edges, key=lambda e: order.get(e.dst, -1)):
        src = graph.nodes.get(e.src)
        if (src is None or src.op != "placeholder" or src.role != Role.PARAMETER or e.src not in inside
                or e.dst not in inside or len(e.steps) != 1 or e.steps[0].kind != "all_gather"):
            continue
        key = (graph.nodes[e.dst].layer, tuple(e.steps[0].axes))
        members.setdefault(key, {}).setdefault(e.src, e)
        readers.setdefault(key, []).append((e.dst, e.position))
    groups = {k: list(m.items()) for k, m in members.items() if len(m) >= least}
    return groups, {r: k for k in groups for r in readers[k]}
