"""From a traced graph to the ILP: candidate strategies per node, their costs, the edge matrices.

Placeholders get strategies too. A parameter's strategy is its *storage*: replicated, split (read
as split by a tensor-parallel consumer, or gathered before use = FSDP/ZeRO-3), and, where it is
replicated over active axes, a ZeRO-2 variant that shards its gradient and optimizer states over
those axes. User inputs may be split for free (every rank holds the full batch and slices it).
The output node reads every returned tensor whole, but for those training does not read
(``returned_spec``).

Gradients follow the dual-layout convention (autopar/codegen/collectives.py) on every axis but
the problem's ``identical`` ones (``record.gradients``): a tensor replicated over a dual axis gets
a pending-sum gradient there, so every parameter stored replicated over it pays one all-reduce
of its gradient per step over those axes, and every resharding edge on the gradient path pays its
dual in backward. On an identical axis a value's gradient is whole: an op that splits the axis
reading a value replicated there sums that value's gradient at once (one all-reduce per value,
spec and axes: a once-paid cost, or per read where a reshard comes between), and a parameter
replicated there syncs nothing over it, unless it keeps its gradient pending there (a choice of
its own, allowed only where every read splits the axis with no step over it).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from autopar.cost_model import compute as compute_model
from autopar.cost_model import memory as memory_model
from autopar.cost_model.comm import layout_copy_time, mesh_collective_time, packed_gather_bytes
from autopar.cost_model.lowered import lowered_comm_s
from autopar.cost_model.ops import alias_roots
from autopar.cost_model.grad_sync import grad_bytes_total, sync_price, zero2_pool_bytes
from autopar.cost_model.step import accumulate_s, local_steps_s, optimizer_s
from autopar.ir.aliasing import in_place_reads
from autopar.ir.graph import NodeRef, Role, edge_itemsize, needs_grad, runs_backward
from autopar.ir.losses import counted_from_inputs, unread_outputs
from autopar.record.buckets import DEFAULT_BUCKET_BYTES, zero2_saved_bytes
from autopar.record.gathers import grouped_route
from autopar.record.gradients import loss_class_axes, output_whole_axes, partial_read_axes, partly_whole, whole_on
from autopar.record.grad_sync import ZERO2_SUMS, GradSync
from autopar.sharding_spec.reshard import local_bytes
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.rules import strategies_for
from autopar.sharding_spec.strategy import ZERO2, Family, OpContext, Strategy, active_axes, enumerate_specs, needs_lowering, rep
from autopar.solver.ilp import OnceCost, Problem
from autopar.solver.plan import EdgePlan, StepPlan
from autopar.solver.reshard_search import plan_reshard, reshard_costs_from


@dataclasses.dataclass
class NodeChoices:
    """A node's candidates and what each costs. ``grad_sync[i]``: the ``GradSync`` a parameter
    storage choice implies, or None; ``accumulate_s[i]``: the part
    of ``compute_s[i]`` a parameter pays per run of the graph to add its gradient up (the rest, its
    optimizer share, once per step)."""

    name: str
    strategies: list[Strategy]
    compute_s: np.ndarray
    comm_s: np.ndarray
    memory: np.ndarray
    grad_sync: list
    accumulate_s: np.ndarray | None = None
    peak_memory: np.ndarray | None = None  # the part of ``memory`` held only at the step's peak
    # a parameter's gradient sync priced per choice (``cost_model.grad_sync.SyncPrice``, or None)
    sync_prices: list | None = None

    def sync_part(self, field: str, step_share: float) -> np.ndarray | None:
        """Seconds per run of each choice's ``SyncPrice`` ``field`` (None where none syncs)."""
        if not self.sync_prices or all(p is None for p in self.sync_prices):
            return None
        return np.asarray([getattr(p, field) * step_share if p is not None else 0.0 for p in self.sync_prices], float)


