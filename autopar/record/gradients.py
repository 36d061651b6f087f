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
                          sync there. A parameter whose every read splits the axis may keep its
                          gradient pending there instead (its sync's axes include the axis), so
                          the reducer sums it with the rest, bucketed.

``identical_axes`` is a plan's set of such axes; the planner prices each set it tries in its ILP
(``solver.problem``). This module answers, for a plan and that set, where the sums go
(``grad_sum_reads``) and whether the plan can run so (``identical_ok``). Codegen emits from these answers; the cost model
prices the same ones (``autopar.cost_model.gradients``).
"""
from __future__ import annotations

from autopar.ir.graph import needs_grad
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import VOCAB_LOSS


def whole_on(axes, identical) -> bool:
    """Whether a step (or a loss's class axes) over ``axes`` runs under the whole convention: every
    one of its axes is an identical-gradient axis."""
    return bool(axes) and set(axes) <= set(identical)


def partly_whole(axes, identical) -> bool:
    """Whether ``axes`` mix identical and dual axes: a step (or a loss's classes) over them has no
    single convention to run its backward under, so no plan may have one."""
    axes, identical = set(axes), set(identical)
    return bool(axes & identical) and not axes <= identical


def loss_class_axes(op_plan) -> tuple[int, ...]:
    """The mesh axes a vocabulary-parallel loss (a NodePlan or a Strategy) splits its classes over;
    () for any other op."""
    if not op_plan.family.has(VOCAB_LOSS) or not op_plan.inputs or op_plan.inputs[0] is None:
        return ()
    x = op_plan.inputs[0]
    return tuple(x.dim_axes[1 if x.ndim >= 2 else 0])


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


def partial_read_axes(op_plan, position: int, identical) -> tuple[int, ...]:
    """The identical axes on which an op (a NodePlan or a Strategy) leaves its input
    ``position`` a partial gradient: it splits the axis and reads the input replicated there."""
    if position >= len(op_plan.inputs):
        return ()
    spec = op_plan.inputs[position]
    return tuple(a for a in split_axes(op_plan, identical) if _replicated_on(spec, a))


def _partial_reads(plan, graph, identical, grad) -> dict[tuple[str, int], tuple[int, ...]]:
    """(consumer, input position) -> ``partial_read_axes`` of every read of a value gradients
    flow back through."""
    out = {}
    for name, np_ in plan.nodes.items():
        node = graph.nodes.get(name)
        if node is None or node.op != "call_function" or not split_axes(np_, identical):
            continue
        for pos, src in enumerate(node.inputs):
            if src in grad and (axes := partial_read_axes(np_, pos, identical)):
                out[(name, pos)] = axes
    return out


def pending_axes(plan) -> dict[str, tuple[int, ...]]:
    """Parameter node -> the axes its gradient is synchronised over (its plan's sync axes): on an
    identical axis among them the parameter's gradient is left a pending share for the reducer
    (the planner chooses so only where every read splits the axis and reads it replicated there:
    ``solver.problem``), so its splitting reads take no sum."""
    return {p.node: tuple(p.grad_sync.axes) for p in plan.params.values()
            if not p.buffer and p.grad_sync is not None}


def grad_sum_reads(plan, graph, identical) -> dict[tuple[str, int], tuple[int, ...]]:
    """(consumer, input position) -> the identical axes its input's gradient is all-reduced over
    in backward (``autopar_grad_sum`` on that read): the axes the op splits where it reads the
    input replicated, but those on which a parameter's gradient stays pending."""
    identical = tuple(identical)
    if not identical:
        return {}
    pending = pending_axes(plan)
    out = {}
    for (name, pos), axes in _partial_reads(plan, graph, identical, needs_grad(graph)).items():
        src = graph.nodes[name].inputs[pos]
        axes = tuple(a for a in axes if a not in pending.get(src, ()))
        if axes:
            out[(name, pos)] = axes
    return out


def identical_ok(plan, graph, identical) -> str | None:
    """None when the plan can run with gradients identical on ``identical``; else why not: a
    reshard with a backward over identical and other axes together, a vocabulary-parallel loss
    over such a mix, or a parameter left pending on an identical axis that one of its reads does
    not split (or reaches through a step over it)."""
    identical = set(identical)
    if not identical:
        return None
    edges = {(e.dst, e.position): e for e in plan.edges}
    for e in plan.edges:
        if not e.backward:
            continue  # (an output's gathers and all-reduces: seeded whole, their backwards run nothing)
        for s in e.steps:
            if partly_whole(s.axes, identical):
                return f"edge {e.src} -> {e.dst} has a {s.kind} over axes {s.axes}, only partly identical"
    for n in plan.nodes.values():
        if partly_whole(loss_class_axes(n), identical):
            return f"{n.name}: class axes {sorted(loss_class_axes(n))} only partly identical"
    partial = _partial_reads(plan, graph, tuple(identical), needs_grad(graph))
    pending = pending_axes(plan)
    for name, reader in graph.nodes.items():
        for pos, src in enumerate(reader.inputs):
            for a in identical & set(pending.get(src, ())):
                if name in plan.nodes and (a not in partial.get((name, pos), ()) or a in _edge_axes(edges.get((name, pos)))):
                    return (f"{src}: its gradient is left pending on identical axis {a}, but {name} does not split "
                            "that axis where it reads it")
    return None


OUTPUT_WHOLE_KINDS = ("all_gather", "all_reduce")


def output_whole_axes(steps) -> tuple[int, ...]:
    """Axes on which an output's gradient is whole because of its own steps: every rank seeds a
    graph output with the same gradient, so where the steps bringing it to every rank are gathers
    and all-reduces their backwards keep a chunk or nothing (codegen's ``_output``)."""
    if not steps or any(s.kind not in OUTPUT_WHOLE_KINDS for s in steps):
        return ()
    return tuple(sorted({a for s in steps for a in s.axes}))
