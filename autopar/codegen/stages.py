"""A pipelined plan's microbatch graph cut into its stages.

Every rank cuts the graph the same way (``cut_stages``): stage ``s`` runs the ops of its layers,
reads the parameters and user inputs those ops read, and exchanges with its neighbours the values
that cross its edges:

    stage 0 receives     the user inputs (one microbatch of each, whole)
    stage s sends        every value made by stages <= s (or a user input) that a later stage reads,
                         in graph order: values a stage does not read pass through it untouched
    the last stage       returns the model's outputs

A value travels in its producer's spec in the sending stage's plan (``sent_specs``); the receiving
stage's program reshards it to what its readers want along the steps its ``StagePlan.received``
gives (``lower(received=..., received_edges=...)``). A parameter read by several stages (a tied
embedding and head) is held by each (``shared_params``).
"""
from __future__ import annotations

import dataclasses

from autopar.errors import PlanError
from autopar.ir.blocks import unit_of_nodes
from autopar.ir.graph import Role
from autopar.sharding_spec.spec import ShardingSpec


@dataclasses.dataclass
class StageCut:
    """What stage ``index`` runs (``nodes``, for ``lower``), receives (``receives``: from the
    previous stage, or the user inputs for stage 0) and sends on (``sends``: empty for the last)."""

    index: int
    nodes: list[str]
    receives: list[str]
    sends: list[str]


def cut_stages(graph, plan) -> list[StageCut]:
    """The stages of ``plan`` over ``graph`` (its microbatch graph); see the module docstring."""
    stages = plan.pipeline.stages
    unit = unit_of_nodes(graph)
    stage_of_unit = {}
    for s, st in enumerate(stages):
        for u in range(st.layers[0], st.layers[1] + 1):
            stage_of_unit[u] = s
    if sorted(stage_of_unit) != list(range(len(graph.layers))):
        raise PlanError(f"the plan's stages cover layers {sorted(stage_of_unit)}, the model has {len(graph.layers)}")
    made: dict[str, int] = {}  # value -> the stage that makes it (user inputs: -1, before stage 0)
    readers: dict[str, set[int]] = {}  # value or placeholder -> the stages that read it
    nodes: list[set[str]] = [set() for _ in stages]  # each stage's ops and the placeholders they read
    for name, node in graph.nodes.items():
        if node.op == "placeholder":
            if node.role == Role.INPUT:
                made[name] = -1
            continue
        s = stage_of_unit[unit[name]]
        made[name] = s
        nodes[s].add(name)
        for src in node.inputs:
            if graph.nodes[src].op == "placeholder":
                nodes[s].add(src)
            elif made[src] > s:
                raise PlanError(f"{name} (stage {s}) reads {src}, made by a later stage {made[src]}")
            readers.setdefault(src, set()).add(s)
    for name, node in graph.nodes.items():  # state nothing reads: held by stage 0
        if node.op == "placeholder" and node.role != Role.INPUT and name not in readers:
            nodes[0].add(name)
    order = list(graph.inputs) + [n for n in graph.nodes if graph.nodes[n].op != "placeholder"]
    cuts = []
    for s in range(len(stages)):
        receives = list(graph.inputs) if s == 0 else cuts[-1].sends
        sends = [] if s == len(stages) - 1 else [
            v for v in order if made.get(v, len(stages)) <= s and any(r > s for r in readers.get(v, ()))]
        for v in sends:
            meta = graph.nodes[v].meta
            if meta is None or isinstance(meta, tuple):
                raise PlanError(f"{v} crosses from stage {s} to stage {s + 1} but is not a tensor; cut elsewhere")
        cuts.append(StageCut(s, [n for n in graph.nodes if n in nodes[s]], list(receives), sends))
    return cuts


def sent_specs(graph, plan, cuts: list[StageCut]) -> dict[str, object]:
    """Value -> the spec it travels in between stages: user inputs whole, activations as their
    producer's output in its stage's plan."""
    out = {}
    for cut, stage in zip(cuts, plan.pipeline.stages):
        for v in cut.sends:
            if v in out:
                continue
            node = graph.nodes[v]
            if node.op == "placeholder":
                out[v] = ShardingSpec.replicate(node.meta.shape, len(stage.mesh_shape))
            else:
                out[v] = stage.plan.nodes[v].output
    return out


def shared_params(graph, cuts: list[StageCut]) -> dict[str, frozenset]:
    """Parameter placeholder -> the stages that read it, for those read by more than one."""
    out: dict[str, set] = {}
    for cut in cuts:
        for n in cut.nodes:
            if graph.nodes[n].op == "placeholder" and graph.nodes[n].role == Role.PARAMETER:
                out.setdefault(n, set()).add(cut.index)
    return {k: frozenset(v) for k, v in out.items() if len(v) > 1}


def lower_stage(graph, plan, cuts: list[StageCut], specs: dict, st: int, mesh, device=None, synced_as=None):
    """Stage ``st``'s program (a ``Lowered``) on ``mesh`` (its sub-mesh): its nodes lowered with
    its own plan, each value it receives arriving in the spec an earlier stage sends it in
    (``sent_specs``); ``synced_as``: the plan whose gradient syncs the reducer runs (``lower``)."""
    from autopar.codegen.lower import lower

    stage = plan.pipeline.stages[st]
    if stage.received is None:
        raise PlanError(f"stage {st} of the plan has no steps for the values it receives (a plan file of schema "
                        "version 3 or older): fill them with autopar.solver.receives.with_received(plan, graph)")
    received = {v: specs[v] for v in cuts[st].receives if graph.nodes[v].op != "placeholder"}
    return lower(graph, stage.plan, mesh, nodes=cuts[st].nodes, device=device, received=received,
                 received_edges=stage.received, synced_as=synced_as)