@dataclasses.dataclass
class Overlap:
    """Gradient syncs hidden behind backward, as the step model prices them: a step exposes
    max(its last bucket, sync - comm_overlap x backward compute) of its syncs
    (``cost_model.step``). Per node, per choice, in seconds per run of the graph: ``sync`` (a
    parameter's part of the sums: ``SyncPrice.sum_s``), ``spread`` (its part in the last bucket:
    ``floor_s``) and ``cover`` (``comm_overlap`` x an op's backward compute). The groups' first
    calls (once-paid costs of the problem) are in both the sync and the last bucket, so they are
    never hidden. The syncs cost the last bucket + max(0, sync - last bucket - cover):
    ``intra_op._solve_overlapped``."""

    sync: dict[str, np.ndarray]
    cover: dict[str, np.ndarray]
    spread: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # each group's first sum (seconds per run, the choices that sync in it), for ``last_bucket``
    floors: list[tuple[float, list[tuple[str, np.ndarray]]]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, graph, choices: dict[str, NodeChoices], grad, mesh, step_share: float = 1.0) -> "Overlap | None":
        """None where nothing overlaps (``comm_overlap`` 0, or no gradient sync). The sync runs
        once a step, beside the backward of its last run (``step_share`` of a step)."""
        cluster = mesh.resolved_cluster()
        sync = {v: a for v, c in choices.items() if (a := c.sync_part("sum_s", step_share)) is not None and a.any()}
        if not cluster.comm_overlap or not sync:
            return None
        cover = {}
        for v, c in choices.items():
            node = graph.nodes[v]
            if node.op == "call_function" and runs_backward(node, grad):
                cover[v] = cluster.comm_overlap * step_share * c.compute_s * 2 / 3  # forward + 2x backward
        spread = {v: choices[v].sync_part("floor_s", step_share) for v in sync}
        return cls(sync, cover, spread, _sync_groups(choices, lambda p: p.latency_s * step_share))

    def total(self, part: dict, pick: dict[str, int]) -> float:
        """Seconds per run of ``part`` (``sync``, ``cover`` or ``spread``) under an assignment."""
        return sum(float(a[pick[v]]) for v, a in part.items())

    def last_bucket(self, pick: dict[str, int]) -> float:
        """Seconds per run of the syncs backward never hides under an assignment: the first sum
        of every group it syncs in and its parts of the last bucket."""
        return sum(s for s, members in self.floors if any(m[pick[v]] for v, m in members)) + self.total(self.spread, pick)


def sync_group_costs(choices: dict[str, NodeChoices], step_share: float = 1.0) -> list[OnceCost]:
    """The first calls of each group of gradient syncs (``cost_model.grad_sync``), paid once per
    run's share of a step when any parameter's choice syncs in the group."""
    groups = _sync_groups(choices, lambda p: (p.latency_s + p.after_latency_s) * step_share)
    return [OnceCost(seconds, [(v, v, m) for v, m in members]) for seconds, members in groups if seconds]


def _sync_groups(choices: dict[str, NodeChoices], seconds_of) -> list[tuple[float, list[tuple[str, np.ndarray]]]]:
    """Per group of gradient syncs (``SyncPrice.group``): (``seconds_of`` its price, the choices of
    each node that sync in it)."""
    groups: dict = {}
    for v, c in choices.items():
        for i, p in enumerate(c.sync_prices or ()):
            if p is not None:
                group = groups.setdefault(p.group, [seconds_of(p), {}])
                group[1].setdefault(v, np.zeros(len(c.strategies), bool))[i] = True
    return [(seconds, list(members.items())) for seconds, members in groups.values()]


@dataclasses.dataclass
class Built:
    problem: Problem
    choices: dict[str, NodeChoices]
    # (producer, consumer, input position) for every tensor edge
    edge_list: list[tuple[str, str, int]]
    requires_grad: set[str]
    identical: tuple = ()  # the axes gradients are whole on (``record.gradients``)
    most: float = math.inf  # the memory of every node's most memory-hungry choice together
    # (costs variant, block period) -> a lower bound of the objective of any assignment, from the
    # unbudgeted solves: shared by every ``with_budget`` copy, since a budget only removes
    # assignments (``intra_op._solve_tied`` skips a budgeted solve its cutoff rules out)
    lower_bounds: dict = dataclasses.field(default_factory=dict)

    def with_budget(self, memory_budget: float | None) -> "Built":
        """This problem under another memory budget (a copy; the choices and prices shared). A
        budget no assignment can exceed constrains nothing, and would only keep the simplifier
        from folding nodes whose memory varies."""
        budget = None if memory_budget is not None and self.most <= memory_budget else memory_budget
        return dataclasses.replace(self, problem=dataclasses.replace(self.problem, budget=budget, tie={}))


