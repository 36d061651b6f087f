"""Stage prices: what each unit (layer) costs on a sub-mesh, and the tables the stage DP reads.

For each microbatch count B the model is traced at the microbatch shape (the inputs' dim 0 divided
by B) and, on each sub-mesh, the intra-op ILP plans the whole graph once (repeated blocks solved
once): its chosen strategies' prices, attributed to the unit each node belongs to
(``unit_prices``), give every unit's time per microbatch (compute, op overheads, resharding and
in-op collectives, forward and backward), its time per step (gradient sync, optimizer; amortized
over the B microbatches in the DP), its bytes held for good (parameters, gradients, optimizer
states) and per microbatch in flight (activations). A stage's price is the sum over its units plus
the activation it receives over axis 0's link (``stage_tables``). Several ILP solutions per
sub-mesh (the fastest, then ones under tighter memory budgets: ``leaner_prices``) become separate
options, so a stage can trade speed for memory as Alpa's per-stage ILP does. What a pipelined step
runs after its schedule, outside every stage's price, is ``step_extras``.

Prices are linear in the units (a stage of layers i..j costs the sum of their prices): exact for the
attribution, approximate in that one ILP per sub-mesh decides every layer's strategy, as if all
stages on that sub-mesh shared it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from autopar.cost_model.comm import mesh_collective_time, send_time
from autopar.cost_model.ops import is_view, local_nbytes
from autopar.cost_model.step import in_op_comm_s, op_overheads_s, reshard_by_read
from autopar.errors import ConfigError, PlanError
from autopar.ir.blocks import node_readers, unit_of_nodes
from autopar.ir.graph import Role, needs_grad
from autopar.ir.losses import unread_outputs
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.reshard import local_bytes
from autopar.solver.layout import param_source

MEMORY_VARIANTS = (0.25,)  # leaner ILP solutions per sub-mesh, as fractions of the fastest's memory


class SharedParam(NamedTuple):
    """A parameter several units read (a tied embedding and head): its bytes held, its seconds per
    microbatch (gradient accumulation and optimizer share) and the per-step part of them, and those
    units."""

    nbytes: float
    seconds: float
    per_step_s: float
    units: tuple

    def extra_copies(self, i: int, j: int) -> int:
        """How many times more than once units i..j count it."""
        return max(0, sum(i <= u <= j for u in self.units) - 1)


@dataclasses.dataclass
class UnitPrices:
    """Per unit (layer), on one sub-mesh at one microbatch shape."""

    per_microbatch_s: np.ndarray
    per_step_s: np.ndarray
    static_bytes: np.ndarray
    activation_bytes: np.ndarray
    boundary_bytes: np.ndarray  # the activation entering unit u from the units before it
    plan: object  # the intra-op Plan these came from
    forward_s: np.ndarray | None = None  # the forward part of per_microbatch_s's compute
    recompute: bool = False
    stage_extra_bytes: float = 0.0  # held once by any stage on these prices
    # parameters read by several units (a tied embedding and head: ``SharedParam``); each of them
    # counts one in static_bytes and in its time, a stage holding several of them holds and pays it
    # once (``static_between``, ``duplicate_time``)
    shared_params: tuple = ()
    # held at the forward's peak once per stage, not per microbatch in flight (a loss's logits and
    # log-probabilities); None: nothing
    peak_bytes: np.ndarray | None = None
    # per microbatch whose weight half a split backward defers (``Schedule.deferred``): the
    # gradients of the outputs of the ops that read parameters, which the weight half reads
    weight_grad_bytes: np.ndarray | None = None
    # the activations the input half frees when the unit ends a stage: what is saved after its
    # last op reading a parameter (a loss's inputs), which no weight half needs
    tail_bytes: np.ndarray | None = None

    def static_between(self, i: int, j: int) -> float:
        """What units i..j hold of state, a shared parameter once."""
        return float(self.static_bytes[i:j + 1].sum()) - sum(p.nbytes * p.extra_copies(i, j) for p in self.shared_params)

    def duplicate_time(self, i: int, j: int) -> tuple[float, float]:
        """(seconds per microbatch, of which per step) that units i..j count more than once: a
        shared parameter's, which a stage holding several of its readers pays once."""
        extra = [(p.seconds * k, p.per_step_s * k) for p in self.shared_params if (k := p.extra_copies(i, j))]
        return sum(t for t, _ in extra), sum(once for _, once in extra)

    def held_between(self, i: int, j: int, state_share: float = 1.0) -> float:
        """What a stage of units i..j holds whatever its microbatches in flight: ``state_share`` of
        their state and what lives at the forward's peak, once."""
        peak = 0.0 if self.peak_bytes is None else float(self.peak_bytes[i:j + 1].sum())
        return self.static_between(i, j) * state_share + peak

    def deferred_between(self, i: int, j: int) -> float:
        """What a stage of units i..j holds per microbatch whose weight half is deferred, beyond
        its activations: the weight halves' gradients, less what the input half frees."""
        if self.weight_grad_bytes is None:
            return 0.0
        return max(0.0, float(self.weight_grad_bytes[i:j + 1].sum()) - float(self.tail_bytes[j]))

    def recomputed(self) -> "UnitPrices":
        """These prices with every unit's activations recomputed in backward (as
        ``torch.utils.checkpoint`` per layer): the forward runs twice; per microbatch in flight a
        unit keeps only its input; while one unit's backward runs, its whole activations are
        live again (the largest unit's, held once per stage)."""
        peak = float(self.activation_bytes.max()) if len(self.activation_bytes) else 0.0
        return dataclasses.replace(self, per_microbatch_s=self.per_microbatch_s + self.forward_s,
                                   activation_bytes=self.boundary_bytes.copy(), recompute=True, stage_extra_bytes=peak)


