"""`make demo`: trace a built-in model, summarise its graph, and show resharding plans on a mesh."""
from __future__ import annotations

from autopar import ir, models
from autopar.errors import ShardingError
from autopar.sharding_spec import Mesh, ShardingSpec, plan_reshard


def graph_report(graph) -> str:
    s = graph.summary()
    lines = [
        f"model {graph.model_name}: {s['nodes']} nodes, {s['parameters']:,} parameters, "
        f"{s['flops'] / 1e6:,.1f} MFLOP forward",
        f"layers: {len(graph.layers)}; repeated blocks: "
        + ", ".join(f"{len(b)} x {b[0]}" for b in graph.blocks if len(b) > 1),
        "",
        f"{'layer':<28}{'nodes':>7}{'MFLOP':>12}",
    ]
    counts = {}
    for node in graph.nodes.values():
        if node.op == "call_function":
            counts[node.layer or "(outside)"] = counts.get(node.layer or "(outside)", 0) + 1
    for layer, flops in graph.flops_per_layer().items():
        lines.append(f"{layer:<28}{counts.get(layer, 0):>7}{flops / 1e6:>12.2f}")
    return "\n".join(lines)


DEMO_PAIRS = [
    ("[S0, R | P1]", "[S0, R]"),
    ("[S0, R | P1]", "[S01, R]"),
    ("[S0, S1]", "[R, R]"),
    ("[S0, S1]", "[S1, S0]"),
    ("[S01, R]", "[R, S01]"),
    ("[R, R]", "[S1, S0]"),
    ("[R, R | P01]", "[R, R]"),
]


def reshard_report(mesh: Mesh, shape=(1024, 1024), itemsize=4) -> str:
    lines = [f"resharding a {shape[0]}x{shape[1]} fp32 tensor on {mesh} ({mesh.resolved_cluster().name} links)", ""]
    lines.append(f"{'from':<16}{'to':<16}{'cost (us)':>12}  steps")
    for a, b in DEMO_PAIRS:
        try:
            src = ShardingSpec.parse(a, shape, mesh.ndim)
            dst = ShardingSpec.parse(b, shape, mesh.ndim)
        except ShardingError:
            continue  # the pair needs more mesh axes than this mesh has
        plan = plan_reshard(src, dst, mesh, itemsize)
        steps = "; ".join(str(s).split(":")[0] for s in plan.steps) or "-"
        lines.append(f"{a:<16}{b:<16}{plan.cost * 1e6:>12.1f}  {steps}")
    return "\n".join(lines)


def run(mesh_shape=(2, 2), model: str = "gpt") -> None:
    module, inputs = models.build(model)
    graph = ir.trace(module, inputs)
    print(graph_report(graph))
    print()
    mesh = Mesh(mesh_shape, cluster="cpu-gloo")
    print(reshard_report(mesh))