def _param_choices(node, mesh, optimizer: str, optimizer_sharding: bool = True,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, total_bytes: float | None = None, step_share: float = 1.0,
                   precision=None, identical=()) -> tuple[list[Strategy], list, list, list, list, list, list]:
    """A parameter's storage choices: (strategies, seconds per run of the graph, sync seconds per
    run, memory, sync, accumulation seconds per run, the sync's price: ``SyncPrice``). A run pays
    ``step_share`` of what the parameter pays once per step (its optimizer, its gradient sync) and
    all of adding its gradient up (``accumulate_s``, also part of the first list). The gradient
    sync is priced as the runtime's reducer runs it (``cost_model.grad_sync``: ``total_bytes``,
    the model's gradient bytes as summed, fill the buckets); its group's first calls are paid once
    per group (``build_problem``). ZeRO-2 adds the all-gather of the updated parameter, in the
    same buckets. Under a ``precision``, gradients are summed in its reduction dtype and ZeRO-2
    gathers the working copy (``runtime.reducer``). On ``identical`` axes it is replicated on, the
    gradient is whole (no sync there) or, a choice each, left pending for the sync."""
    meta = node.meta
    itemsize = meta.itemsize
    grad_scale = precision.reduce_dtype.itemsize / itemsize if precision is not None else 1.0
    total_bytes = total_bytes or meta.nbytes * grad_scale
    act = active_axes(mesh)
    cluster = mesh.resolved_cluster()
    strategies, opt, costs, mems, syncs, acc, prices = [], [], [], [], [], [], []

    def priced(sync, local):
        return sync_price(sync, local, meta.dtype, mesh, total_bytes=total_bytes, bucket_bytes=bucket_bytes)

    for spec, repl in _sync_axes_choices(meta.shape, mesh, act, identical):
        local = local_bytes(spec, mesh.shape, itemsize)
        family = Family.of("replicated" if spec.is_replicated else "sharded")
        grad = local * grad_scale
        sync = GradSync.all_reduce(repl, grad) if repl else None
        price = priced(sync, local) if sync is not None else None
        strategies.append(Strategy((), spec, family, 1.0))
        opt.append(optimizer_s(local / itemsize, 1, cluster))
        costs.append(price.per_tensor_s if price is not None else 0.0)
        prices.append(price)
        mems.append(memory_model.param_memory(meta, spec, mesh, optimizer=optimizer, precision=precision))
        syncs.append(sync)
        acc.append(accumulate_s(grad, sync is not None, step_share, cluster))
        if repl and optimizer_sharding:
            # ZeRO-2: sum and split the gradient (a reduce-scatter, an all-reduce keeping this rank's
            # chunk or an all-to-all and a sum: the cheapest, its group's first calls at this
            # gradient's share of the model's), update a shard, all-gather the new parameter.
            ways = math.prod(mesh.shape[a] for a in repl)
            options = [(priced(GradSync.zero2(k, repl, grad), local), k) for k in ZERO2_SUMS]
            price, sum_by = min(options, key=lambda o: o[0].per_tensor_s
                                + (o[0].latency_s + o[0].after_latency_s) * min(1.0, grad / total_bytes))  # the first on a tie
            strategies.append(Strategy((), spec, Family.of(ZERO2) if spec.is_replicated else Family.of("sharded", ZERO2), 1.0))
            opt.append(optimizer_s(local / itemsize / ways, 1, cluster))
            costs.append(price.per_tensor_s)
            prices.append(price)
            # the rank's ZeRO-2 gradients are not known here: its pool share as if all were, split as this one;
            # a step of several microbatches holds the whole gradient in its bucket instead (the pool's buffers)
            accumulated = step_share < 1.0
            mems.append(memory_model.param_memory(meta, spec, mesh, optimizer=optimizer, opt_state_sharded_axes=repl,
                                                  precision=precision, accumulated=accumulated)
                        + (0.0 if accumulated else
                           zero2_pool_bytes(grad, sum_by, total_bytes, zero2_saved_bytes([(total_bytes, ways)]), bucket_bytes)))
            syncs.append(GradSync.zero2(sum_by, repl, grad))
            acc.append(accumulate_s(grad, True, step_share, cluster))
    comp = [o * step_share + a for o, a in zip(opt, acc)]
    return strategies, comp, [c * step_share for c in costs], mems, syncs, acc, prices


def _sync_axes_choices(shape, mesh, act, identical):
    """(storage spec, the axes its gradient is synced over) per parameter choice: the active axes
    it is replicated on, less the ``identical`` ones, plus any subset of those (left pending)."""
    for spec in enumerate_specs(shape, mesh):
        repl = [a for a in act if a not in spec.used_axes]
        dual = tuple(a for a in repl if a not in identical)
        whole = [a for a in repl if a in identical]
        for k in range(len(whole) + 1):
            for pending in itertools.combinations(whole, k):
                yield spec, tuple(sorted(dual + pending))


