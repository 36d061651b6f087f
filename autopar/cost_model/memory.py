"""Per-device memory, in bytes: parameters with their gradients and optimizer states, and the
activations a training step keeps alive.

Parameters (``param_memory``), per device::

    param + grad          local elements (by the storage spec) x the param's dtype size, twice
    optimizer states      OPTIMIZER_STATES[optimizer] values per element in the param's dtype (what
                          torch's optimizers keep: a bf16 model's AdamW holds bf16 states, no master)
    under a precision     (``ir.precision.MixedPrecision``; the graph is traced in its working
                          dtype) the master, the gradient and the states in the master dtype, and
                          the working copy the program reads

Optimizer states are divided over ``opt_state_sharded_axes`` (ZeRO-2) on top of the storage
sharding; an axis that already splits the storage divides them only once. ZeRO-2 holds the
working copy the program reads, the chunk the optimizer updates and the chunk's gradient
(``param_memory_parts``); elsewhere gradients are sharded like the storage. Example: 1M params,
AdamW, replicated: fp32 4 + 4 + 8 = 16 MB; a bf16 model 2 + 2 + 4; ``precision="bf16"``
(4 + 2) + 4 + 8; fp32 ZeRO-2 over 4: 4 + 1 + 1 + 2; ``precision="bf16"`` ZeRO-2 over 4:
(1 + 2) + 1 + 2.

Activations: ``saved_for_backward`` lists the values an op's backward reads (``ops.SAVE_RULES``:
matmul operands, the input of gelu/norms, the output of relu/softmax, embedding indices, ...);
they stay alive from their op to the end of the forward. Every other value lives from its op to
its last reader. Views alias their source and cost nothing. ``activation_memory`` is the peak,
over the forward order, of the live bytes. The ILP's linear terms (``node_activation_bytes``) are
every saved value and what lives beside them at the step's peak (``step_peak``, found on the
replicated timeline): in the forward, the values alive there and the workspace of the op running
there; in an op's backward (a language model's loss), the gradients it makes and its backward's
workspace. On edges, the copy a reshard makes of a value backward keeps (``saved_inputs``,
``held_reshard_bytes``). A plan's prediction goes further than these linear terms: a value whose
every keeping read reshards it to a new tensor is freed (``released_by_reshards``), and its
activations are at least their largest while any op runs, forward or backward, with the plan's
local sizes, the copies its reshards make and their collectives' buffers (``plan_forward_peak``,
``plan_backward_peak``). Approximations:

- backward frees saved tensors as it goes and makes gradients about one op at a time: the gradients
  of values an op's backward does not touch (a residual stream's, waiting for the branch) are not
  counted; the gradient parts on their way to the reducer's buckets are bounded by a bucket of them
  (``grad_parts_in_flight``);
- parameters, buffers and constants are not activations (``param_memory`` counts them); user
  inputs are, from the start to their last reader;
- small saved statistics (layer-norm mean/rstd, attention logsumexp) are ignored; a dropout mask
  is counted at the output's dtype size; a multi-output op's outputs live as long as any of them;
- allocator fragmentation, kernels' workspaces (other than ``ops.WORKSPACE_RULES``), the optimizer
  step's temporaries and the CUDA context are not counted.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, NamedTuple

from autopar.cost_model.ops import (
    BACKWARD_WORKSPACE_RULES,
    alias_roots,
    is_view,
    itemsize,
    local_nbytes,
    local_numel,
    save_rule,
    tensor_inputs,
    workspace_bytes,
)
from autopar.errors import ConfigError
from autopar.ir.blocks import unit_of_nodes
from autopar.ir.graph import needs_grad, per_graph
from autopar.ir.losses import fused_cross_entropy
from autopar.sharding_spec.strategy import active_axes

# Optimizer states kept per parameter element.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "momentum": 1}

# Roles whose memory is not an activation's.
STATIC_ROLES = frozenset({"parameter", "buffer", "constant"})


def param_memory_parts(param_meta, storage_spec, mesh, optimizer: str = "adamw", opt_state_sharded_axes=(),
                       precision=None, accumulated: bool = False) -> dict:
    """Bytes one device holds for one parameter, by kind: ``parameters``, ``gradients``,
    ``optimizer_states``. ``param_meta``: a TensorMeta or a parameter Node; ``storage_spec`` None:
    replicated. With ``opt_state_sharded_axes`` (ZeRO-2, as ``runtime.reducer`` runs it) a device
    holds the working copy the program reads (the storage shard), its own chunk of it that the
    optimizer updates, and that chunk's gradient; the whole gradient lives only in the reducer's
    buckets during backward. ``accumulated`` (a step of several microbatches, which add up in the
    buckets until the last one's backward sums them): ZeRO-2's whole gradient lives in its bucket
    from the first microbatch to the sum, in the gradient's accumulation dtype (the master's).

    ``precision`` (an ``ir.precision.MixedPrecision`` that casts; the meta's dtype is then the
    working dtype): what the runtime keeps instead: the master (the parameter the optimizer sees:
    the storage shard, with ZeRO-2 its chunk) and the working copy of the storage shard (cast for
    the step; ZeRO-2 keeps it, gathered), the gradient and the states in the master dtype (and a
    gradient summed by an all-reduce in another ``reduce_dtype``: the bucket's buffer in it)."""
    meta = getattr(param_meta, "meta", param_meta)
    states = OPTIMIZER_STATES.get(optimizer.lower())
    if states is None:
        raise ConfigError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
    numel = local_numel(meta.shape, storage_spec, mesh)
    size = itemsize(meta.dtype)
    already = storage_spec.used_axes if storage_spec is not None else frozenset()
    ways = math.prod(mesh.shape[mesh.axis(a)] for a in set(opt_state_sharded_axes) if mesh.axis(a) not in already)
    chunk = math.ceil(numel / ways)
    if precision is not None and precision.casts:
        master = precision.master_dtype.itemsize
        # a gradient summed in another dtype: its all-reduce bucket keeps the buffer it sends
        summed = any(a not in already for a in active_axes(mesh))
        wire = precision.reduce_dtype.itemsize if (ways == 1 and summed and precision.reduce_dtype != precision.master_dtype) else 0
        accumulating = numel * master if ways > 1 and accumulated else 0
        return {"parameters": chunk * master + numel * size, "gradients": chunk * master + numel * wire + accumulating,
                "optimizer_states": chunk * states * master}
    # Without a policy torch's optimizer keeps its states in the parameter's own dtype, no master.
    per_element = states * size
    if ways > 1:
        return {"parameters": (numel + chunk) * size, "gradients": (chunk + (numel if accumulated else 0)) * size,
                "optimizer_states": chunk * per_element}
    return {"parameters": numel * size, "gradients": numel * size, "optimizer_states": numel * per_element}


def param_memory(param_meta, storage_spec, mesh, optimizer: str = "adamw", opt_state_sharded_axes=(),
                 precision=None, accumulated: bool = False) -> int:
    """``param_memory_parts`` summed."""
    return sum(param_memory_parts(param_meta, storage_spec, mesh, optimizer, opt_state_sharded_axes, precision,
                                  accumulated).values())


def total_param_memory(graph, storage_specs: Mapping | None, mesh, optimizer: str = "adamw", opt_state_sharded_axes=()) -> int:
    """``param_memory`` summed over the graph's parameters; buffers count once at their local size.
    ``storage_specs``: {node name: ShardingSpec}; missing names are replicated."""
    storage_specs = storage_specs or {}
    total = 0
    for node in graph.nodes.values():
        role = str(node.role)
        if node.op != "placeholder" or role not in ("parameter", "buffer"):
            continue
        spec = _output_spec(storage_specs.get(node.name))
        if role == "parameter":
            total += param_memory(node.meta, spec, mesh, optimizer, opt_state_sharded_axes)
        else:
            total += local_nbytes(node.meta, spec, mesh)
    return total


# ---- activations --------------------------------------------------------------------------------
def _saves(graph):
    """(node, its tensor inputs as (position, name), the indices into them its backward keeps,
    whether it keeps its output) for every op with a backward: not a view, computed from a
    gradient-needing input (a comparison or an integer op carries no gradient)."""
    ng = needs_grad(graph)
    for node in graph.nodes.values():
        if node.op != "call_function" or is_view(node.target) or node.name not in ng:
            continue
        tin = tensor_inputs(node, graph)
        grad_idx = {k for k, (_, name) in enumerate(tin) if name in ng}
        if not grad_idx:
            continue
        idx, saves_output = save_rule(node.target)(grad_idx, len(tin), node)
        if any(not 0 <= k < len(tin) for k in idx):
            raise IndexError(
                f"the save rule of {node.target} names tensor inputs {sorted(idx)} of node {node.name!r}, "
                f"which has {len(tin)} ({[name for _, name in tin]}; args {node.args})"
            )
        yield node, tin, idx, saves_output


@per_graph
def saved_for_backward(graph) -> frozenset[str]:
    """Names of the storage-owning values (never views: a saved view keeps its source alive, so
    the source is listed) that some op's backward reads. Parameters, buffers and constants are
    left out: they are alive anyway."""
    roots = alias_roots(graph)
    saved: set[str] = set()
    for node, tin, idx, saves_output in _saves(graph):
        for k in idx:
            saved |= roots[tin[k][1]]
        if saves_output:
            saved |= roots[node.name]
    return frozenset(n for n in saved if str(graph.nodes[n].role) not in STATIC_ROLES)


@per_graph
def saved_inputs(graph) -> frozenset[tuple[str, int]]:
    """(consumer, position in its ``inputs``) of every value a backward keeps as the consumer reads
    it: the op saves that input (``ops.SAVE_RULES``), or the consumer is a view of a value kept so.
    Where the plan reshards such an edge (a ZeRO-3 parameter gathered whole for a matmul, an
    activation gathered for a sequence-parallel matmul), the reshard's result is what stays alive
    until backward, not the value the producer made."""
    out: set[tuple[str, int]] = set()
    kept: set[str] = set()  # values some backward keeps (read directly, or through views)
    for node, tin, idx, _ in _saves(graph):
        for k in idx:
            out.add((node.name, tin[k][0]))
            kept.add(tin[k][1])
    for node in reversed(list(graph.nodes.values())):  # a view's readers come after it
        if node.op == "call_function" and is_view(node.target) and node.name in kept:
            # a getitem reads its multi-output view (a split) as a tuple, not a tensor input
            ins = [(0, node.inputs[0])] if node.target == "operator.getitem" else tensor_inputs(node, graph)
            for pos, name in ins:
                out.add((node.name, pos))
                kept.add(name)
    return frozenset(out)


@per_graph
def keeping_reads(graph) -> dict[str, tuple[tuple[tuple[str, int], ...], ...]]:
    """For every value saved for backward (``saved_for_backward``): the reads that keep it alive,
    each as the edges (consumer, position in its ``inputs``) from the op whose backward keeps it
    back through views to the value; an empty tuple where its own op keeps its output."""
    roots = alias_roots(graph)
    saved = saved_for_backward(graph)

    def path(name: str, root: str) -> tuple[tuple[str, int], ...]:
        edges = []
        while name != root:
            node = graph.nodes[name]
            pos, name = next((k, i) for k, i in enumerate(node.inputs) if i in roots and root in roots[i])
            edges.append((node.name, pos))
        return tuple(edges)

    out: dict[str, list] = {}
    for node, tin, idx, saves_output in _saves(graph):
        for k in idx:
            pos, name = tin[k]
            for r in roots[name] & saved:
                out.setdefault(r, []).append(((node.name, pos),) + path(name, r))
        if saves_output:
            for r in roots[node.name] & saved:
                out.setdefault(r, []).append(())
    return {r: tuple(paths) for r, paths in out.items()}


def released_by_reshards(graph, fresh) -> tuple[frozenset[str], frozenset[tuple[str, int]]]:
    """(the saved values no backward keeps once the plan runs, the reshard edges whose copies are
    kept in their place). A value is freed when every read that would keep it crosses an edge in
    ``fresh`` ((consumer, position) of reshards that make a new tensor); of each such read the
    copy nearest its reader is kept (``held_reshard_bytes`` with ``released``), copies further
    back are freed as the value is. A q, k and v split by heads from a projection made whole: the
    split copies stay, the projection and its whole copy go."""
    fresh = set(fresh)
    released, holding = set(), set()
    for r, paths in keeping_reads(graph).items():
        if graph.nodes[r].op == "placeholder":  # a user's input: the caller holds it
            continue
        nearest = [next((e for e in p if e in fresh), None) for p in paths]
        if all(e is not None for e in nearest):
            released.add(r)
            holding.update(nearest)
    return frozenset(released), frozenset(holding)


@per_graph
def run_again(graph) -> frozenset[str]:
    """The ops a recomputed layer runs again in backward: torch's checkpoint (non-reentrant, as
    ``runtime.stage_program`` runs each layer's piece) stops recomputing once it has every tensor
    the piece's backward saved, so the ops after a layer's last op that saves one (a residual add,
    a tensor-parallel output's all-reduce) do not run again. Their collectives, emitted with the op
    that reads them, likewise."""
    unit = unit_of_nodes(graph)
    order = {name: k for k, name in enumerate(graph.nodes)}
    last: dict[int, int] = {}  # unit -> graph position of its last op saving a tensor for backward
    for node, _, idx, saves_output in _saves(graph):
        if (idx or saves_output) and node.name in unit:
            last[unit[node.name]] = max(last.get(unit[node.name], -1), order[node.name])
    return frozenset(name for name, node in graph.nodes.items()
                     if node.op == "call_function" and name in unit and order[name] <= last.get(unit[name], -1))


def accumulating_bytes(param_meta, storage_spec, mesh, opt_state_sharded_axes=(), precision=None) -> int:
    """Of ``param_memory_parts(..., accumulated=True)``'s gradients, the whole bucket ZeRO-2 adds the
    microbatches up in: alive from the first microbatch's backward (``accumulation_overlap``)."""
    kw = dict(opt_state_sharded_axes=opt_state_sharded_axes, precision=precision)
    return (param_memory_parts(param_meta, storage_spec, mesh, accumulated=True, **kw)["gradients"]
            - param_memory_parts(param_meta, storage_spec, mesh, **kw)["gradients"])


def accumulation_overlap(accumulating: float, activation_bytes: float) -> float:
    """What a stage that runs all its forwards before its first backward (GPipe:
    ``Schedule.forwards_first``) holds less than its state and its forward's peak summed: the
    buckets ZeRO-2 adds gradients up in (``accumulating``) exist from the first backward on, when
    one microbatch's ``activation_bytes`` have gone. Where forwards and backwards alternate (1F1B's
    steady state, a loop of microbatches under ``no_sync()``) a later forward reaches the peak
    beside the buckets: nothing."""
    return min(float(accumulating), float(activation_bytes))


def gradients_made_late(late_bytes: float, activation_bytes: float) -> float:
    """What gradients that exist only from their backward on (``late_bytes``: no reducer's bucket
    holds them between steps and ``zero_grad()`` frees them, as torch's does by default) add to
    the step's peak: backward makes them as it frees the microbatch's ``activation_bytes``, so
    only their excess, at its end."""
    return max(0.0, float(late_bytes) - float(activation_bytes))


def grad_parts_in_flight(part_bytes: float, bucket_bytes: float, activation_bytes: float) -> float:
    """What a backward holds beyond the step's peak while the reducer collects a bucket, bounded
    by a bucket of gradient parts (``part_bytes`` those of the parameters there are, in the dtype
    the program reads them) alive late in the microbatch's backward, when most of its
    ``activation_bytes`` are freed: the excess of the one over the other. The reducer takes each
    part as soon as autograd completes it (``runtime.reducer``'s taps), so fewer are alive at once:
    an upper bound, nothing for a model whose microbatch saves more than a bucket."""
    return max(0.0, min(float(bucket_bytes), float(part_bytes)) - float(activation_bytes))


def held_reshard_bytes(src_static: bool, src_spec, dst_spec, mesh, itemsize: int, released: bool = False) -> int:
    """Bytes a reshard on a saved edge (``saved_inputs``) keeps alive on top of what the source
    holds: nothing without a reshard; the whole copy when the source is a parameter or buffer
    (held anyway: ZeRO-3's gathered weights) or is ``released`` (``released_by_reshards``: no
    backward keeps it); else what the copy adds to the producer's value, which is counted as
    saved. The ILP prices the last way (it cannot see whether every reader of a value reshards
    it); the plan's prediction, the first where it applies. Crediting a smaller copy per edge let
    the ILP make transient copies free: a chain of views gathered whole and split again by each
    reader "saved" the whole projection."""
    if src_spec is None or dst_spec is None or src_spec == dst_spec:
        return 0
    held = local_numel(dst_spec.shape, dst_spec, mesh) * itemsize
    return held if src_static or released else max(0, held - local_numel(src_spec.shape, src_spec, mesh) * itemsize)


@dataclasses.dataclass(frozen=True)
class StepPeak:
    """Where a training step's live activations peak (``step_peak``): the node running then and
    the values alive beside the saved ones there; for a peak in that node's backward
    (``backward``), the positions in its inputs whose gradients it makes (``grads``)."""

    node: str | None = None
    live: frozenset = frozenset()
    backward: bool = False
    grads: tuple = ()


def node_activation_bytes(node, strategy, mesh, saved, peak: StepPeak = StepPeak(), in_metas=()) -> int:
    """The ILP's linear memory term of ``node`` under ``strategy`` (a Strategy or an output spec):
    its local bytes when it is saved for backward (``saved``: ``saved_for_backward``) or alive,
    unsaved, at the step's peak (``peak``: ``step_peak``), and at the peak node what it makes
    beside them (``node_peak_bytes``; ``in_metas``: its inputs' metas). Summed over nodes: the
    saved activations at the end of the forward plus what lives beside them at the peak (a
    language model's loss: in backward, the gradients of its log-probabilities and logits)."""
    out = local_nbytes(node.meta, _output_spec(strategy), mesh) if node.name in saved else 0
    return out + node_peak_bytes(node, strategy, mesh, saved, peak, in_metas)


def node_peak_bytes(node, strategy, mesh, saved, peak: StepPeak, in_metas=()) -> int:
    """The part of ``node_activation_bytes`` held only at the step's peak, once, not per
    microbatch in flight: the node's value where it lives there unsaved, and where it is the
    peak's node, its workspace (``ops.workspace_bytes``), or for a peak in its backward its
    output's gradient, the gradients it makes and its backward's workspace."""
    out = 0
    if node.name in peak.live and node.name not in saved:
        out += local_nbytes(node.meta, _output_spec(strategy), mesh)
    if node.name != peak.node or not hasattr(strategy, "inputs"):
        return out
    if not peak.backward:
        return out + workspace_bytes(node, in_metas, strategy.inputs, mesh)
    return out + _backward_bytes(node, in_metas, strategy.inputs, _output_spec(strategy), peak.grads, mesh)


def _backward_bytes(node, in_metas, in_specs, out_spec, grads, mesh) -> int:
    """What ``node``'s backward holds beside the saved values: its output's gradient, the
    gradients it makes (``grads``: positions in its inputs) and its workspace."""
    made = sum(local_nbytes(in_metas[k], in_specs[k] if k < len(in_specs) else None, mesh)
               for k in grads if k < len(in_metas))
    return (local_nbytes(node.meta, out_spec, mesh) + made
            + workspace_bytes(node, in_metas, in_specs, mesh, BACKWARD_WORKSPACE_RULES))


@per_graph
def _last_readers(graph) -> tuple[list, dict[str, int], list[tuple[str, int]]]:
    """(nodes in forward order, the last position each value is read at (the end of the forward
    when the model returns it), (name, position) of the values that own their memory and are
    activations)."""
    order = list(graph.nodes.values())
    pos = {n.name: t for t, n in enumerate(order)}
    roots = alias_roots(graph)
    end_of_forward = len(order) - 1
    last = {n.name: pos[n.name] for n in order}
    for t, node in enumerate(order):
        for name in node.inputs:
            for r in roots.get(name, ()):
                last[r] = max(last[r], end_of_forward if node.op == "output" else t)
    owners = [(n.name, pos[n.name]) for n in order
              if roots[n.name] == frozenset({n.name}) and str(n.role) not in STATIC_ROLES]
    return order, last, owners


def _lifetimes(graph, released=frozenset()) -> tuple[list, list[tuple[str, int, int]]]:
    """(nodes in forward order, (name, first, last position alive) of every value that owns its
    memory and is an activation): a saved value lives to the end of the forward (unless
    ``released``: ``released_by_reshards``), another to its last reader (the end, when the model
    returns it)."""
    order, last, owners = _last_readers(graph)
    saved = saved_for_backward(graph)
    end_of_forward = len(order) - 1
    spans = [(name, first, end_of_forward if name in saved and name not in released else last[name])
             for name, first in owners]
    return order, spans


def _forward_live(graph, out_specs: Mapping, mesh, released=frozenset(), held_for: Mapping | None = None):
    """(node, the live activation bytes while it runs, its workspace aside) in forward order, each
    value's local size by its output spec (``out_specs``: {name: spec or Strategy}; missing names
    are replicated), the ``released`` values living to their last reader only, and the reshard
    copies kept for backward (``held_for``: {op: bytes}) from their reader on."""
    order, spans = _lifetimes(graph, released)
    delta = [0] * (len(order) + 1)
    for name, first, end in spans:
        size = local_nbytes(graph.nodes[name].meta, _output_spec(out_specs.get(name)), mesh)
        delta[first] += size
        delta[end + 1] -= size
    if held_for:
        pos = {n.name: t for t, n in enumerate(order)}
        for name, nbytes in held_for.items():
            delta[pos[name]] += nbytes
            delta[len(order)] -= nbytes
    live = 0
    for t, node in enumerate(order):
        live += delta[t]
        yield node, live


def activation_timeline(graph, specs: Mapping | None, mesh) -> list[tuple[str, int]]:
    """(node name, live activation bytes while that node runs) in forward order. ``specs``:
    {node name: output ShardingSpec (a tuple for multi-output ops) or Strategy}; missing names
    are replicated."""
    specs = specs or {}
    out = []
    for node, live in _forward_live(graph, specs, mesh):
        ins = [graph.nodes[i].meta if i in graph.nodes else None for i in node.inputs]
        strategy = specs.get(node.name)
        in_specs = strategy.inputs if hasattr(strategy, "inputs") else ()
        out.append((node.name, live + workspace_bytes(node, ins, in_specs, mesh)))
    return out


def plan_forward_peak(graph, mesh, out_specs: Mapping, in_specs: Mapping, held_for: Mapping, released,
                      reshard_forward: Mapping) -> int:
    """The most live activation bytes while any op runs forward under a plan: ``activation_timeline``
    with the plan's local sizes (``out_specs``, ``in_specs`` as ``plan_backward_peak``'s), the
    ``released`` values living to their last reader only, the reshard copies kept for backward
    (``held_for``: {op: bytes}) from their reader on, and at each op what the reshards of its
    reads make and hold while they run (``reshard_forward``: {(op, position): (the copy's bytes,
    its collectives' buffers)}, ``reshard_forward_bytes``): the copies it reads, and the
    largest of the buffers. A plan that gathers a large value whole where it is read (a ring's
    logits for a replicated loss) peaks there."""
    copies: dict[str, int] = {}
    buffers: dict[str, int] = {}
    for (name, _), (copy, buffer) in reshard_forward.items():
        copies[name] = copies.get(name, 0) + copy
        buffers[name] = max(buffers.get(name, 0), buffer)
    best = 0
    for node, live in _forward_live(graph, out_specs, mesh, released, held_for):
        ins = [graph.nodes[i].meta if i in graph.nodes else None for i in node.inputs]
        work = workspace_bytes(node, ins, in_specs.get(node.name, ()), mesh)
        best = max(best, live + copies.get(node.name, 0) + max(work, buffers.get(node.name, 0)))
    return best


def _route_sizes(steps, src_spec, mesh, itemsize: int) -> list[int]:
    """The local bytes before a reshard's first step and after each."""
    from autopar.sharding_spec.reshard import spec_after

    specs = [src_spec]
    for st in steps:
        specs.append(spec_after(specs[-1], st))
    return [local_numel(sp.shape, sp, mesh) * itemsize for sp in specs]


def _route_key(steps) -> tuple:
    return tuple((st.kind, tuple(st.axes), st.src_dim, st.dst_dim) for st in steps)


def reshard_forward_bytes(steps, src_spec, mesh, itemsize: int) -> tuple[int, int]:
    """(the bytes of a reshard's result, what its steps hold beside their input and result at the
    largest: an intermediate result and the collective's buffers, ``step_buffer_bytes``)."""
    return _reshard_forward_of(_route_key(steps), src_spec, mesh, itemsize)


@functools.lru_cache(maxsize=65536)  # (a plan's edges share few routes; the planner makes ~50 plans)
def _reshard_forward_of(route, src_spec, mesh, itemsize: int) -> tuple[int, int]:
    steps = [_RouteStep(*r) for r in route]
    sizes = _route_sizes(steps, src_spec, mesh, itemsize)
    held = 0
    for k, st in enumerate(steps):
        held = max(held, (sizes[k] if k else 0)
                   + step_buffer_bytes(st.kind, st.src_dim, st.dst_dim, sizes[k], sizes[k + 1]))
    return sizes[-1], held


@per_graph
def _backward_walk(graph):
    """What ``step_peak`` and ``plan_backward_peak`` walk: (the forward order, the position of the
    first reader of every saved value, the unsaved values the model returns, {op: positions in its
    inputs whose gradients its backward makes} for the ops whose backward makes any). A saved value
    is alive in an op's backward while an op at or before it still has to read it."""
    saved = saved_for_backward(graph)
    order, spans = _lifetimes(graph)
    end = len(order) - 1
    returned = frozenset(n for n, first, last in spans if last == end and n not in saved)
    pos = {n.name: k for k, n in enumerate(order)}
    first_reader: dict[str, int] = {}
    roots = alias_roots(graph)
    for node, tin, idx, saves_output in _saves(graph):
        for name in [r for k in idx for r in roots[tin[k][1]]] + (sorted(roots[node.name]) if saves_output else []):
            first_reader[name] = min(first_reader.get(name, pos[node.name]), pos[node.name])
    grad = needs_grad(graph)
    points = {}
    for node in order:
        if node.op != "call_function" or is_view(node.target) or node.name not in grad \
                or fused_cross_entropy(graph, node):  # (its gradient made in place of what it keeps)
            continue
        grads = tuple(j for j, i in enumerate(node.inputs)
                      if i in grad and str(graph.nodes[i].role) not in STATIC_ROLES)
        if grads:
            points[node.name] = grads
    return order, first_reader, returned, points


def step_peak(graph) -> StepPeak:
    """The step's activation peak on the replicated timeline (a plan splits most activations
    alike, so the peak stays where it is): the forward's (``activation_timeline``), or an op's
    backward where that holds more. An op's backward runs beside the saved values it or an earlier
    op reads (those only later ops read were freed by their backward), the values the model
    returns, its output's gradient, the gradients it makes for its inputs and its backward's
    workspace: ATen's cross entropy makes two gradients as large as its logits while every
    activation is still saved (the fused one, ``ir.losses.fused_cross_entropy``, none)."""
    from autopar.sharding_spec.mesh import Mesh

    one = Mesh((1,))
    timeline = activation_timeline(graph, None, one)
    if not timeline:
        return StepPeak()
    t = max(range(len(timeline)), key=lambda k: timeline[k][1])
    saved = saved_for_backward(graph)
    order, spans = _lifetimes(graph)
    best = timeline[t][1]
    peak = StepPeak(timeline[t][0], frozenset(n for n, first, end in spans if first <= t <= end and n not in saved))
    returned = _backward_walk(graph)[2]  # (held by the caller through backward)
    for node, grads, total in _backward_totals(graph, one):
        if total > best:
            best, peak = total, StepPeak(node.name, returned, backward=True, grads=grads)
    return peak


def plan_backward_peak(graph, mesh, out_specs: Mapping, in_specs: Mapping, held_for: Mapping, released,
                       reshard_backward: Mapping) -> int:
    """The most live activation bytes in any op's backward under a plan: ``step_peak``'s walk with
    the plan's local sizes (``out_specs``: {value: its output spec}; ``in_specs``: {op: the specs
    its strategy reads}), the reshard copies kept for each op's backward (``held_for``: {op:
    bytes}), without the saved values that are ``released`` (``released_by_reshards``), and beside
    an op's backward what the backward of the reshards on the reads it makes gradients for holds
    (``reshard_backward``: {(op, position): bytes}, ``reshard_backward_bytes``). Where a plan
    gathers a gradient whole in backward, the peak moves there, off the replicated timeline's."""
    return max((total for _, _, total in _backward_totals(graph, mesh, out_specs, in_specs, held_for, released,
                                                          reshard_backward)), default=0)


def _backward_totals(graph, mesh, out_specs: Mapping | None = None, in_specs: Mapping | None = None,
                     held_for: Mapping | None = None, released=frozenset(), reshard_backward: Mapping | None = None):
    """(op, the positions whose gradients its backward makes, the live bytes while it runs) for
    every op whose backward makes any (``plan_backward_peak``'s arguments; none given: the
    replicated timeline ``step_peak`` reads)."""
    out_specs, in_specs = out_specs or {}, in_specs or {}
    held_for, reshard_backward = held_for or {}, reshard_backward or {}
    order, first_reader, returned, points = _backward_walk(graph)
    pos = {n.name: k for k, n in enumerate(order)}
    kept_from = [0] * len(order)  # bytes of the saved values whose first reader is at each position
    for name in saved_for_backward(graph) - set(released):
        kept_from[first_reader[name]] += local_nbytes(graph.nodes[name].meta, _output_spec(out_specs.get(name)), mesh)
    for name, nbytes in held_for.items():
        kept_from[pos[name]] += nbytes
    held = sum(local_nbytes(graph.nodes[n].meta, _output_spec(out_specs.get(n)), mesh) for n in returned)
    kept = 0
    for k, node in enumerate(order):
        kept += kept_from[k]
        grads = points.get(node.name)
        if grads is None:
            continue
        metas = [graph.nodes[i].meta if i in graph.nodes else None for i in node.inputs]
        yield node, grads, (kept + held + _backward_bytes(node, metas, in_specs.get(node.name, ()),
                                                          _output_spec(out_specs.get(node.name)), grads, mesh)
                            + sum(reshard_backward.get((node.name, j), 0) for j in grads))


class _RouteStep(NamedTuple):
    """A step as the byte counts read it (``spec_after``'s fields)."""

    kind: str
    axes: tuple
    src_dim: int | None
    dst_dim: int | None


# The steps' duals in backward (``codegen.collectives``): (kind, src_dim, dst_dim) of the step that
# turns the gradient of a step's output into that of its input; a slice or gather over axes whose
# gradients are whole (``identical``) chunks locally, a slice elsewhere pads with zeros.
def _dual(step, identical) -> tuple[str, int | None, int | None]:
    whole = set(step.axes) <= set(identical)
    if step.kind == "all_gather":
        return ("local", None, None) if whole else ("reduce_scatter", None, step.src_dim)
    if step.kind == "reduce_scatter":
        return ("all_gather", step.dst_dim, None)
    if step.kind == "all_to_all":
        return ("all_to_all", step.dst_dim, step.src_dim)
    if step.kind == "slice":
        return ("all_gather", step.dst_dim, None) if whole else ("local", None, None)
    return (step.kind, None, None)


def step_buffer_bytes(kind: str, src_dim, dst_dim, in_bytes: int, out_bytes: int) -> int:
    """What a collective holds beside its input and its result while it runs
    (``codegen.collectives``): an all_gather of a dim other than the leading one packs its input
    and receives into a buffer it concatenates from; an all_to_all packs what it sends unless that
    is split on the leading dim, and receives into a buffer unless the pieces land on it; a
    reduce_scatter copies its input and, off the leading dim, receives into a buffer."""
    if kind == "all_gather":
        return 0 if src_dim == 0 else in_bytes + out_bytes
    if kind == "all_to_all":
        return (in_bytes if dst_dim != 0 else 0) + (in_bytes if src_dim != 0 else 0)
    if kind == "reduce_scatter":
        return in_bytes + (out_bytes if dst_dim != 0 else 0)
    return 0


def reshard_backward_bytes(steps, src_spec, mesh, itemsize: int, identical=()) -> int:
    """What the backward of a reshard (``steps`` from ``src_spec``) holds beside the gradient it
    is handed, at its largest: each step's dual makes the gradient of the step's input, with its
    collective's buffers, while the gradient it turns (the handed one excepted) is alive."""
    return _reshard_backward_of(_route_key(steps), src_spec, mesh, itemsize, tuple(sorted(identical)))


@functools.lru_cache(maxsize=65536)
def _reshard_backward_of(route, src_spec, mesh, itemsize: int, identical: tuple) -> int:
    steps = [_RouteStep(*r) for r in route]
    sizes = _route_sizes(steps, src_spec, mesh, itemsize)
    best = 0
    for k in reversed(range(len(steps))):
        kind, src_dim, dst_dim = _dual(steps[k], identical)
        turned, made = sizes[k + 1], sizes[k]
        buffers = step_buffer_bytes(kind, src_dim, dst_dim, turned, made)
        best = max(best, (turned if k < len(steps) - 1 else 0) + made + buffers)
    return best


def activation_memory(graph, specs: Mapping | None, mesh) -> int:
    """Peak live activation bytes on one device over the forward pass (see the module docstring)."""
    return max((b for _, b in activation_timeline(graph, specs, mesh)), default=0)


def _output_spec(spec):
    """A Strategy's output spec, or the spec itself."""
    return spec.output if hasattr(spec, "output") and hasattr(spec, "compute_fraction") else spec
