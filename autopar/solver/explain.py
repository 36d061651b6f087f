"""A readable account of a Plan. Summary first: the layout in the field's words (data / tensor /
sequence / pipeline parallel degrees, Megatron column/row, ZeRO stage or FSDP, vocabulary-parallel
embedding and loss), the predicted step by part, memory per device by kind, and the costliest
collectives; then, per layer, each op's strategy, the collectives autopar inserts in front of it
(with bytes) and its predicted time (views and getitems only with ``all=True``). Reads the Plan only,
by its fields: ``Plan.explain`` calls it, so it imports nothing of ``solver.plan``."""
from __future__ import annotations

import math
from collections import Counter

from autopar.record.gradients import pending_axes
from autopar.sharding_spec.spec import spec_str
from autopar.sharding_spec.strategy import VOCAB_EMBEDDING, VOCAB_LOSS
from autopar.solver.units import fmt_bytes, fmt_s

_HIDE_TARGETS = ("output",)
_PLUMBING = ("view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze",
             "contiguous", "alias", "slice", "select", "split", "getitem", "clone", "detach", "flatten", "unflatten")


def _short_target(t: str) -> str:
    return t.removeprefix("aten.").removesuffix(".default")


def _is_plumbing(target: str) -> bool:
    name = target.removeprefix("aten.").split(".")[0]
    return name in _PLUMBING or target.endswith("getitem")


def _header(plan) -> str:
    mesh = plan.mesh
    cluster = (mesh.get("cluster") or {}).get("name", "cpu-gloo")
    lines = [f"plan for {plan.model_name} on mesh {'x'.join(map(str, mesh['shape']))} "
             f"(axes {', '.join(mesh['axis_names'])}; cluster {cluster})"]
    call = plan.solver.get("call")
    if call:
        lines.append("call: " + call_words(call))
    if plan.precision:  # (without a policy the call's line says the parameters' dtype)
        lines.append("precision: " + precision_words(plan.precision))
    if call:
        lines += [f"note: {n}" for n in call.get("notes", ())]
    return "\n".join(lines)


def precision_words(precision: dict | None) -> str:
    """"bfloat16 compute on a working copy of float32 masters (the optimizer's), gradients summed
    in float32", or the model's own dtypes."""
    if not precision:
        return "the model's own dtypes (no mixed-precision policy)"
    work, reduce, master = precision["param_dtype"], precision["reduce_dtype"], precision["master_dtype"]
    if work == master:
        return f"{work} throughout"
    return f"{work} compute on a working copy of {master} masters (the optimizer's), gradients summed in {reduce}"


def call_words(call: dict) -> str:
    """"input_ids int64[512, 8192], labels int64[512, 8192] (batch 512 x sequence 8192 = 4.2M tokens
    a step); 8.03B parameters in bfloat16, AdamW states priced"."""
    inputs = call.get("inputs") or {}
    parts = [", ".join(f"{n} {m}" for n, m in inputs.items()) or "no tensor inputs"]
    batch, tokens = call_batch(call)
    if tokens:
        parts[0] += f" (batch {batch} x sequence {tokens // batch} = {_count(tokens)} tokens a step)"
    elif batch:
        parts[0] += f" (batch {batch})"
    n = call.get("parameters") or 0
    if n:
        parts.append(f"{_count(n)} parameters in {call.get('param_dtype')}, {call.get('optimizer', 'adamw')} states priced")
    return "; ".join(parts)


def call_batch(call: dict) -> tuple[int | None, int | None]:
    """(samples, tokens) a step of the call holds: its first input's leading dim, and where that
    input is integer ids of two or more dims (a language model's), batch x sequence tokens."""
    first = next(iter((call.get("inputs") or {}).values()), "")
    dtype, _, dims = first.partition("[")
    shape = [int(d) for d in dims.rstrip("]").split(",") if d.strip()] if dims else []
    if not shape:
        return None, None
    tokens = shape[0] * shape[1] if len(shape) >= 2 and dtype.startswith(("int", "uint")) else None
    return shape[0], tokens


