"""How each pipeline stage reads the values it receives from earlier stages.

A value made by one stage and read by a later one travels in its producer's spec (in the producing
stage's plan, on that stage's sub-mesh); the reading stage's plan has no strategy for it. Each read
that wants it in another spec reshards it on the reading stage's sub-mesh, along the cheapest route
there (``reshard_search.plan_reshard``). A received value that the stage writes into in place is
first copied into the spec its writer reads (``ir.aliasing.written_values``), and every other read of
it in that stage starts from the copy.

``received_edges`` gives those reshards per stage as ``EdgePlan`` s (``StagePlan.received``), so
codegen emits the plan's steps and never searches; ``with_received`` fills them into a plan that
lacks them (a plan file of schema version 3 or older).
"""
from __future__ import annotations

import dataclasses

from autopar.ir.graph import needs_grad
from autopar.ir.aliasing import written_values
from autopar.ir.blocks import unit_of_nodes
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.spec import ShardingSpec
from autopar.solver.plan import EdgePlan, StepPlan
from autopar.solver.reshard_search import plan_reshard


def received_edges(graph, stages) -> list[list[EdgePlan]]:
    """Per stage of ``stages`` (``StagePlan`` s over ``graph``, the microbatch graph), the reshards
    of its reads of values earlier stages made: from the spec the value is held in (as sent, or the
    stage's own copy) to the spec the reader wants, where the two differ."""
    unit = unit_of_nodes(graph)
    stage_of_unit = {u: k for k, st in enumerate(stages) for u in range(st.layers[0], st.layers[1] + 1)}
    made = {n: stage_of_unit[unit[n]] for n, node in graph.nodes.items() if node.op != "placeholder"}
    grads = needs_grad(graph)
    out = []
    for k, stage in enumerate(stages):
        plan = stage.plan
        mesh = Mesh.from_dict(plan.mesh)
        ops = [n for n in graph.nodes if made.get(n) == k]
        written = written_values(graph, ops)
        edges = []
        for dst in ops:
            wants = plan.nodes[dst].inputs
            for pos, src in enumerate(graph.nodes[dst].inputs):
                if src not in made or made[src] == k:
                    continue  # a placeholder (the stage holds it) or made here (the plan's own edge)
                held = stages[made[src]].plan.nodes[src].output
                want = wants[pos] if pos < len(wants) else None
                if src in written and written[src] != (dst, pos):  # read from the stage's own copy
                    reader, p = written[src]
                    copy = plan.nodes[reader].inputs[p]
                    held = copy if copy is not None else held
                if not (isinstance(held, ShardingSpec) and isinstance(want, ShardingSpec)) or held == want:
                    continue
                route = plan_reshard(held, want, mesh, getattr(graph.nodes[src].meta, "itemsize", 4))
                steps = [StepPlan(s.kind, tuple(s.axes), int(s.nbytes), float(c), s.src_dim, s.dst_dim)
                         for s, c in zip(route.steps, route.costs)]
                edges.append(EdgePlan(src, dst, pos, held, want, steps, src in grads))
        out.append(edges)
    return out


def with_received(plan, graph):
    """``plan`` (pipelined, over ``graph``) with every stage's ``received`` edges; the plan itself
    when they are all there already."""
    stages = plan.pipeline.stages
    if all(s.received is not None for s in stages):
        return plan
    filled = [dataclasses.replace(s, received=edges) for s, edges in zip(stages, received_edges(graph, stages))]
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, stages=filled))