def node_choices(graph, mesh, *, optimizer: str = "adamw", op_table=None, optimizer_sharding: bool = True,
                 force=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, step_share: float = 1.0,
                 precision=None, identical=()) -> dict[str, NodeChoices]:
    """Candidates of every node. ``optimizer_sharding=False`` drops the ZeRO-2 parameter choices.
    ``identical``: the mesh axes gradients are whole on (``record.gradients``); an op's strategy
    that needs them mixed with dual axes (a vocabulary-parallel loss over both) is dropped.
    ``precision``: the ``MixedPrecision`` the graph (traced in its working dtype) runs under.
    ``step_share``: the share of a step one run of the graph is (1 / microbatches when a step runs
    it on several microbatches): what a parameter pays once per step (gradient sync, optimizer) is
    priced at that share.
    ``force``: node name -> family label (or a predicate on a Strategy) restricting that node's
    candidates (see ``restrict``)."""
    saved = memory_model.saved_for_backward(graph)
    peak = memory_model.step_peak(graph)
    total = grad_bytes_total(graph, precision)
    out = {}
    memo: dict = {}  # repeated blocks repeat nodes: enumerate and price each kind once
    for node in graph.nodes.values():
        sig = _signature(node, graph, saved, peak)
        if sig is not None and sig in memo:
            out[node.name] = dataclasses.replace(memo[sig], name=node.name)
            continue
        syncs = acc = peak_mem = prices = None
        if node.op == "placeholder" and node.role == Role.PARAMETER:
            strategies, comp, comm, mem, syncs, acc, prices = _param_choices(
                node, mesh, optimizer, optimizer_sharding, bucket_bytes, total, step_share, precision, identical)
        elif node.op == "placeholder":
            strategies = [Strategy((), spec, "input" if node.role == Role.INPUT else "buffer", 1.0) for spec in _placeholder_specs(node, mesh)]
            comp = [0.0] * len(strategies)
            comm = [0.0] * len(strategies)
            # the caller hands every rank a user input whole and holds it: its shard is no saving
            mem = [0 if s.output is None else
                   node.meta.numel * node.meta.itemsize if node.role == Role.INPUT else
                   local_bytes(s.output, mesh.shape, node.meta.itemsize) for s in strategies]
        elif node.op == "output":
            ins = tuple(rep(graph.nodes[i].meta.shape, mesh) if _is_tensor(graph.nodes[i].meta) else None for i in node.inputs)
            strategies = [Strategy(ins, None, "output", 1.0)]
            comp, comm, mem = [0.0], [0.0], [0.0]
        else:
            ctx = OpContext(node, mesh, [graph.nodes[i].meta for i in node.inputs], graph)
            # (a vocabulary-parallel loss needs its class axes all identical or all dual)
            strategies = [s for s in strategies_for(ctx) if not partly_whole(loss_class_axes(s), identical)]
            comp = [sum(compute_model.node_time(node, s, graph, mesh, op_table)) for s in strategies]
            counted = counted_from_inputs(graph, node)
            size = getattr(node.meta, "itemsize", 4)
            comm = [lowered_comm_s(node.target, s.family, s.inputs, s.output, mesh, counted_locally=counted,
                                   compute_s=c, value_itemsize=size, identical=identical)
                    if needs_lowering(s.family) else 0.0 for s, c in zip(strategies, comp)]
            mem = [memory_model.node_activation_bytes(node, s, mesh, saved, peak, ctx.input_metas) for s in strategies]
            if node.name in peak.live or node.name == peak.node:
                peak_mem = np.asarray([memory_model.node_peak_bytes(node, s, mesh, saved, peak, ctx.input_metas)
                                       for s in strategies], float)
        n = len(strategies)
        out[node.name] = NodeChoices(
            node.name, strategies, np.asarray(comp, float), np.asarray(comm, float), np.asarray(mem, float),
            syncs if syncs is not None else [None] * n, None if acc is None else np.asarray(acc, float), peak_mem,
            prices,
        )
        if sig is not None:
            memo[sig] = out[node.name]
    for name, want in (force or {}).items():
        out[name] = restrict(out, name, want)
    return out


def _signature(node, graph, saved, peak):
    """What a node's candidates and their prices depend on; None where nodes must not share."""
    if node.op == "output":
        return None

    def norm(x):
        if isinstance(x, NodeRef):
            return ("ref", graph.nodes[x.name].meta)
        if isinstance(x, (list, tuple)):
            return tuple(norm(y) for y in x)
        if isinstance(x, dict):
            return tuple(sorted((k, norm(v)) for k, v in x.items()))
        return repr(x)

    if node.op == "placeholder":
        return ("placeholder", node.role, node.meta)
    return (
        node.op, node.target, node.meta, node.flops, node.name in saved, node.name in peak.live, node.name == peak.node,
        norm(node.args), norm(node.kwargs), tuple(compute_model.grad_mask(node, graph)),
    )