def throughput(plan) -> dict:
    """What the predicted step reads as against published runs: ``mfu``, the model FLOPs of a
    step (3 x the forward's matmuls, attention and convolutions: forward and backward,
    recomputation not counted, as torchtitan and Megatron count them) over the step's time on
    every device at its preset's peak for the compute dtype; ``tokens_per_s_per_device`` (a language model's) or ``samples_per_s_per_device``.
    Empty for plans saved without the call's facts."""
    from autopar.cluster import resolve_cluster

    call, step = plan.solver.get("call") or {}, plan.predicted.get("step_time_s")
    if not call or not step:
        return {}
    devices = math.prod(plan.mesh["shape"])
    out = {}
    if call.get("flops"):
        cluster = resolve_cluster(plan.mesh.get("cluster"))
        dtype = (plan.precision or {}).get("param_dtype") or call.get("param_dtype") or "float32"
        peak = cluster.peak(dtype)
        out["model_flops"] = 3.0 * call["flops"]
        out["mfu"] = out["model_flops"] / (step * devices * peak)
    batch, tokens = call_batch(call)
    if tokens:
        out["tokens_per_s_per_device"] = tokens / step / devices
    elif batch:
        out["samples_per_s_per_device"] = batch / step / devices
    return out


LOCAL_RANKS = 8  # the most ranks a plan is run with on one machine before it needs a cluster


def dry_run_words(plan) -> list[str]:
    """Where a plan is for more ranks than a machine runs: how to run its programs before a job does."""
    size = math.prod(plan.mesh["shape"])
    if size <= LOCAL_RANKS:
        return []
    return [f"before launching {size} ranks: `autopar dry-run` builds and runs sampled ranks' programs here, on "
            "meta tensors over a fake process group, and checks every collective against its peers and the memory "
            "against this plan"]


def throughput_words(plan) -> list[str]:
    """The line explain prints of ``throughput``, or none."""
    t = throughput(plan)
    if not t:
        return []
    parts = []
    if "mfu" in t:
        parts.append(f"model-FLOPs utilization {t['mfu']:.1%} ({_count(t['model_flops'])}FLOP a step, at the "
                     "preset's peak)")
    if "tokens_per_s_per_device" in t:
        parts.append(f"{_count(t['tokens_per_s_per_device'])} tokens/s per device")
    elif "samples_per_s_per_device" in t:
        parts.append(f"{_count(t['samples_per_s_per_device'])} samples/s per device")
    return ["predicted " + ", ".join(parts)]


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def collapsed_rows(plan, *, show_all: bool = False, collapse_repeats: bool = True,
                   max_rows_per_layer: int | None = None) -> tuple[list, dict[str, list[str]]]:
    """The per-layer table's rows, a layer whose rows equal an earlier layer's (a repeated block
    with the same choices) left out; and first layer -> the layers left out as its repeats."""
    incoming: dict[str, list] = {}
    for e in plan.edges:
        if e.steps:
            incoming.setdefault(e.dst, []).append(e)
    by_layer: dict[str, list] = {}
    for r in _rows(plan, incoming, show_all=show_all):
        by_layer.setdefault(r[0], []).append(r)
    seen: dict[tuple, str] = {}
    shown, repeats = [], {}
    for layer, lr in by_layer.items():
        # a parameter's row names it; compare layers by the name relative to the layer
        key = tuple((r[1].removeprefix(layer + "."), *r[2:]) for r in lr)
        if collapse_repeats and layer and key in seen:
            repeats.setdefault(seen[key], []).append(layer)
            continue
        seen[key] = layer
        shown += lr[:max_rows_per_layer] if max_rows_per_layer else lr
    return shown, repeats


def _rows(plan, incoming, show_all: bool = True):
    rows = []
    for node in plan.nodes.values():
        if node.target in _HIDE_TARGETS or (not show_all and node.target != "placeholder" and _is_plumbing(node.target)):
            continue
        colls = []
        comm = 0.0
        for e in incoming.get(node.name, []):
            comm += e.cost_s
            for s in e.steps:
                if s.kind in ("slice", "to_partial"):
                    continue
                colls.append(f"{s.kind}[{''.join(map(str, s.axes))}] {fmt_bytes(s.nbytes)}")
        p = next((p for p in plan.params.values() if p.node == node.name), None)
        if p is not None and p.grad_sync is not None:
            comm += p.grad_sync_s
            colls.append(f"grad {p.grad_sync.name}[{''.join(map(str, p.grad_sync.axes))}] {fmt_bytes(p.grad_sync.nbytes)}")
        ins = ", ".join(spec_str(s) for s in node.inputs) if node.inputs else ""
        op = (p.name if p is not None else node.name) if node.target == "placeholder" else _short_target(node.target)
        rows.append((node.layer or "", op, node.family, ins, spec_str(node.output), "; ".join(colls), node.compute_s + comm))
    return rows


