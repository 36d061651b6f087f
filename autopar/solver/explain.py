"""A readable account of a Plan: per layer, each op's strategy, the collectives autopar inserts
in front of it (with bytes), and its predicted time; then the totals. Reads the Plan only."""
from __future__ import annotations

from autopar.solver.plan import Plan, spec_str

_HIDE_TARGETS = ("output",)


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _fmt_b(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _short_target(t: str) -> str:
    return t.removeprefix("aten.").removesuffix(".default")


def _rows(plan: Plan, incoming):
    rows = []
    for node in plan.nodes.values():
        if node.target in _HIDE_TARGETS:
            continue
        colls = []
        comm = 0.0
        for e in incoming.get(node.name, []):
            comm += e.cost_s
            for s in e.steps:
                if s.kind in ("slice", "to_partial"):
                    continue
                colls.append(f"{s.kind}[{''.join(map(str, s.axes))}] {_fmt_b(s.nbytes)}")
        p = next((p for p in plan.params.values() if p.node == node.name), None)
        if p is not None and p.grad_sync is not None:
            comm += p.grad_sync_s
            colls.append(f"grad {p.grad_sync[0]}[{''.join(map(str, p.grad_sync[1]))}] {_fmt_b(p.grad_sync[2])}")
        ins = ", ".join(spec_str(s) for s in node.inputs) if node.inputs else ""
        op = (p.name if p is not None else node.name) if node.target == "placeholder" else _short_target(node.target)
        rows.append((node.layer or "", op, node.family, ins, spec_str(node.output), "; ".join(colls), node.compute_s + comm))
    return rows


def explain(plan: Plan, *, max_rows_per_layer: int | None = None, collapse_repeats: bool = True) -> str:
    if plan.pipeline is not None:
        return _explain_pipeline(plan, max_rows_per_layer=max_rows_per_layer, collapse_repeats=collapse_repeats)
    incoming: dict[str, list] = {}
    for e in plan.edges:
        if e.steps:
            incoming.setdefault(e.dst, []).append(e)
    rows = _rows(plan, incoming)
    mesh = plan.mesh
    cluster = (mesh.get("cluster") or {}).get("name", "cpu-gloo")
    out = [
        f"plan for {plan.model_name} on mesh {'x'.join(map(str, mesh['shape']))} "
        f"(axes {', '.join(mesh['axis_names'])}; cluster {cluster})",
        "",
    ]
    header = ("layer", "op", "family", "inputs", "output", "collectives inserted", "time")
    # Collapse layers whose rows equal an earlier layer's (repeated blocks with the same choices).
    by_layer: dict[str, list] = {}
    for r in rows:
        by_layer.setdefault(r[0], []).append(r)
    seen: dict[tuple, str] = {}
    shown, notes = [], []
    for layer, lr in by_layer.items():
        # a parameter's row names it; compare layers by the name relative to the layer
        key = tuple((r[1].removeprefix(layer + "."), *r[2:]) for r in lr)
        if collapse_repeats and layer and key in seen:
            notes.append((seen[key], layer))
            continue
        seen[key] = layer
        shown += lr[:max_rows_per_layer] if max_rows_per_layer else lr
    widths = [max(len(str(x)) for x in col) for col in zip(header, *[(*r[:6], _fmt_s(r[6])) for r in shown])]
    widths = [min(w, 60) for w in widths]

    def line(cells):
        return "  ".join(str(c)[:w].ljust(w) for c, w in zip(cells, widths)).rstrip()

    out.append(line(header))
    out.append(line(["-" * w for w in widths]))
    for r in shown:
        out.append(line((*r[:6], _fmt_s(r[6]))))
    if notes:
        groups: dict[str, list[str]] = {}
        for first, layer in notes:
            groups.setdefault(first, []).append(layer)
        out.append("")
        for first, layers in groups.items():
            out.append(f"{len(layers)} more layer(s) with the same choices as {first}: {', '.join(layers)}")
    s = plan.summary()
    out += [
        "",
        _step_line(plan.predicted),
        f"memory per device {_fmt_b(s['memory_bytes_per_device'])} (parameters, gradients, optimizer states, saved activations)",
        "families: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["families"].items(), key=lambda kv: -kv[1])),
        "parameter storage: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["param_storage"].items())),
        f"collectives per step: {len(s['collectives'])}, {_fmt_b(sum(c[2] for c in s['collectives']))} in all",
    ]
    if plan.solver.get("pruned"):
        out.append("note: the ILP was too big to solve whole; the widest nodes kept only their best-scored "
                   "candidates (autopar/solver/simplify.py: prune), so this plan may not be the optimum")
    return "\n".join(out)


def _step_line(p: dict) -> str:
    """The predicted step by part (autopar/cost_model/step.py); plans saved before the step model
    carry only compute and communication."""
    parts = [("compute", "compute_s"), ("op overheads", "overhead_s"), ("communication", "comm_s"),
             ("optimizer", "optimizer_s")]
    text = " + ".join(f"{name} {_fmt_s(p[key])}" for name, key in parts if key in p)
    if "exposed_sync_s" in p:
        text += (f" (communication: reshards {_fmt_s(p['reshard_s'])}, in ops {_fmt_s(p.get('op_comm_s', 0.0))}, gradient sync {_fmt_s(p['exposed_sync_s'])} "
                 f"exposed of {_fmt_s(p['grad_sync_s'])} in {p['buckets']} bucket(s), ZeRO-2 gathers {_fmt_s(p['param_gather_s'])})")
    return f"predicted step time {_fmt_s(p['step_time_s'])} = {text}"


def _explain_pipeline(plan: Plan, **kw) -> str:
    """A pipelined plan: the pipeline first, then each stage's own table."""
    p = plan.pipeline
    mesh = plan.mesh
    cluster = (mesh.get("cluster") or {}).get("name", "cpu-gloo")
    out = [
        f"plan for {plan.model_name} on mesh {'x'.join(map(str, mesh['shape']))} (axes {', '.join(mesh['axis_names'])}; "
        f"cluster {cluster}): {len(p.stages)} pipeline stages, {p.schedule}, {p.microbatches} microbatches",
        f"predicted step time {_fmt_s(plan.predicted['step_time_s'])}, bubble {p.bubble_fraction:.0%}, "
        f"memory per device up to {_fmt_b(plan.predicted['memory_bytes_per_device'])}",
        "",
    ]
    for i, s in enumerate(p.stages):
        fam = plan_families(s.plan)
        out.append(f"stage {i}: layers {s.layers[0]}-{s.layers[1]} ({s.layer_names[0]} .. {s.layer_names[1]}), "
                   f"ranks {s.ranks[0]}-{s.ranks[-1]} as mesh {'x'.join(map(str, s.mesh_shape))}, "
                   f"{_fmt_s(s.time_per_microbatch_s)} per microbatch, {_fmt_b(s.memory_bytes)}; {fam}")
    for i, s in enumerate(p.stages):
        out += ["", f"--- stage {i} ---", explain(s.plan, **kw)]
    return "\n".join(out)


def plan_families(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for n in plan.nodes.values():
        if n.target not in ("placeholder", "output"):
            counts[n.family] = counts.get(n.family, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
