"""What differs between two plans of the same model: stages, per-node choices, parameter storage,
and what each difference costs or saves (``autopar diff a.json b.json``, ``plan.diff(other)``).

Nodes are matched by name (the traced fx names), stage by stage for pipelined plans (a one-stage
plan is one stage). A node differs when its family or any of its specs differs; its cost is the
node's own price in each plan (compute and in-op work; the collectives on its input edges are
listed with it). The totals are the plans' predicted step time and memory per device. Plans are
read by their fields (``Plan.diff`` calls this module, which imports nothing of ``solver.plan``).
"""
from __future__ import annotations

import dataclasses
import json

from autopar.sharding_spec.spec import spec_str
from autopar.solver.units import fmt_bytes, fmt_s


@dataclasses.dataclass
class NodeChange:
    stage: int
    name: str
    layer: str | None
    before: str  # "family: inputs -> output"
    after: str
    seconds_before: float
    seconds_after: float


@dataclasses.dataclass
class PlanDiff:
    same_model: bool
    mesh: tuple | None  # (before, after) when they differ
    stages: tuple | None  # (before, after) stage summaries when they differ
    nodes: list[NodeChange]
    storage: list[tuple[str, str, str]]  # (parameter, before, after)
    step_time_s: tuple[float, float]
    memory_bytes: tuple[float, float]

    cluster: tuple | None = None  # (before, after) cluster names when only they differ

    @property
    def empty(self) -> bool:
        (t0, t1), (m0, m1) = self.step_time_s, self.memory_bytes
        same_totals = abs(t1 - t0) <= 1e-12 * max(abs(t0), 1e-30) and abs(m1 - m0) <= 1e-9 * max(abs(m0), 1.0)
        return not (self.mesh or self.cluster or self.stages or self.nodes or self.storage) and self.same_model and same_totals

    def lines(self, max_nodes: int = 40) -> list[str]:
        if self.empty:
            return ["no differences"]
        out = []
        if not self.same_model:
            out.append("the plans are for different models (fingerprints differ): node names may not correspond")
        if self.mesh:
            out.append(f"mesh: {self.mesh[0]} -> {self.mesh[1]}")
        if self.cluster:
            out.append(f"cluster: {self.cluster[0]} -> {self.cluster[1]}")
        if self.stages:
            out.append(f"stages: {self.stages[0]} -> {self.stages[1]}")
        for name, a, b in self.storage:
            out.append(f"parameter {name}: stored {a} -> {b}")
        for c in self.nodes[:max_nodes]:
            delta = c.seconds_after - c.seconds_before
            where = f"stage {c.stage} " if self.stages or c.stage else ""
            out.append(f"{where}{c.layer or '-'} {c.name}: {c.before} -> {c.after} ({_signed_s(delta)})")
        if len(self.nodes) > max_nodes:
            out.append(f"... and {len(self.nodes) - max_nodes} more node(s)")
        (t0, t1), (m0, m1) = self.step_time_s, self.memory_bytes
        sign = "+" if m1 >= m0 else "-"
        out.append(f"predicted step time {fmt_s(t0)} -> {fmt_s(t1)} ({_signed_s(t1 - t0)}); "
                   f"memory per device {fmt_bytes(m0)} -> {fmt_bytes(m1)} ({sign}{fmt_bytes(abs(m1 - m0))})")
        return out


def _signed_s(s: float) -> str:
    return f"{s * 1e3:+.3f} ms"


def _choice(n) -> str:
    return f"{n.family}: {', '.join(spec_str(s) for s in n.inputs)} -> {spec_str(n.output)}"


def _stage_key(plan) -> list:
    if plan.pipeline is None:
        return [{"layers": "all", "mesh_shape": list(plan.mesh["shape"])}]
    return [{"layers": list(s.layers), "ranks": [s.ranks[0], s.ranks[-1]], "mesh_shape": list(s.mesh_shape),
             "recompute": s.recomputed.value} for s in plan.pipeline.stages]


def diff(a, b) -> PlanDiff:
    """What changes from plan ``a`` to plan ``b``."""
    mesh = cluster = None
    if list(a.mesh["shape"]) != list(b.mesh["shape"]):
        mesh = (tuple(a.mesh["shape"]), tuple(b.mesh["shape"]))
    elif json.dumps(a.mesh.get("cluster"), sort_keys=True) != json.dumps(b.mesh.get("cluster"), sort_keys=True):
        cluster = ((a.mesh.get("cluster") or {}).get("name", "cpu-gloo"), (b.mesh.get("cluster") or {}).get("name", "cpu-gloo"))
    ka, kb = _stage_key(a), _stage_key(b)
    stages = None
    if ka != kb or (a.pipeline and b.pipeline and (a.pipeline.schedule, a.pipeline.microbatches) != (b.pipeline.schedule, b.pipeline.microbatches)):
        def text(p, k):
            extra = "" if p.pipeline is None else f", {p.pipeline.schedule} x{p.pipeline.microbatches}"
            return f"{len(k)} stage(s){extra}"
        stages = (text(a, ka), text(b, kb))
    nodes, storage = [], []
    for i, (pa, pb) in enumerate(zip(a.stage_plans(), b.stage_plans())):
        for name, na in pa.nodes.items():
            nb = pb.nodes.get(name)
            if nb is None:
                continue
            if (na.family, na.inputs, na.output) != (nb.family, nb.inputs, nb.output):
                nodes.append(NodeChange(i, name, na.layer, _choice(na), _choice(nb), na.compute_s, nb.compute_s))
        for fqn, qa in pa.params.items():
            qb = pb.params.get(fqn)
            if qb is not None and (qa.storage, qa.family) != (qb.storage, qb.family):
                storage.append((fqn, f"{qa.family} {spec_str(qa.storage)}", f"{qb.family} {spec_str(qb.storage)}"))
    return PlanDiff(
        a.model_fingerprint == b.model_fingerprint, mesh, stages, nodes, storage,
        (a.predicted["step_time_s"], b.predicted["step_time_s"]),
        (a.predicted["memory_bytes_per_device"], b.predicted["memory_bytes_per_device"]), cluster,
    )