def explain(plan, *, max_rows_per_layer: int | None = None, collapse_repeats: bool = True,
            all: bool = False) -> str:
    """``all``: also the rows of views, reshapes and getitems (hidden by default)."""
    if plan.pipeline is not None:
        return _explain_pipeline(plan, max_rows_per_layer=max_rows_per_layer, collapse_repeats=collapse_repeats, all=all)
    shown, repeats = collapsed_rows(plan, show_all=all, collapse_repeats=collapse_repeats,
                                    max_rows_per_layer=max_rows_per_layer)
    out = [
        _header(plan),
        "layout: " + layout_words(plan),
        *_decided(plan),
        _step_line(plan.predicted),
        _memory_line(plan.predicted, plan.solver.get("memory_budget"), plan.solver.get("memory_budget_from")),
        *throughput_words(plan),
        *dry_run_words(plan),
        "costliest collectives per step:" + ("".join(f"\n  {line}" for line in costliest_collectives(plan)) or " none"),
        *returned_split_lines(plan),
        "",
    ]
    header = ("layer", "op", "family", "inputs", "output", "collectives inserted", "time")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *[(*r[:6], fmt_s(r[6])) for r in shown])]
    widths = [min(w, 60) for w in widths]

    def line(cells):
        return "  ".join(str(c)[:w].ljust(w) for c, w in zip(cells, widths)).rstrip()

    out.append(line(header))
    out.append(line(["-" * w for w in widths]))
    for r in shown:
        out.append(line((*r[:6], fmt_s(r[6]))))
    if repeats:
        out.append("")
        for first, layers in repeats.items():
            out.append(f"{len(layers)} more layer(s) with the same choices as {first}: {', '.join(layers)}")
    s = plan.summary()
    out += [
        "",  # the step and memory lead the summary above; the totals of the table close it
        "families: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["families"].items(), key=lambda kv: -kv[1])),
        "parameter storage: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["param_storage"].items())),
        f"collectives per step: {len(s['collectives'])}, {fmt_bytes(sum(c[2] for c in s['collectives']))} in all",
    ]
    if plan.identical_axes:
        pending = sum(1 for axes in pending_axes(plan).values() if set(axes) & set(plan.identical_axes))
        out.append(f"gradients whole on mesh axes {list(plan.identical_axes)} (Megatron's convention): parameters "
                   "replicated there whose readers do not split them need no sync there; ops that split them "
                   "all-reduce their replicated inputs' gradients in backward"
                   + (f", but for {pending} parameter(s) whose gradient waits for the bucketed sync there" if pending else ""))
    if plan.solver.get("pruned"):
        out.append("note: the ILP was too big to solve whole; the widest nodes kept only their best-scored "
                   "candidates (autopar/solver/simplify.py: prune), so this plan may not be the optimum")
    return "\n".join(out)


def returned_split_lines(plan) -> list[str]:
    """The outputs a call returns split over ranks (training reads the loss alone), which the
    runtime gathers only when they are read (``autopar.runtime.outputs``)."""
    out = next((n for n in plan.nodes.values() if n.target == "output"), None)
    if out is None:
        return []
    made = {e.position: e.src for e in plan.edges if e.dst == out.name}
    split = [(i, s) for i, s in enumerate(out.inputs) if s is not None and not s.is_replicated]
    if not split:
        return []
    return ["returned split, gathered only when read (a loss made of them trains as usual): " + ", ".join(
        f"output {i} ({made.get(i, '?')}, {'x'.join(map(str, s.shape))}) {spec_str(s)}" for i, s in split)]


def _step_line(p: dict) -> str:
    """The predicted step by part (autopar/cost_model/step.py); plans saved before the step model
    carry only compute and communication."""
    parts = [("compute", "compute_s"), ("op overheads", "overhead_s"), ("communication", "comm_s"),
             ("gradient accumulation", "grad_accumulate_s"), ("optimizer", "optimizer_s")]
    text = " + ".join(f"{name} {fmt_s(p[key])}" for name, key in parts if key in p)
    if "exposed_sync_s" in p:
        text += (f" (communication: reshards {fmt_s(p['reshard_s'])}, in ops {fmt_s(p.get('op_comm_s', 0.0))}, gradient sync {fmt_s(p['exposed_sync_s'])} "
                 f"exposed of {fmt_s(p['grad_sync_s'])} in {p['buckets']} bucket(s), ZeRO-2 gathers {fmt_s(p['param_gather_s'])}"
                 + (f", ZeRO-2 buffers made anew {fmt_s(p['zero2_fresh_s'])}" if p.get("zero2_fresh_s") else "") + ")")
    return f"predicted step time {fmt_s(p['step_time_s'])} = {text}"