def unit_prices(plan, graph, mesh) -> UnitPrices:
    """Attribute a whole-graph intra-op plan's prices to the units (see the module docstring)."""
    cluster = mesh.resolved_cluster()
    grad = needs_grad(graph)
    unit = unit_of_nodes(graph)
    n = len(graph.layers)
    micro, step, static, act, boundary, forward, peak, weight_grads, tail = (np.zeros(n) for _ in range(9))
    last_weight_op: dict[int, int] = {}  # unit -> graph position of its last op reading a parameter
    position = {name: k for k, name in enumerate(graph.nodes)}
    readers = node_readers(graph)
    crossing: set[tuple[str, int]] = set()
    out = next(n for n in graph.nodes.values() if n.op == "output")
    unread = {(out.name, i) for i in unread_outputs(graph)}  # the last stage's program returns the loss alone
    accumulate = {p.node: p.accumulate_s for p in plan.params.values()}
    shared: list = []
    for name, np_ in plan.nodes.items():
        node = graph.nodes.get(name)
        if node is None:
            continue
        u = unit[name]
        if node.op == "placeholder" and node.role in (Role.PARAMETER, Role.BUFFER):
            users = {unit[r] for r in readers.get(name, ()) if r in unit} or {u}
            acc = accumulate.get(name, 0.0)
            if len(users) > 1:
                shared.append(SharedParam(np_.memory_bytes, np_.compute_s, np_.compute_s - acc, tuple(sorted(users))))
            for uu in users:  # a tied weight read at both ends is held by both stages
                static[uu] += np_.memory_bytes
                step[uu] += np_.compute_s - acc  # the optimizer's share
                micro[uu] += acc  # its gradient added up, every microbatch
        elif node.op == "call_function":
            forward_s, backward_s = op_overheads_s(node, grad, cluster)
            micro[u] += np_.compute_s + forward_s + backward_s + in_op_comm_s(np_, graph, mesh, plan.identical_axes)
            forward[u] += np_.compute_s / 3 + forward_s  # node compute is forward + 2x backward
            act[u] += np_.memory_bytes - np_.peak_bytes
            peak[u] += np_.peak_bytes
            if not is_view(node.target) and any(param_source(graph, i) is not None for i in node.inputs):
                weight_grads[u] += local_nbytes(node.meta, np_.output, mesh)
                last_weight_op[u] = max(last_weight_op.get(u, -1), position[name])
    for (dst, pos), seconds in reshard_by_read(graph, plan.edges, mesh, plan.identical_axes).items():
        if dst in unit and (dst, pos) not in unread:
            micro[unit[dst]] += seconds
    for e in plan.edges:
        src = graph.nodes[e.src]
        if src.op == "call_function" and e.src in unit and e.dst in unit and unit[e.src] < unit[e.dst]:
            # an activation read by a later unit crosses every boundary up to it, once, as the
            # shard each device of the sending stage holds
            nbytes = local_bytes(e.src_spec, mesh.shape, src.meta.itemsize) if hasattr(src.meta, "itemsize") else 0
            for b in range(unit[e.src] + 1, unit[e.dst] + 1):
                if (e.src, b) not in crossing:
                    crossing.add((e.src, b))
                    boundary[b] += nbytes
    for name, np_ in plan.nodes.items():  # saved from the unit's last op reading a parameter on
        u = unit.get(name)
        if (u is not None and graph.nodes[name].op == "call_function"
                and position[name] >= last_weight_op.get(u, len(position))):
            tail[u] += np_.memory_bytes - np_.peak_bytes
    for p in plan.params.values():
        if p.grad_sync is not None and p.node in unit:
            step[unit[p.node]] += p.grad_sync_s
    return UnitPrices(micro, step, static, act, boundary, plan, forward, shared_params=tuple(shared), peak_bytes=peak,
                      weight_grad_bytes=weight_grads, tail_bytes=tail)



