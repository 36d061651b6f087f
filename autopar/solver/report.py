"""``autopar explain --html report.html``: one self-contained HTML file (inline CSS and SVG, no
script, nothing fetched) showing a Plan: the summary, memory per device (per stage for a
pipeline), the pipeline timeline under its schedule, one block's graph with the spec on each edge,
the per-layer table, and the what-ifs as a chart. Reads the Plan (and what-if rows) only."""
from __future__ import annotations

import html
import math

from autopar.cost_model.schedules import simulate_shared
from autopar.record.schedules import schedule_named
from autopar.solver.explain import (
    _is_plumbing, _memory_line, _step_line, collapsed_rows, costliest_collectives, layout_words,
)
from autopar.sharding_spec.spec import spec_str
from autopar.solver.plan import Plan
from autopar.solver.units import fmt_bytes, fmt_s

_COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer_states": "#e15759", "activations": "#76b7b2",
           "memory": "#59a14f", "F": "#4e79a7", "B": "#f28e2b", "W": "#59a14f"}


def _e(x) -> str:
    return html.escape(str(x))


def html_report(plan: Plan, whatifs=None) -> str:
    """The report as one HTML string."""
    mesh = plan.mesh
    title = f"autopar plan: {plan.model_name} on mesh {'x'.join(map(str, mesh['shape']))}"
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{_e(title)}</title>",
        "<style>body{font-family:sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}"
        "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
        "code{font-size:12px}.muted{color:#666}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        "<h2>Summary</h2><ul>",
        f"<li><b>layout</b>: {_e(layout_words(plan))}</li>",
        f"<li>{_e(_step_line(plan.predicted) if plan.pipeline is None else _pipeline_step(plan))}</li>",
        f"<li>{_e(_memory_line(plan.predicted, plan.solver.get('memory_budget'), plan.solver.get('memory_budget_from')))}</li>",
        "<li>costliest collectives per step:<ul>" + "".join(f"<li><code>{_e(c)}</code></li>" for c in costliest_collectives(plan))
        + "</ul></li></ul>",
        "<h2>Memory per device</h2>", _memory_svg(plan),
    ]
    if plan.pipeline is not None:
        parts += ["<h2>Pipeline timeline</h2>", _timeline_svg(plan)]
    first = plan.stage_plans()[0]
    parts += ["<h2>One block's graph, with the spec on each edge</h2>", _block_svg(first)]
    if whatifs:
        parts += ["<h2>What-ifs (same cost model)</h2>", _whatif_svg(whatifs)]
    for i, p in enumerate(plan.stage_plans()):
        heading = "Per-layer table" if plan.pipeline is None else f"Stage {i}: per-layer table"
        parts += [f"<h2>{heading}</h2>", _table(p)]
    parts.append("</body></html>")
    return "\n".join(parts)


def _pipeline_step(plan: Plan) -> str:
    p = plan.pipeline
    step = plan.predicted["step_time_s"]
    return (f"predicted step time {fmt_s(step)}: {len(p.stages)} stages, {p.schedule}, {p.microbatches} microbatches, "
            f"bubble {fmt_s(p.bubble_fraction * step)} ({p.bubble_fraction:.0%})")


def _memory_svg(plan: Plan) -> str:
    """One bar per device kind (one stage) or per stage, split by kind where the plan knows it."""
    if plan.pipeline is None:
        parts = plan.predicted.get("memory_parts") or {"memory": plan.predicted["memory_bytes_per_device"]}
        bars = [("every device", parts)]
    else:
        bars = [(f"stage {i} (ranks {s.ranks[0]}-{s.ranks[-1]})", {"memory": s.memory_bytes})
                for i, s in enumerate(plan.pipeline.stages)]
    top = max(sum(p.values()) for _, p in bars) or 1.0
    width, row = 560, 26
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width + 260}' height='{row * len(bars) + 40}'>"]
    for i, (label, p) in enumerate(bars):
        y, x = 10 + i * row, 180
        out.append(f"<text x='0' y='{y + 15}' font-size='12'>{_e(label)}</text>")
        for kind, value in p.items():
            w = width * value / top
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='18' fill='{_COLORS[kind]}'>"
                       f"<title>{_e(kind)}: {_e(fmt_bytes(value))}</title></rect>")
            x += w
        out.append(f"<text x='{x + 6:.1f}' y='{y + 14}' font-size='12'>{_e(fmt_bytes(sum(p.values())))}</text>")
    legend_y = 10 + len(bars) * row + 16
    x = 180
    for kind in (bars[0][1] if plan.pipeline is None else {"memory": 0}):
        out.append(f"<rect x='{x}' y='{legend_y - 10}' width='10' height='10' fill='{_COLORS[kind]}'/>"
                   f"<text x='{x + 14}' y='{legend_y}' font-size='11'>{_e(kind.replace('_', ' '))}</text>")
        x += 130
    out.append("</svg>")
    return "".join(out)