def _explain_pipeline(plan, **kw) -> str:
    """A pipelined plan: the pipeline first, then each stage's own table."""
    p = plan.pipeline
    budget, source = plan.solver.get("memory_budget"), plan.solver.get("memory_budget_from")
    whence = f", {source}" if source and source != "memory_budget" else ""
    out = [
        _header(plan),
        f"pipeline: {len(p.stages)} stages" + (f" ({p.virtual_stages} per rank)" if p.virtual_stages > 1 else "")
        + f", {p.schedule}, {p.microbatches} microbatches" if len(p.stages) > 1 else f"one stage: {pipeline_words(plan)}",
        "layout: " + layout_words(plan),
        *_decided(plan),
        f"predicted step time {fmt_s(plan.predicted['step_time_s'])}, of which bubble "
        f"{fmt_s(p.bubble_fraction * plan.predicted['step_time_s'])} ({p.bubble_fraction:.0%}); "
        f"memory per device up to {fmt_bytes(plan.predicted['memory_bytes_per_device'])}"
        + (f" (budget {fmt_bytes(budget)}{whence})" if budget else ", no budget given"),
        *throughput_words(plan),
        *dry_run_words(plan),
        *([f"that is train_step's {p.schedule}; a call (pmodel(...) then backward()) runs GPipe's order, every "
           f"microbatch in flight: predicted {fmt_s(plan.predicted['call_step_time_s'])}"]
          if len(p.stages) > 1 and "call_step_time_s" in plan.predicted else []),
        "",
    ]
    for i, s in enumerate(p.stages):
        fam = plan_families(s.plan)
        out.append(f"stage {i}: layers {s.layers[0]}-{s.layers[1]} ({s.layer_names[0]} .. {s.layer_names[1]}), "
                   f"ranks {s.ranks[0]}-{s.ranks[-1]} as mesh {'x'.join(map(str, s.mesh_shape))}, "
                   f"{fmt_s(s.time_per_microbatch_s)} per microbatch, {fmt_bytes(s.memory_bytes)}; {fam}")
    for i, s in enumerate(p.stages):
        out += ["", f"--- stage {i} ---", explain(s.plan, **kw)]
    return "\n".join(out)


def plan_families(plan) -> str:
    counts: dict[str, int] = {}
    for n in plan.nodes.values():
        if n.target not in ("placeholder", "output"):
            counts[n.family] = counts.get(n.family, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:4])


# ---- the summary ------------------------------------------------------------------------------------
_WEIGHT_OPS = ("linear", "mm", "addmm", "matmul", "bmm", "baddbmm", "conv", "embedding")


def axis_roles(plan) -> dict[int, str]:
    """Mesh axis -> "data", "tensor", "sequence", "idle" or "none", read from the ops that multiply
    by a weight (linear, addmm as transformers' Conv1D writes it, matmul, conv, embedding): an axis
    splitting a weight as the op reads it is tensor parallel; one splitting only the batch dim of
    their activations data parallel, only the sequence dim sequence parallel. A ZeRO-3 / FSDP
    weight is read whole (gathered): its storage axis is not tensor parallel."""
    shape = plan.mesh["shape"]
    votes = {a: Counter() for a in range(len(shape)) if shape[a] > 1}
    weights = {p.node for p in plan.params.values() if not p.buffer and len(p.storage.shape) >= 2}
    reads: dict[str, set[int]] = {}  # node -> positions of its inputs that are weights
    for e in plan.edges:
        if e.src in weights:
            reads.setdefault(e.dst, set()).add(e.position)
    for name, positions in reads.items():
        n = plan.nodes.get(name)
        if n is None or not any(k in _short_target(n.target).split(".")[0] for k in _WEIGHT_OPS):
            continue
        acts = [x for i, x in enumerate(n.inputs) if i not in positions and x is not None and len(x.shape) >= 2]
        for a in votes:
            if any(a in n.inputs[i].used_axes or a in n.inputs[i].partial for i in positions if n.inputs[i] is not None):
                votes[a]["tensor"] += 1
            elif any(x.dim_axes and a in x.dim_axes[0] for x in acts):
                votes[a]["data"] += 1
            elif any(len(x.dim_axes) > 2 and a in x.dim_axes[1] for x in acts):
                votes[a]["sequence"] += 1
            else:
                votes[a]["none"] += 1
    roles = {}
    for a, v in votes.items():
        if a in plan.idle_axes:
            roles[a] = "idle"
        elif v:
            roles[a] = v.most_common(1)[0][0]
        else:  # no weight ops: the batch split of any op decides
            roles[a] = "data" if any(n.output is not None and not isinstance(n.output, tuple) and n.output.dim_axes
                                     and a in n.output.dim_axes[0] for n in plan.nodes.values()) else "none"
    return roles