def restrict(choices: dict[str, NodeChoices], name: str, want) -> NodeChoices:
    """``choices[name]`` keeping only the strategies whose family is ``want`` (a string) or that
    ``want(strategy)`` accepts (a callable). ConfigError when none is left."""
    from autopar.errors import ConfigError

    if name not in choices:
        raise ConfigError(f"force names node {name!r}, which is not in the graph; node names are the traced fx names")
    c = choices[name]
    keep = [i for i, s in enumerate(c.strategies) if (want(s) if callable(want) else s.family == want)]
    if not keep:
        families = sorted({s.family for s in c.strategies})
        why = getattr(want, "why_not", "")
        if why:
            raise ConfigError(f"{want} cannot be run: {why}")
        raise ConfigError(f"force: node {name!r} has no strategy of family {want!r}; its families are {families}")
    return NodeChoices(
        c.name, [c.strategies[i] for i in keep], c.compute_s[keep], c.comm_s[keep], c.memory[keep], [c.grad_sync[i] for i in keep],
        None if c.accumulate_s is None else c.accumulate_s[keep], None if c.peak_memory is None else c.peak_memory[keep],
        None if c.sync_prices is None else [c.sync_prices[i] for i in keep],
    )


def _is_tensor(meta) -> bool:
    return meta is not None and not isinstance(meta, tuple)


def _placeholder_specs(node, mesh) -> list[ShardingSpec]:
    if not _is_tensor(node.meta):
        return [None]
    if node.role == Role.INPUT:
        return enumerate_specs(node.meta.shape, mesh)
    return enumerate_specs(node.meta.shape, mesh) if node.role == Role.BUFFER else [rep(node.meta.shape, mesh)]


def produced_spec(strategy: Strategy, consumer, position: int, graph):
    """The spec the producer hands to ``consumer``'s input ``position`` (a tuple output is
    indexed by the consumer's getitem index)."""
    out = strategy.output
    if isinstance(out, tuple):
        if consumer.target == "operator.getitem":
            return out[consumer.args[1]]
        return None
    return out


def _pair_specs(graph, prod: NodeChoices, cons: NodeChoices, position: int) -> tuple[list, list]:
    """(the spec each producer strategy hands the consumer's input ``position``, the spec each
    consumer strategy reads there; None where it reads none)."""
    consumer = graph.nodes[cons.name]
    return ([produced_spec(ps, consumer, position, graph) for ps in prod.strategies],
            [cs.inputs[position] if position < len(cs.inputs) else None for cs in cons.strategies])


def edge_matrix(graph, prod: NodeChoices, cons: NodeChoices, position: int, mesh, with_backward: bool,
                in_place: bool = False, identical=()) -> np.ndarray:
    """Seconds of every (producer strategy, consumer strategy) pair's reshard (and its backward
    dual). ``in_place``: the consumer writes into the value, or views it on the way to a write
    (``ir.aliasing``): a reshard would write into a copy, so only pairs that read the producer's
    spec itself are allowed."""
    consumer = graph.nodes[cons.name]
    itemsize = edge_itemsize(graph.nodes[prod.name].meta, consumer)
    table = _reshard_table(graph, prod, cons, position, mesh, itemsize, with_backward, identical)
    if in_place:
        srcs, dsts = _pair_specs(graph, prod, cons, position)
        same = np.array([[d is None or s == d for d in dsts] for s in srcs], dtype=bool)
        table = np.where(same, table, np.inf)
    return table


def gather_masks(graph, prod: NodeChoices, cons: NodeChoices, position: int, mesh, with_backward: bool = False,
                 identical=()) -> dict[tuple, tuple]:
    """Mesh axes -> (mask, bytes, seconds): the (producer strategy, consumer strategy) pairs whose
    reshard is one all-gather over those axes with local steps around it, its bytes, and the local
    steps' seconds (forward and the backward the step model prices: ``cost_model.step.local_steps_s``):
    a parameter stored split and read whole, which the runtime gathers in one call with the rest
    of its layer's (``record.gathers.param_gather_groups``)."""
    consumer = graph.nodes[cons.name]
    itemsize = edge_itemsize(graph.nodes[prod.name].meta, consumer)
    srcs, dsts = _pair_specs(graph, prod, cons, position)
    src_ids, src_keys = _index(srcs)
    dst_ids, dst_keys = _index(dsts)
    axes_of = np.full((len(src_keys), len(dst_keys)), None, dtype=object)
    nbytes = np.zeros((len(src_keys), len(dst_keys)))
    local = np.zeros((len(src_keys), len(dst_keys)))
    for a, src in enumerate(src_keys):
        for b, dst in enumerate(dst_keys):
            if src is None or dst is None or src == dst or not src.is_even(mesh.shape):
                continue
            route = plan_reshard(src, dst, mesh, itemsize, with_backward=with_backward, identical=identical)
            at = grouped_route(route.steps)
            if at is not None:
                gather = route.steps[at[0]]
                axes_of[a, b], nbytes[a, b] = tuple(gather.axes), gather.nbytes
                local[a, b] = local_steps_s([route.steps[j] for j in at[1]], [route.costs[j] for j in at[1]],
                                            with_backward, mesh, identical)
    pick = np.ix_(src_ids, dst_ids)
    axes_of, nbytes, local = axes_of[pick], nbytes[pick], local[pick]
    out = {}
    for axes in {x for x in axes_of.flat if x is not None}:
        mask = np.array([[x == axes for x in row] for row in axes_of], dtype=bool).reshape(axes_of.shape)
        out[axes] = (mask, np.where(mask, nbytes, 0.0), np.where(mask, local, 0.0))
    return out