def timeline(times: list[float], microbatches: int, schedule: str) -> list[list[tuple[str, int, float, float]]]:
    """Per stage, (task, microbatch, start, end) of each of its tasks, a device per rank: the
    schedule's own order and simulation (``schedules``; forward a third of a stage's time,
    backward two, or input and weight halves under a split backward)."""
    trace: list = []
    simulate_shared(times, [1] * len(times), microbatches, schedule, math.inf, trace)
    placed = [[] for _ in times]
    for st, kind, m, start, end in trace:
        placed[st].append((kind, m, start, end))
    return placed


def _timeline_svg(plan: Plan) -> str:
    p = plan.pipeline
    times = [s.time_per_microbatch_s for s in p.stages]
    shown = min(p.microbatches, 32)
    placed = timeline(times, shown, p.schedule)
    end = max((op[3] for ops in placed for op in ops), default=1.0) or 1.0
    width, row = 900, 22
    out = [f"<p class='muted'>{_e(p.schedule)}, {shown} of {p.microbatches} microbatches drawn; blue forward, "
           "orange backward" + (" (input half), green weight half" if schedule_named(p.schedule).split_backward else "") + "</p>",
           f"<svg xmlns='http://www.w3.org/2000/svg' width='{width + 90}' height='{row * len(placed) + 10}'>"]
    for s, ops in enumerate(placed):
        y = 4 + s * row
        out.append(f"<text x='0' y='{y + 14}' font-size='11'>stage {s}</text>")
        for kind, m, a, b in ops:
            x, w = 60 + width * a / end, max(0.5, width * (b - a) / end)
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='18' fill='{_COLORS[kind]}' stroke='white' "
                       f"stroke-width='0.5'><title>{kind}{m}: {_e(fmt_s(a))} - {_e(fmt_s(b))}</title></rect>")
    out.append("</svg>")
    return "".join(out)


def _block_svg(plan: Plan) -> str:
    """The first layer's ops top to bottom; each edge between them labelled with the spec the
    producer makes and, where it differs, the one the consumer reads (a reshard)."""
    layers = [n.layer for n in plan.nodes.values() if n.layer is not None]
    if not layers:
        return "<p class='muted'>(no layers)</p>"
    layer = layers[0]
    nodes = [n for n in plan.nodes.values() if n.layer == layer and n.target != "placeholder" and not _is_plumbing(n.target)]
    index = {n.name: i for i, n in enumerate(nodes)}
    row, width = 34, 900
    out = [f"<p class='muted'>layer {_e(layer)}: {len(nodes)} ops (views hidden)</p>",
           f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{row * len(nodes) + 20}'>"]
    for i, n in enumerate(nodes):
        y = 10 + i * row
        out.append(f"<rect x='10' y='{y}' width='300' height='22' rx='4' fill='#eef3f8' stroke='#4e79a7'/>"
                   f"<text x='16' y='{y + 15}' font-size='11'>{_e(n.target.removeprefix('aten.'))} [{_e(n.family)}]</text>")
    lane = 0
    for e in plan.edges:
        if e.src in index and e.dst in index and index[e.src] < index[e.dst]:
            y0, y1 = 10 + index[e.src] * row + 11, 10 + index[e.dst] * row + 11
            x = 330 + 14 * (lane % 12)
            lane += 1
            label = spec_str(e.src_spec) + ("" if e.src_spec == e.dst_spec else f" -> {spec_str(e.dst_spec)}")
            colour = "#e15759" if e.steps and any(st.kind not in ("slice",) for st in e.steps) else "#888"
            out.append(f"<path d='M310 {y0} H{x} V{y1} H310' fill='none' stroke='{colour}'/>"
                       f"<text x='{x + 6}' y='{y1 - 2}' font-size='10' fill='{colour}'>{_e(label)}</text>")
    out.append("</svg>")
    return "".join(out)


def _whatif_svg(rows) -> str:
    timed = [r for r in rows if r.step_time_s is not None]
    top = max((r.step_time_s for r in timed), default=1.0) or 1.0
    width, row = 500, 24
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width + 520}' height='{row * len(rows) + 10}'>"]
    for i, r in enumerate(rows):
        y = 4 + i * row
        out.append(f"<text x='0' y='{y + 14}' font-size='12'>{_e(r.name)}</text>")
        if r.step_time_s is None:
            out.append(f"<text x='200' y='{y + 14}' font-size='11' fill='#888'>{_e(r.note[:90])}</text>")
            continue
        w = width * r.step_time_s / top
        fill = "#59a14f" if r.fits else "#bab0ac"
        out.append(f"<rect x='200' y='{y}' width='{w:.1f}' height='18' fill='{fill}'/>"
                   f"<text x='{206 + w:.1f}' y='{y + 14}' font-size='11'>{_e(fmt_s(r.step_time_s))}, "
                   f"{_e(fmt_bytes(r.memory_bytes))}{'' if r.fits else ' - ' + _e(r.note)}</text>")
    out.append("</svg>")
    return "".join(out)


def _table(plan: Plan) -> str:
    rows, repeats = collapsed_rows(plan)
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in ("layer", "op", "family", "inputs", "output", "collectives", "time")) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in (*r[:6], fmt_s(r[6]))) + "</tr>" for r in rows)
    notes = "".join(f"<p class='muted'>{len(v)} more layer(s) with the same choices as {_e(k)}</p>" for k, v in repeats.items())
    return f"<table>{head}{body}</table>{notes}"