def attention_forms(plan) -> dict[int, str]:
    """Mesh axis -> how attention runs over a sequence it splits: "ring" (ring attention over the
    axis), "all-to-all" (attention split by heads on it: the sequence is exchanged for heads
    around the op), or both with their counts where the plan mixes them ("ring in 1 attention
    op, all-to-all in 1"); axes attention does neither on are absent."""
    counts: dict[int, Counter] = {}
    for n in plan.nodes.values():
        spec = n.output[0] if isinstance(n.output, tuple) else n.output
        if spec is None or "scaled_dot_product" not in n.target:
            continue
        ring_axes = set(spec.dim_axes[-2]) if n.family.ring is not None else set()
        for a in ring_axes:
            counts.setdefault(a, Counter())["ring"] += 1
        if n.family.has("heads") and len(spec.dim_axes) >= 3:
            for a in set(spec.dim_axes[-3]) - ring_axes:
                counts.setdefault(a, Counter())["all-to-all"] += 1
    out = {}
    for a, c in counts.items():
        if len(c) == 1:
            out[a] = next(iter(c))
        else:
            ops = sorted(c.items())
            out[a] = f"{ops[0][0]} in {ops[0][1]} attention op{'s' * (ops[0][1] > 1)}, " + ", ".join(
                f"{form} in {k}" for form, k in ops[1:])
    return out


def pipeline_words(plan) -> str:
    """"a 2-stage pipeline", "gradient accumulation over 4 microbatches", "recomputation"."""
    p = plan.pipeline
    if p is None:
        return "one stage"
    blocks = len(p.stages) // p.virtual_stages
    if blocks > 1:
        return f"a {blocks}-stage pipeline"
    if p.microbatches > 1:
        return f"gradient accumulation over {p.microbatches} microbatches"
    return "selective recomputation" if p.stages[0].selective else "recomputation"


def layout_words(plan) -> str:
    """The layout as people say it, e.g. "data parallel 2 x tensor parallel 2 (Megatron column/row
    in the blocks), ZeRO-2, vocabulary-parallel loss"."""
    stages = plan.stage_plans()
    first = stages[0]
    shape = first.mesh["shape"]
    roles = axis_roles(first)
    names = {"data": "data parallel", "tensor": "tensor parallel", "sequence": "sequence parallel",
             "idle": "replicated (idle axis)", "none": "replicated compute"}
    parts = []
    if plan.pipeline is not None and len(plan.pipeline.stages) // plan.pipeline.virtual_stages > 1:
        v = plan.pipeline.virtual_stages
        parts.append(f"pipeline parallel {len(plan.pipeline.stages) // v}" + (f" ({v} stages per rank)" if v > 1 else ""))
    attention = attention_forms(first)
    parts += [f"context parallel {shape[a]} ({attention[a]})" if r == "sequence" and a in attention
              else f"{names[r]} {shape[a]}" for a, r in sorted(roles.items())]
    words = " x ".join(parts) or "one device"
    extras = []
    fam = Counter(n.family for p in stages for n in p.nodes.values() if n.layer is not None)
    if any(r == "tensor" for r in roles.values()):
        col = sum(v for k, v in fam.items() if k.has("1d-col") or k.has("2d"))
        row = sum(v for k, v in fam.items() if k.has("1d-row") or k.has("2d-mk"))
        if col and row:
            extras.append("Megatron column/row in the blocks")
        if any(k.has("heads") for k in fam):
            extras.append("attention split by heads")
    if any(p.grad_sync is not None and p.grad_sync.split for q in stages for p in q.params.values() if not p.buffer):
        extras.append("ZeRO-2 (gradients and optimizer states sharded)")
    # ZeRO-3 / FSDP: most parameters stored split and gathered whole before use (tensor-parallel
    # weights are stored split too, but read split)
    params = {q.node for p in stages for q in p.params.values() if not q.buffer}
    gathered = {e.src for p in stages for e in p.edges if e.src in params and any(st.kind == "all_gather" for st in e.steps)}
    if params and len(gathered) * 2 >= len(params):
        extras.append("ZeRO-3 / FSDP parameter sharding")
    elif gathered:
        extras.append(f"{len(gathered)} parameter(s) gathered before use")
    all_fams = Counter(n.family for q in stages for n in q.nodes.values())
    if any(k.has(VOCAB_EMBEDDING) for k in all_fams):
        extras.append("vocabulary-parallel embedding")
    if any(k.has(VOCAB_LOSS) for k in all_fams):
        extras.append("vocabulary-parallel loss")
    if plan.pipeline is not None:
        p = plan.pipeline
        recomputed = sum(1 for s in p.stages if s.recompute)
        how = "selective recomputation" if all(s.selective for s in p.stages if s.recompute) else "recomputation"
        if len(p.stages) // p.virtual_stages > 1:
            extras.append(f"{p.schedule}, {p.microbatches} microbatches")
        elif p.microbatches > 1:
            extras.append(f"gradient accumulation over {p.microbatches} microbatches")
        if recomputed:
            extras.append(f"{how} in {recomputed} stage(s)" if len(p.stages) > 1 else how)
    return words + (", " + ", ".join(extras) if extras else "")