def grouped_prices(p: UnitPrices, groups) -> UnitPrices:
    """Per-layer prices summed per group; a group receives what its first layer receives."""
    def total(a):
        return np.asarray([a[g].sum() for g in groups])

    group_of = {u: k for k, g in enumerate(groups) for u in g}
    return UnitPrices(total(p.per_microbatch_s), total(p.per_step_s), total(p.static_bytes),
                      total(p.activation_bytes), np.asarray([p.boundary_bytes[g[0]] for g in groups]), p.plan,
                      total(p.forward_s), p.recompute, p.stage_extra_bytes,
                      tuple(sp._replace(units=tuple(group_of[u] for u in sp.units)) for sp in p.shared_params),
                      None if p.peak_bytes is None else total(p.peak_bytes),
                      None if p.weight_grad_bytes is None else total(p.weight_grad_bytes),
                      None if p.tail_bytes is None else np.asarray([p.tail_bytes[g[-1]] for g in groups]))


def fastest_prices(model, sm, graph, intra_op_plan, config) -> UnitPrices | None:
    """The prices of the fastest intra-op plan on sub-mesh ``sm``; None where there is no plan (or
    a forced layout does not fit it)."""
    try:
        return unit_prices(intra_op_plan(model, sm, graph=graph, config=config.replace(memory_budget=None)), graph, sm)
    except (PlanError, ConfigError):
        return None


def held_bytes(p: UnitPrices, share: float | None) -> float:
    """What a stage of plan ``p`` holds: ``share`` of the layers' state (stages equal; None: the whole
    plan's peak, a bound) and at most one microbatch of every layer's activations in flight (1F1B)."""
    if share is None:
        return p.plan.predicted["memory_bytes_per_device"]
    return p.held_between(0, len(p.static_bytes) - 1, share) + p.activation_bytes.sum()


