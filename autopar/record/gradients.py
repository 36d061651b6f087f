"""Which gradients come out identical on which mesh axes, and what that moves.

Per mesh axis a plan's backward follows one of two conventions for a value replicated there (see
``autopar.codegen.collectives``):

    dual (the default)    every rank holds a pending share of the gradient; the sum is taken where
                          the layout needs it (a parameter's gradient all-reduce, the backward of a
                          forward all-reduce). Free to defer, so data-parallel axes use it.
    identical             every rank holds the whole gradient (Megatron's tensor-parallel
                          convention). An op that splits the axis gives its replicated inputs a
                          partial gradient, summed at once (``autopar_grad_sum``: identity forward,
                          all-reduce backward, Megatron's "f"); in exchange a forward all-reduce
                          needs none in backward, a gather's backward is a local slice, and a
                          parameter replicated on the axis whose readers do not split it (layer
                          norms, biases added after a row-parallel all-reduce) needs no gradient
                          sync there.

``identical_axes`` is a plan's set of such axes. This module answers, for a plan and that set,
where the sums go (``grad_sum_reads``), which parameter syncs remain (``param_sync_axes``) and
whether the set can run at all (``identical_ok``). Codegen emits from these answers; the cost model
prices the same ones (``autopar.cost_model.gradients``).
"""
from __future__ import annotations

from autopar.ir.graph import Role, needs_grad
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import VOCAB_LOSS


def whole_on(axes, identical) -> bool:
    """Whether a step (or a loss's class axes) over ``axes`` runs under the whole convention: every
    one of its axes is an identical-gradient axis."""
    return bool(axes) and set(axes) <= set(identical)


def _flat(spec) -> list[ShardingSpec]:
    if isinstance(spec, ShardingSpec):
        return [spec]
    if isinstance(spec, (tuple, list)):
        return [x for s in spec for x in _flat(s)]
    return []


def _replicated_on(spec, a: int) -> bool:
    return isinstance(spec, ShardingSpec) and a not in spec.used_axes and a not in spec.partial


def split_axes(node_plan, axes) -> tuple[int, ...]:
    """The axes of ``axes`` the op splits: some input or output of it is split or pending there."""
    specs = _flat(node_plan.inputs) + _flat(node_plan.output)
    return tuple(a for a in axes if any(a in s.used_axes or a in s.partial for s in specs))


def _edge_axes(edge) -> set[int]:
    return {a for s in edge.steps for a in s.axes} if edge is not None else set()


def _is_param(graph, name: str) -> bool:
    node = graph.nodes.get(name)
    return node is not None and node.op == "placeholder" and node.role == Role.PARAMETER


def _partial_reads(plan, graph, identical, grad) -> dict[tuple[str, int], tuple[int, ...]]:
    """(consumer, input position) -> identical axes on which that read's local backward leaves a
    partial gradient: the input is replicated there and the op splits the axis."""
    out = {}
    for name, np_ in plan.nodes.items():
        node = graph.nodes.get(name)
        if node is None or node.op != "call_function":
            continue
        split = split_axes(np_, identical)
        if not split:
            continue
        for pos, src in enumerate(node.inputs):
            if src not in grad or pos >= len(np_.inputs):
                continue
            axes = tuple(a for a in split if _replicated_on(np_.inputs[pos], a))
            if axes:
                out[(name, pos)] = axes
    return out


def _param_reads(plan, graph) -> dict[str, list[tuple[str, int]]]:
    reads: dict[str, list] = {}
    for name, node in graph.nodes.items():
        if name not in plan.nodes:
            continue
        for pos, src in enumerate(node.inputs):
            if _is_param(graph, src):
                reads.setdefault(src, []).append((name, pos))
    return reads