def _decided(plan) -> list[str]:
    """The line saying why this plan beat the simpler (or more complex) one, where one was weighed."""
    why = plan.solver.get("decided")
    return [f"chosen: {why}"] if why else []


def _memory_line(p: dict, budget=None, source: str | None = None) -> str:
    total = p["memory_bytes_per_device"]
    parts = p.get("memory_parts")
    whence = f" ({source})" if source and source != "memory_budget" else ""
    against = f", budget {fmt_bytes(budget)}{whence}, {total / budget:.0%} used" if budget else ", no budget given"
    if not parts:
        return f"memory per device {fmt_bytes(total)} (parameters, gradients, optimizer states, saved activations){against}"
    return (f"memory per device {fmt_bytes(total)} = parameters {fmt_bytes(parts['parameters'])} + gradients "
            f"{fmt_bytes(parts['gradients'])} + optimizer states {fmt_bytes(parts['optimizer_states'])} + activations "
            f"{fmt_bytes(parts['activations'])}{against}")


def _per_step(plan) -> int:
    """How many times a step runs each stage plan's reshards: its microbatches (1 unpipelined)."""
    return 1 if plan.pipeline is None else plan.pipeline.microbatches


def bytes_per_step(plan) -> float:
    """Bytes the collectives of one step move: every microbatch's reshards, and the gradient sync
    once."""
    m = _per_step(plan)
    total = 0.0
    for p in plan.stage_plans():
        sync = sum(int(q.grad_sync.nbytes) * len(q.grad_sync.collectives) for q in p.params.values() if q.grad_sync is not None)
        reshard = sum(c[2] for c in p.collectives()) - sync
        total += m * reshard + sync
    return float(total)


def costliest_collectives(plan, k: int = 5) -> list[str]:
    """The ``k`` costliest kinds of collective of a step: resharding steps (forward and their
    backward duals) grouped by (collective, axes, bytes, the op they feed), and gradient syncs
    (of a pipeline: every microbatch's reshards; the sync, priced at 1 / microbatches by the stage
    plans, once in full)."""
    m = _per_step(plan)
    groups: dict[tuple, list] = {}  # key -> [seconds, count]
    for p in plan.stage_plans():
        for e in p.edges:
            dst = p.nodes.get(e.dst)
            op = _short_target(dst.target) if dst is not None else e.dst
            for st in e.steps:
                if st.kind in ("slice", "to_partial"):
                    continue
                key = (st.kind, tuple(st.axes), int(st.nbytes), f"before {op}")
                g = groups.setdefault(key, [0.0, 0])
                g[0] += st.cost_s * (2 if e.backward else 1) * m
                g[1] += m
        for q in p.params.values():
            if q.grad_sync is not None:
                key = (f"gradient {q.grad_sync.name}", q.grad_sync.axes, 0, "parameter sync")
                g = groups.setdefault(key, [0.0, 0, 0])
                g[0] += q.grad_sync_s * m
                g[1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:k]
    out = []
    for (kind, axes, nbytes, where), (seconds, count, *_) in top:
        size = f" {fmt_bytes(nbytes)}" if nbytes else ""
        out.append(f"{kind}[{''.join(map(str, axes))}]{size} {where} x{count}: {fmt_s(seconds)}")
    return out