def leaner_prices(model, sm, graph, intra_op_plan, config, fastest: UnitPrices, cutoff_s: float | None):
    """Leaner intra-op plans on ``sm`` than ``fastest`` (tighter memory budgets, no idle axes, a
    short time limit), each costing under ``cutoff_s`` per microbatch (None: no cutoff)."""
    out = [fastest]
    memory = fastest.plan.predicted["memory_bytes_per_device"]
    lean = config.replace(idle_axes=(), time_limit_s=min(config.time_limit_s, 2.0), objective_cutoff_s=cutoff_s)
    for fraction in MEMORY_VARIANTS:
        try:
            leaner = intra_op_plan(model, sm, graph=graph, config=lean.replace(memory_budget=memory * fraction))
        except PlanError:
            break
        if leaner.predicted["memory_bytes_per_device"] >= out[-1].plan.predicted["memory_bytes_per_device"] * 0.95:
            continue
        out.append(unit_prices(leaner, graph, sm))
    return out[1:]


def stage_tables(variants, n_units: int, mesh: Mesh):
    """(time, static memory, activation memory, memory per deferred weight half) per (first unit,
    last unit, variant)."""
    n_opt = len(variants)
    time_t = np.full((n_units, n_units, n_opt), math.inf)
    mem_t = np.zeros_like(time_t)
    act_t = np.zeros_like(time_t)
    deferred_t = np.zeros_like(time_t)
    for m, (rows, p) in enumerate(variants):
        per_unit = p.per_microbatch_s + p.per_step_s  # per-step prices are already 1 / count (plan(microbatches=))
        c_time, c_act = (np.concatenate([[0.0], np.cumsum(a)]) for a in (per_unit, p.activation_bytes))
        for i in range(n_units):
            # the activation entering the stage (forward) and its gradient leaving it (backward)
            recv = 0.0 if i == 0 else 2 * send_time(p.boundary_bytes[i], mesh, (0,))
            j = np.arange(i, n_units)
            time_t[i, i:, m] = c_time[j + 1] - c_time[i] + recv - [p.duplicate_time(i, jj)[0] for jj in j]
            mem_t[i, i:, m] = [p.held_between(i, jj) + p.stage_extra_bytes for jj in j]
            act_t[i, i:, m] = c_act[j + 1] - c_act[i]
            deferred_t[i, i:, m] = [p.deferred_between(i, jj) for jj in j]
    return time_t, mem_t, act_t, deferred_t


def multi_unit_params(graph) -> dict[str, set[int]]:
    """Parameter placeholder -> the layer units reading it, for those read in more than one (a
    tied embedding and head): what ``step_extras`` looks at, found once per graph."""
    unit, readers = unit_of_nodes(graph), node_readers(graph)
    out = {}
    for ph in graph.params.values():
        units = {unit[r] for r in readers.get(ph, ()) if r in unit}
        if len(units) > 1:
            out[ph] = units
    return out


def step_extras(graph, groups, stages, blocks: int, mesh: Mesh, shared: dict[str, set[int]] | None = None) -> float:
    """What a pipelined step runs after its schedule, blocking, that no stage price holds
    (``PipelineRunner.step``): the loss sent from the last stage to every rank (one small
    collective over the pipeline group), and each parameter that several blocks of ranks read (a
    tied embedding and head) summed over them (an all-reduce of its whole gradient: the stages'
    storage is not known here; where they store it alike and split, the runner sums each rank's
    shard, so this is an upper bound there). Both cross the mesh's first axis. 0 for one stage.
    ``shared``: ``multi_unit_params(graph)``."""
    if len(stages) < 2:
        return 0.0
    link = mesh.resolved_cluster().with_axis_links([mesh.links()[0]])
    block_of_unit = {}
    for s, (gi, gj, _) in enumerate(stages):
        for g in groups[gi: gj + 1]:
            for u in g:
                block_of_unit[u] = s % blocks
    total = mesh_collective_time("all_reduce", 4, Mesh((blocks,), cluster=link), (0,))  # the loss
    for ph, units in (multi_unit_params(graph) if shared is None else shared).items():
        holders = {block_of_unit[u] for u in units}
        if len(holders) > 1:
            total += mesh_collective_time("all_reduce", graph.nodes[ph].meta.nbytes, Mesh((len(holders),), cluster=link), (0,))
    return total