def held_matrix(graph, prod: NodeChoices, cons: NodeChoices, position: int, mesh, static: bool) -> np.ndarray:
    """Bytes each (producer strategy, consumer strategy) pair's reshard keeps alive until backward,
    on an edge whose value the consumer's backward keeps (``memory.held_reshard_bytes``)."""
    consumer = graph.nodes[cons.name]
    itemsize = edge_itemsize(graph.nodes[prod.name].meta, consumer)
    srcs, dsts = _pair_specs(graph, prod, cons, position)
    src_ids, src_keys = _index(srcs)  # many strategies share specs: each distinct pair once
    dst_ids, dst_keys = _index(dsts)
    table = np.array([[memory_model.held_reshard_bytes(static, a, b, mesh, itemsize) for b in dst_keys] for a in src_keys],
                     dtype=float).reshape(len(src_keys), len(dst_keys))
    return table[np.ix_(src_ids, dst_ids)]


def returned_spec(graph, output: str, position: int, made):
    """The spec output ``position`` is returned in when its producer makes ``made``: whole where
    training reads it; else as made, pending sums summed (``ir.losses.unread_outputs``: a language
    model's logits stay split over the batch, and a call gathers them only when they are read,
    ``autopar.runtime.outputs``). A returned parameter or input is always whole."""
    if made is None:
        return None
    src = graph.nodes[graph.nodes[output].inputs[position]]
    if src.op == "placeholder" or position not in unread_outputs(graph):
        return ShardingSpec.replicate(made.shape, made.mesh_ndim)
    return made.resolved()


def _reshard_table(graph, prod, cons, position, mesh, itemsize: int, with_backward: bool, identical=()) -> np.ndarray:
    """Seconds of every (producer strategy, consumer strategy) pair's reshard, and with
    ``with_backward`` of its route's backward as the step model prices it (the route cheapest
    both ways: ``reshard_search``)."""
    consumer = graph.nodes[cons.name]
    if consumer.op == "output":  # one strategy; what it reads depends on what is made (no backward: seeded whole)
        made = [produced_spec(ps, consumer, position, graph) for ps in prod.strategies]
        ids, keys = _index(made)
        col = [0.0 if m is None else reshard_costs_from(m, [returned_spec(graph, cons.name, position, m)], mesh, itemsize)[0]
               for m in keys]
        return np.asarray(col, float)[ids][:, None]
    # Many strategies share specs: price each distinct (source, target) pair once.
    srcs, dsts = _pair_specs(graph, prod, cons, position)
    src_ids, src_keys = _index(srcs)
    dst_ids, dst_keys = _index(dsts)
    table = np.zeros((len(src_keys), len(dst_keys)))
    real = [b for b, d in enumerate(dst_keys) if d is not None]
    for a, src in enumerate(src_keys):
        if src is not None and real:
            table[a, real] = reshard_costs_from(src, [dst_keys[b] for b in real], mesh, itemsize,
                                                with_backward=with_backward, identical=identical)
    return table[np.ix_(src_ids, dst_ids)]


def _index(items):
    keys: dict = {}
    ids = [keys.setdefault(x, len(keys)) for x in items]
    return np.asarray(ids, dtype=int), list(keys)