def _deferred(plan, graph, identical, partial, edges) -> dict[str, tuple[int, ...]]:
    """Parameter node -> the identical axes on which its gradient is left a pending sum for the
    reducer (no grad_sum): every read of it splits the axis and reads it with no step there. A
    parameter read both ways gets sums on its splitting reads instead (a pending share and a whole
    gradient cannot be added)."""
    out = {}
    for p, reads in _param_reads(plan, graph).items():
        keep = []
        for a in identical:
            if all(a in partial.get(r, ()) and a not in _edge_axes(edges.get(r)) for r in reads):
                keep.append(a)
        out[p] = tuple(keep)
    return out


def _analysis(plan, graph, identical) -> tuple[dict, dict]:
    """(``_partial_reads``, ``_deferred``) of the plan for ``identical`` (both empty without it)."""
    if not identical:
        return {}, {}
    edges = {(e.dst, e.position): e for e in plan.edges}
    partial = _partial_reads(plan, graph, identical, needs_grad(graph))
    return partial, _deferred(plan, graph, identical, partial, edges)


def grad_sum_reads(plan, graph, identical) -> dict[tuple[str, int], tuple[int, ...]]:
    """(consumer, input position) -> the identical axes its input's gradient is all-reduced over
    in backward (``autopar_grad_sum`` on that read)."""
    partial, deferred = _analysis(plan, graph, tuple(identical))
    out = {}
    for (name, pos), axes in partial.items():
        src = graph.nodes[name].inputs[pos]
        if _is_param(graph, src):
            axes = tuple(a for a in axes if a not in deferred.get(src, ()))
        if axes:
            out[(name, pos)] = axes
    return out


def param_sync_axes(plan, graph, identical) -> dict[str, tuple[int, ...]]:
    """Parameter fqn -> the axes its gradient is still synchronised over: its planned sync axes,
    less the identical axes on which its gradient comes out whole."""
    identical = tuple(identical)
    _, deferred = _analysis(plan, graph, identical)
    out = {}
    for fqn, p in plan.params.items():
        if p.buffer or p.grad_sync is None:
            continue
        axes = tuple(a for a in p.grad_sync.axes if a not in identical or a in deferred.get(p.node, ()))
        out[fqn] = axes
    return out


def identical_ok(plan, graph, identical, sync: dict) -> str | None:
    """None when the plan can run with gradients identical on ``identical``; else why not.
    ``sync``: ``param_sync_axes`` of that set."""
    identical = set(identical)
    for e in plan.edges:
        if graph.nodes[e.dst].op == "output" and output_whole_axes(e.steps):
            continue  # seeded whole on every axis of its steps: their backwards run no collective
        for s in e.steps:
            if identical & set(s.axes) and not set(s.axes) <= identical:
                return f"edge {e.src} -> {e.dst} has a {s.kind} over axes {s.axes}, only partly identical"
    for n in plan.nodes.values():
        if n.family.has(VOCAB_LOSS):
            x = n.inputs[0]
            cdim = 1 if x.ndim >= 2 else 0
            classes = set(x.dim_axes[cdim])
            if identical & classes and not classes <= identical:
                return f"{n.name}: class axes {sorted(classes)} only partly identical"
    for fqn, p in plan.params.items():
        if p.grad_sync is not None and p.grad_sync.split and tuple(sync[fqn]) != p.grad_sync.axes:
            return f"{fqn}: a ZeRO-2 gradient would come out whole on axes {sorted(set(p.grad_sync.axes) - set(sync[fqn]))}"
    return None


OUTPUT_WHOLE_KINDS = ("all_gather", "all_reduce")


def output_whole_axes(steps) -> tuple[int, ...]:
    """Axes on which an output's gradient is whole because of its own steps: every rank seeds a
    graph output with the same gradient, so where the steps bringing it to every rank are gathers
    and all-reduces their backwards keep a chunk or nothing (codegen's ``_output``)."""
    if not steps or any(s.kind not in OUTPUT_WHOLE_KINDS for s in steps):
        return ()
    return tuple(sorted({a for s in steps for a in s.axes}))
