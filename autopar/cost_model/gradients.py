"""The seconds the gradient conventions of ``autopar.record.gradients`` move in backward: a reshard's
backward under either convention (``backward_reshard_s``, ``backward_route_s``) and the sums of identical-gradient axes
(``grad_sum_s``)."""
from __future__ import annotations

import math

from autopar.cost_model.comm import mesh_collective_time, slice_backward_time
from autopar.ir.graph import edge_itemsize
from autopar.record.gradients import grad_sum_reads, whole_on
from autopar.sharding_spec.reshard import local_bytes


def backward_reshard_s(edge, mesh, identical) -> float:
    """Seconds of the backward of ``edge``'s steps (``backward_route_s``); 0 where none runs."""
    if not edge.backward:
        return 0.0
    return backward_route_s(edge.steps, [s.cost_s for s in edge.steps], mesh, identical)


def backward_route_s(steps, costs, mesh, identical) -> float:
    """Seconds of the backward of a route of reshard ``steps`` (each forward priced ``costs``): a
    slice's pads the gradient back to its input's size (the step's bytes), or under the identical
    convention all-gathers it; every other step's dual is priced as its forward, except under the
    identical convention, where a gather's, an all-reduce's and a to_partial's backward are local.
    The ILP's edge prices and the step model both read it."""
    total = 0.0
    for s, cost in zip(steps, costs):
        whole = whole_on(s.axes, identical)
        if s.kind == "slice":
            total += (mesh_collective_time("all_gather", s.nbytes, mesh, s.axes) if whole else
                      slice_backward_time(s.nbytes, math.prod(mesh.shape[a] for a in s.axes), mesh.resolved_cluster()))
        elif not whole or s.kind in ("reduce_scatter", "all_to_all"):
            total += cost
    return total


def grad_sum_s(plan, graph, mesh, identical) -> float:
    """Seconds of the backward all-reduces ``grad_sum_reads`` adds: one per value and axes (a
    value read whole by several splitting ops is summed once)."""
    reads = grad_sum_reads(plan, graph, identical)
    if not reads:
        return 0.0
    edges = {(e.dst, e.position): e for e in plan.edges}
    seen = {}
    for (name, pos), axes in reads.items():
        node = graph.nodes[name]
        spec = plan.nodes[name].inputs[pos]
        edge = edges.get((name, pos))
        key = (node.inputs[pos], spec, axes) if edge is None or not edge.steps else (name, pos, axes)
        itemsize = edge_itemsize(graph.nodes[node.inputs[pos]].meta, node)
        seen[key] = mesh_collective_time("all_reduce", local_bytes(spec, mesh.shape, itemsize), mesh, axes)
    return sum(seen.values())