def build_problem(graph, mesh, *, memory_budget=None, optimizer: str = "adamw", op_table=None, choices=None,
                  memo: dict | None = None, step_share: float = 1.0, identical=()) -> Built:
    """The ILP of ``graph`` on ``mesh``. A split-stored parameter read whole is gathered with the
    rest of its layer's in one call (``cost_model.step.param_gather_groups``), once for every op of
    the layer that reads it whole: its bytes are a cost paid once per (parameter, layer, axes) when
    any of its reads gathers it, and the call's latency once per (layer, axes) whichever of the
    layer's parameters are gathered (``ilp.OnceCost``). Gradients are whole on the ``identical``
    axes (``choices`` must be priced for them too), a value's sums there paid once per (value, spec,
    axes) where no reshard comes between. ``memo``: edge matrices already priced for the same
    ``choices``."""
    identical = tuple(sorted(identical))
    choices = choices or node_choices(graph, mesh, optimizer=optimizer, op_table=op_table, identical=identical)
    grad = needs_grad(graph)
    edges: dict[tuple[str, str], np.ndarray] = {}
    edge_list = []
    # Nodes with equal signatures share one candidate list (node_choices' memo): their edges share
    # one matrix too. Key on those lists' identities, the input position and what decides the rest.
    memo = {} if memo is None else memo
    in_place = in_place_reads(graph)
    kept = memory_model.saved_inputs(graph)
    roots = alias_roots(graph)
    held: dict[tuple[str, str], np.ndarray] = {}
    calls: dict[tuple, list] = {}  # (consumer's layer, axes) -> [latency s, members]
    gathers_of: dict[tuple, list] = {}  # (parameter, layer, axes, bytes, backward) -> [seconds, members]
    sums: dict[tuple, list] = {}  # (value, spec, axes) -> [seconds, members]: its gradient summed once
    for node in graph.nodes.values():
        for pos, src in enumerate(node.inputs):
            if src not in choices:
                continue
            prod, cons = choices[src], choices[node.name]
            p = graph.nodes[src]
            param = p.op == "placeholder" and p.role == Role.PARAMETER
            # an output's steps (gathers and all-reduces) have a local backward: its seed is whole
            # on every rank (cost_model.gradients.output_whole_axes)
            backward = src in grad and node.op != "output"
            aliased = (node.name, pos) in in_place
            key = (id(prod.strategies), id(cons.strategies), pos, backward,
                   node.args[1] if node.target == "operator.getitem" else None,
                   edge_itemsize(graph.nodes[src].meta, node), aliased, param, identical)
            if key not in memo:
                memo[key] = _edge_prices(graph, prod, cons, pos, mesh, backward, aliased, param, identical)
            mat, gathers, once_sums = memo[key]
            for (spec, axes), (seconds, mask) in once_sums.items():
                sums.setdefault((src, spec, axes), [seconds, []])[1].append((src, node.name, mask))
            for axes, (mask, latency, by_bytes) in gathers.items():
                call = calls.setdefault((node.layer, axes), [0.0, []])
                call[0] = max(call[0], latency)
                call[1].append((src, node.name, mask))
                for nbytes, (sub, seconds) in by_bytes.items():
                    gathers_of.setdefault((src, node.layer, axes, nbytes, backward), [seconds, []])[1].append(
                        (src, node.name, sub))
            edge_list.append((src, node.name, pos))
            key = (src, node.name)
            edges[key] = edges[key] + mat if key in edges else mat
            if (node.name, pos) in kept:
                static = all(str(graph.nodes[r].role) in memory_model.STATIC_ROLES for r in roots[src])
                hkey = ("held", id(prod.strategies), id(cons.strategies), pos, static, edge_itemsize(graph.nodes[src].meta, node),
                        node.args[1] if node.target == "operator.getitem" else None)
                if hkey not in memo:
                    memo[hkey] = held_matrix(graph, prod, cons, pos, mesh, static)
                if memo[hkey].any():
                    held[key] = held[key] + memo[hkey] if key in held else memo[hkey]
    most = (sum(float(np.max(c.memory)) for c in choices.values() if len(c.memory))
            + sum(float(np.max(m)) for m in held.values()))
    problem = Problem(
        costs={v: c.compute_s + c.comm_s for v, c in choices.items()},
        memory={v: c.memory for v, c in choices.items()},
        edges=edges,
        edge_memory=held,
        once=[OnceCost(latency, members) for latency, members in calls.values()]
        + [OnceCost(seconds, members) for seconds, members in gathers_of.values()]
        + [OnceCost(seconds, members) for seconds, members in sums.values()]
        + sync_group_costs(choices, step_share),
    )
    return Built(problem, choices, edge_list, grad, identical, most).with_budget(memory_budget)


def _edge_prices(graph, prod, cons, pos, mesh, backward: bool, in_place: bool, param: bool, identical=()):
    """(the edge's matrix, axes -> (mask, latency s, bytes -> (mask, seconds)) of its pairs that
    gather a parameter in its layer's call, (spec, axes) -> (seconds, mask) of its pairs whose
    read sums the value's gradient over identical axes with no reshard between: ``_grad_sums``).
    A gathering pair costs its local steps on the edge: the group's latency and the parameter's bytes are
    once-paid costs (``build_problem``), priced as the step model prices a group
    (``cost_model.step.reshard_s``: an all-gather and, with a backward off the identical axes, a
    reduce-scatter, each with its packing copies). Other reshards of a parameter run per reading
    edge, at their full price."""
    mat = edge_matrix(graph, prod, cons, pos, mesh, with_backward=backward, in_place=in_place, identical=identical)
    sums, once_sums = None, {}
    if backward and identical and graph.nodes[cons.name].op == "call_function":
        sums, once_sums = _grad_sums(graph, prod, cons, pos, mesh, mat, identical, param)
    if not param:
        return mat if sums is None else mat + sums, {}, once_sums
    calls = {}
    cluster = mesh.resolved_cluster()
    for axes, (mask, nbytes, local) in gather_masks(graph, prod, cons, pos, mesh, backward, identical).items():
        kinds = ("all_gather", "reduce_scatter") if backward and not whole_on(axes, identical) else ("all_gather",)
        latency = sum(mesh_collective_time(k, 0, mesh, axes) for k in kinds)
        group = math.prod(mesh.shape[a] for a in axes)
        by_bytes = {}
        for n in set(nbytes[mask].tolist()):
            seconds = sum(mesh_collective_time(k, n, mesh, axes) + layout_copy_time(packed_gather_bytes(n, group), cluster) for k in kinds)
            by_bytes[n] = (mask & (nbytes == n), seconds - latency)
        mat = np.where(mask & np.isfinite(mat), local, mat)
        calls[axes] = (mask, latency, by_bytes)
    return mat if sums is None else mat + sums, calls, once_sums


def _grad_sums(graph, prod, cons, pos, mesh, mat, identical, param: bool):
    """(seconds per pair, (spec, axes) -> (seconds, pair mask)): the gradient sums of the reads
    that split an identical axis where they read the value replicated
    (``record.gradients.grad_sum_reads``), an all-reduce of the read's shard over those axes, on
    the pair where a reshard comes between, else once per (value, spec, axes). A parameter choice
    that leaves its gradient pending on an identical axis needs no sum there, but every read must
    split that axis with no step over it: other pairs cost infinity. ``mat``: the edge's reshard
    seconds (pairs already infinite are skipped)."""
    consumer = graph.nodes[cons.name]
    itemsize = edge_itemsize(graph.nodes[prod.name].meta, consumer)
    srcs, dsts = _pair_specs(graph, prod, cons, pos)
    reads = [partial_read_axes(s, pos, identical) for s in cons.strategies]
    pending = [tuple(a for a in (g.axes if param and g is not None else ()) if a in identical) for g in prod.grad_sync]
    if not any(reads) and not any(pending):
        return None, {}
    out = np.zeros(mat.shape)
    once: dict = {}
    for i, src in enumerate(srcs):
        for j, dst in enumerate(dsts):
            if src is None or dst is None or not math.isfinite(mat[i, j]):
                continue
            if pending[i]:
                steps = () if src == dst else plan_reshard(src, dst, mesh, itemsize, with_backward=True,
                                                           identical=identical).steps
                stepped = {a for st in steps for a in st.axes}
                if any(a not in reads[j] or a in stepped for a in pending[i]):
                    out[i, j] = np.inf
                    continue
            axes = tuple(a for a in reads[j] if a not in pending[i])
            if not axes:
                continue
            seconds = mesh_collective_time("all_reduce", local_bytes(dst, mesh.shape, itemsize), mesh, axes)
            if src == dst:
                entry = once.setdefault((dst, axes), (seconds, np.zeros(mat.shape, bool)))
                entry[1][i, j] = True
            else:
                out[i, j] = seconds
    return out, once


def planned_edges(graph, built: Built, full: dict[str, int], mesh, sources=None) -> list[EdgePlan]:
    """The reshards of solution ``full`` as the Plan records them (steps priced, whether a backward
    runs), for every edge or those out of ``sources``."""
    edges = []
    for src, dst, pos in built.edge_list:
        if sources is not None and src not in sources:
            continue
        s_spec = produced_spec(built.choices[src].strategies[full[src]], graph.nodes[dst], pos, graph)
        d_strat = built.choices[dst].strategies[full[dst]]
        d_spec = d_strat.inputs[pos] if pos < len(d_strat.inputs) else None
        if graph.nodes[dst].op == "output":
            d_spec = returned_spec(graph, dst, pos, s_spec)
        if s_spec is None or d_spec is None:
            continue
        backward = src in built.requires_grad and graph.nodes[dst].op != "output"  # as build_problem priced it
        rp = plan_reshard(s_spec, d_spec, mesh, edge_itemsize(graph.nodes[src].meta, graph.nodes[dst]), with_backward=backward,
                          identical=built.identical)
        steps = [StepPlan(st.kind, tuple(st.axes), int(st.nbytes), float(cost), st.src_dim, st.dst_dim)
                 for st, cost in zip(rp.steps, rp.costs)]
        # an output's gathers and all-reduces run no backward collective (codegen seeds it whole)
        output_only = graph.nodes[dst].op == "output" and bool(output_whole_axes(rp.steps))
        edges.append(EdgePlan(src, dst, pos, s_spec, d_spec, steps, src in built.requires_grad and not output_only))
    return edges
