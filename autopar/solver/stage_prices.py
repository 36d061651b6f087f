"""Stage prices: what each unit (layer) costs on a sub-mesh, and the tables the stage DP reads.

For each microbatch count B the model is traced at the microbatch shape (the inputs' dim 0 divided
by B) and, on each sub-mesh, the intra-op ILP plans the whole graph once (repeated blocks solved
once): its chosen strategies' prices, attributed to the unit each node belongs to
(``unit_prices``), give every unit's time per microbatch (compute, op overheads, resharding and
in-op collectives, forward and backward), its time per step (gradient sync, optimizer; amortized
over the B microbatches in the DP), its bytes held for good (parameters, gradients, optimizer
states) and per microbatch in flight (activations). A stage's price is the sum over its units, its
gradient syncs as its own reducer runs them (``UnitSyncs``: each group's first calls once, hidden
behind its last microbatch's backward where the schedule launches them there) and what it receives
over axis 0's link (``variant_tables``): what ``cost_model.step.step_time`` prices the stage's own
plan at, run once per microbatch. Several ILP solutions per
sub-mesh (the fastest, then ones under tighter memory budgets: ``leaner_prices``) become separate
options, so a stage can trade speed for memory as Alpa's per-stage ILP does. What a pipelined step
runs after its schedule, outside every stage's price, is ``step_extras``.

Prices are exact for the attribution, approximate in that one ILP per sub-mesh decides every
layer's strategy, as if all stages on that sub-mesh shared it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from autopar.cost_model.comm import mesh_collective_time, send_time
from autopar.cost_model.ops import is_view, local_nbytes
from autopar.cost_model.grad_sync import grad_bytes_total
from autopar.cost_model.step import in_op_comm_parts, op_overheads_s, reshard_parts_by_read, sync_prices
from autopar.cost_model.memory import accumulating_bytes, accumulation_overlap, grad_parts_in_flight, run_again
from autopar.errors import ConfigError, PlanError
from autopar.ir.blocks import node_readers, unit_of_nodes
from autopar.ir.graph import Role, needs_grad, runs_backward
from autopar.ir.precision import MixedPrecision
from autopar.record.buckets import DEFAULT_BUCKET_BYTES
from autopar.record.recompute import Recompute, attention_dropout, saved_by_selective
from autopar.ir.losses import unread_outputs
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.reshard import local_bytes
from autopar.solver.ilp import OverBudget
from autopar.solver.layout import param_source

# leaner ILP solutions per sub-mesh, as fractions of the fastest's memory (where no plan fits
# that, of the way from the least any plan needs to the fastest's)
MEMORY_VARIANTS = (0.25,)


class SharedParam(NamedTuple):
    """A parameter several units read (a tied embedding and head): its bytes held, its seconds per
    microbatch (gradient accumulation and optimizer share) and the per-step part of them, and those
    units."""

    nbytes: float
    seconds: float
    per_step_s: float
    units: tuple


def extra_copies_from(units, i: int, n: int) -> np.ndarray:
    """For every j in i..n-1, how many times more than once units i..j count what ``units`` (with
    repeats: a unit of grouped layers counts each) all hold."""
    return np.maximum(0, np.cumsum(np.bincount(np.asarray(units, dtype=int), minlength=n)[i:n]) - 1)


@dataclasses.dataclass
class UnitSyncs:
    """Each unit's gradient syncs, in seconds per run (the microbatch's share of a step), as a
    stage's reducer runs them (``cost_model.step.synced_s``): per group of buckets
    (``SyncPrice.group``) its first calls (``first``: a stage syncing in the group pays them once,
    however few of its units do), and per (unit, group) the sums (``sums``), their part in the
    last bucket (``floors``), what follows the step (``after``: ZeRO-2's gathers and fresh pages)
    and how many parameters (``count``); per unit the backward compute a sync launched in the last
    microbatch's backward hides behind (``cover``, ``comm_overlap`` applied). A parameter several
    units read (a tied embedding and head) counts in each; ``shared``: (its units, group, sum,
    floor, after), taken out again where one stage holds several of its readers."""

    first: np.ndarray
    sums: np.ndarray
    floors: np.ndarray
    after: np.ndarray
    count: np.ndarray
    cover: np.ndarray
    shared: tuple = ()

    def from_unit(self, i: int, overlapped: bool) -> np.ndarray:
        """Seconds per run of the syncs of a stage of units i..j, for every j >= i: each group it
        syncs in once, then max(the last bucket, the sums - the stage's cover) where
        ``overlapped`` (GPipe, 1F1B: launched in the last microbatch's backward), the sums whole
        otherwise, and what follows the step."""
        sums, floors, after, count = (np.cumsum(a[i:], axis=0) for a in (self.sums, self.floors, self.after, self.count))
        n = len(self.cover)
        for units, g, s, f, a in self.shared:
            extra = extra_copies_from(units, i, n)
            sums[:, g] -= extra * s
            floors[:, g] -= extra * f
            after[:, g] -= extra * a
            count[:, g] -= extra
        first = (count > 0) @ self.first
        cover = np.cumsum(self.cover[i:]) if overlapped else 0.0
        return first + np.maximum(floors.sum(axis=1), sums.sum(axis=1) - cover) + after.sum(axis=1)

    def between(self, i: int, j: int, overlapped: bool) -> float:
        """``from_unit`` of the stage of units i..j."""
        return float(self.from_unit(i, overlapped)[j - i])

    def grouped(self, groups) -> "UnitSyncs":
        """Per group of consecutive units (``grouped_prices``)."""
        group_of = {u: k for k, g in enumerate(groups) for u in g}
        return UnitSyncs(self.first, *(np.asarray([a[g].sum(axis=0) for g in groups]).reshape(len(groups), *a.shape[1:])
                                       for a in (self.sums, self.floors, self.after, self.count, self.cover)),
                         tuple((tuple(group_of[u] for u in units), *rest) for units, *rest in self.shared))


@dataclasses.dataclass
class UnitPrices:
    """Per unit (layer), on one sub-mesh at one microbatch shape."""

    per_microbatch_s: np.ndarray
    per_step_s: np.ndarray
    static_bytes: np.ndarray
    activation_bytes: np.ndarray
    boundary_bytes: np.ndarray  # what a stage starting at unit u receives (activations, the inputs later units read)
    plan: object  # the intra-op Plan these came from
    forward_s: np.ndarray | None = None  # the forward part of per_microbatch_s: compute, overheads, collectives
    recompute: Recompute = Recompute.NONE
    stage_extra_bytes: float = 0.0  # held once by any stage on these prices
    # parameters read by several units (a tied embedding and head: ``SharedParam``); each of them
    # counts one in static_bytes and in its time, a stage holding several of them holds and pays it
    # once (``_extra_from``)
    shared_params: tuple = ()
    # held at the step's peak once per stage, not per microbatch in flight (a loss's logits and
    # log-probabilities, or their gradients); None: nothing
    peak_bytes: np.ndarray | None = None
    # per microbatch whose weight half a split backward defers (``Schedule.deferred``): the
    # gradients of the outputs of the ops that read parameters, which the weight half reads
    weight_grad_bytes: np.ndarray | None = None
    # the activations the input half frees when the unit ends a stage: what is saved after its
    # last op reading a parameter (a loss's inputs), which no weight half needs
    tail_bytes: np.ndarray | None = None
    # the gradient syncs (``UnitSyncs``): not linear in the units, so out of per_step_s
    syncs: UnitSyncs | None = None
    # of boundary_bytes, the gradients a stage starting at unit u sends back (None: all of them)
    boundary_grad_bytes: np.ndarray | None = None
    # selective recomputation (``record.recompute``): the forward work of the ops it runs again
    # (the collectives' included), and the outputs it keeps of the others, per microbatch
    unsaved_forward_s: np.ndarray | None = None
    saved_bytes: np.ndarray | None = None
    selective_refused: str | None = None  # why these prices are not offered recomputed selectively
    # the gradient parts its parameters hand the reducer per backward (``memory.grad_parts_in_flight``),
    # and the reducer's bucket size they were planned for
    grad_part_bytes: np.ndarray | None = None
    bucket_bytes: float = DEFAULT_BUCKET_BYTES
    # of static_bytes, ZeRO-2's buckets the microbatches' gradients add up in (``memory.accumulation_overlap``)
    accumulating_bytes: np.ndarray | None = None

    def overlap_from(self, i: int) -> np.ndarray:
        """For every j >= i, what a stage of units i..j that runs its forwards first holds less
        than its state and its microbatches' activations summed (``memory.accumulation_overlap``)."""
        n = len(self.static_bytes)
        if self.accumulating_bytes is None:
            return np.zeros(n - i)
        acc = np.cumsum(self.accumulating_bytes[i:])
        act = np.cumsum(self.activation_bytes[i:])
        return np.asarray([accumulation_overlap(a, b) for a, b in zip(acc, act)])

    def parts_in_flight_from(self, i: int) -> np.ndarray:
        """For every j >= i, what a backward of a stage of units i..j holds beyond its forward's
        peak while the reducer collects a bucket (``memory.grad_parts_in_flight``)."""
        n = len(self.static_bytes)
        if self.grad_part_bytes is None:
            return np.zeros(n - i)
        parts = np.cumsum(self.grad_part_bytes[i:])
        # what the microbatch holds at its peak: its activations, and a recomputed layer's while it runs again
        act = np.cumsum(self.activation_bytes[i:]) + self.stage_extra_bytes
        return np.asarray([grad_parts_in_flight(p, self.bucket_bytes, a) for p, a in zip(parts, act)])

    def receive_buffers_from(self, i: int) -> np.ndarray:
        """For every j >= i, the bytes of one microbatch's receive buffers of a stage of units
        i..j: its inputs (from the stage before; none for the first) and its outputs' gradients
        (from the stage after; none for the last). torch's ``PipelineStage`` makes such buffers
        for every microbatch of the step when it first runs, and keeps them."""
        n = len(self.static_bytes)
        grads = self.boundary_bytes if self.boundary_grad_bytes is None else self.boundary_grad_bytes
        back = np.concatenate([grads[i + 1:], [0.0]])  # what the stage after one ending at j sends back
        return (self.boundary_bytes[i] if i > 0 else 0.0) + back[:n - i]

    def receive_s(self, i: int, mesh: Mesh) -> float:
        """Seconds per microbatch a stage starting at unit i spends on the values it receives
        (forward) and the gradients it sends back (backward), point to point over the mesh's
        first axis."""
        if i == 0:
            return 0.0
        grads = self.boundary_bytes[i] if self.boundary_grad_bytes is None else self.boundary_grad_bytes[i]
        return send_time(self.boundary_bytes[i], mesh, (0,)) + (send_time(grads, mesh, (0,)) if grads > 0 else 0.0)

    def _extra_from(self, i: int, field: str) -> np.ndarray:
        """For every j >= i, what units i..j count more than once of the shared parameters'
        ``field`` (``SharedParam``): a stage holding several of a tied weight's readers holds and
        pays it once."""
        n = len(self.static_bytes)
        out = np.zeros(n - i)
        for p in self.shared_params:
            out += getattr(p, field) * extra_copies_from(p.units, i, n)
        return out

    def static_from(self, i: int) -> np.ndarray:
        """For every j >= i, what units i..j hold of state, a shared parameter once."""
        return np.cumsum(self.static_bytes[i:]) - self._extra_from(i, "nbytes")

    def static_between(self, i: int, j: int) -> float:
        """``static_from`` of units i..j."""
        return float(self.static_from(i)[j - i])

    def time_from(self, i: int, overlapped: bool) -> np.ndarray:
        """Seconds per microbatch of a stage of units i..j, for every j >= i, but for what it
        receives: its units' work per microbatch and their per-step work's share (a shared
        parameter once), and its gradient syncs (``UnitSyncs.from_unit``)."""
        linear = np.cumsum(self.per_microbatch_s[i:] + self.per_step_s[i:]) - self._extra_from(i, "seconds")
        return linear + self.syncs.from_unit(i, overlapped)

    def per_step_between(self, i: int, j: int, overlapped: bool) -> float:
        """Seconds per microbatch of units i..j's per-step work (gradient syncs, optimizer; a
        shared parameter once): what a step pays once, at the microbatch's share."""
        once = np.cumsum(self.per_step_s[i:]) - self._extra_from(i, "per_step_s")
        return float(once[j - i]) + self.syncs.between(i, j, overlapped)

    def held_from(self, i: int, state_share: float = 1.0) -> np.ndarray:
        """For every j >= i, what a stage of units i..j holds whatever its microbatches in flight:
        ``state_share`` of their state and what lives at the step's peak, once."""
        peak = 0.0 if self.peak_bytes is None else np.cumsum(self.peak_bytes[i:])
        return self.static_from(i) * state_share + peak

    def held_between(self, i: int, j: int, state_share: float = 1.0) -> float:
        """``held_from`` of the stage of units i..j."""
        return float(self.held_from(i, state_share)[j - i])

    def deferred_from(self, i: int) -> np.ndarray:
        """For every j >= i, what a stage of units i..j holds per microbatch whose weight half is
        deferred, beyond its activations: the weight halves' gradients, less what the input half
        frees."""
        if self.weight_grad_bytes is None:
            return np.zeros(len(self.static_bytes) - i)
        return np.maximum(0.0, np.cumsum(self.weight_grad_bytes[i:]) - self.tail_bytes[i:])

    def deferred_between(self, i: int, j: int) -> float:
        """``deferred_from`` of the stage of units i..j."""
        return float(self.deferred_from(i)[j - i])

    def recomputed(self, kind: Recompute = Recompute.FULL) -> "UnitPrices":
        """These prices with every unit's activations recomputed in backward, per layer as
        ``torch.utils.checkpoint`` runs it: per microbatch in flight a unit keeps its input (and
        under selective recomputation the outputs of the ops it saves); the forward runs again
        (under selective, that of the other ops); while one unit's backward runs, the activations
        it recomputed are live again (the largest unit's, held once per stage). ``Recompute.NONE``:
        these prices."""
        if not kind:
            return self
        if kind is Recompute.SELECTIVE:
            again, kept, live = self.unsaved_forward_s, self.boundary_bytes + self.saved_bytes, \
                np.maximum(0.0, self.activation_bytes - self.saved_bytes)
        else:
            again, kept, live = self.forward_s, self.boundary_bytes.copy(), self.activation_bytes
        peak = float(live.max()) if len(live) else 0.0
        return dataclasses.replace(self, per_microbatch_s=self.per_microbatch_s + again, activation_bytes=kept,
                                   recompute=kind, stage_extra_bytes=peak)


def unit_prices(plan, graph, mesh, *, step_share: float = 1.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> UnitPrices:
    """Attribute a whole-graph intra-op plan's prices to the units (see the module docstring).
    ``step_share``: the share of a step one run of the graph is (the plan's ``1 / microbatches``);
    ``bucket_bytes``: the reducer's bucket size it was planned for."""
    cluster = mesh.resolved_cluster()
    grad = needs_grad(graph)
    unit = unit_of_nodes(graph)
    n = len(graph.layers)
    micro, step, static, act, boundary, boundary_grads, forward, peak, weight_grads, tail, cover, unsaved, saved, parts, acc_bytes = (
        np.zeros(n) for _ in range(15))
    precision = MixedPrecision.from_dict(plan.precision) if plan.precision else None
    zero2 = {p.node: p.grad_sync.axes for p in plan.params.values()
             if step_share < 1.0 and p.grad_sync is not None and p.grad_sync.split and not p.buffer}
    refused = None  # why selective recomputation is not offered (None: it is)
    rerun = run_again(graph)
    last_weight_op: dict[int, int] = {}  # unit -> graph position of its last op reading a parameter
    position = {name: k for k, name in enumerate(graph.nodes)}
    readers = node_readers(graph)
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
            users = _reader_units(name, unit, readers)
            acc = accumulate.get(name, 0.0)
            if len(users) > 1:
                shared.append(SharedParam(np_.memory_bytes, np_.compute_s, np_.compute_s - acc, tuple(users)))
            for uu in users:  # a tied weight read at both ends is held by both stages
                static[uu] += np_.memory_bytes
                if node.role == Role.PARAMETER and name in grad:
                    parts[uu] += local_nbytes(node.meta, np_.output, mesh)
                if name in zero2:
                    acc_bytes[uu] += accumulating_bytes(node.meta, np_.output, mesh, zero2[name], precision)
                step[uu] += np_.compute_s - acc  # the optimizer's share
                micro[uu] += acc  # its gradient added up, every microbatch
        elif node.op == "call_function":
            if runs_backward(node, grad):  # what a sync launched in backward runs beside
                cover[u] += cluster.comm_overlap * step_share * np_.compute_s * 2 / 3
            forward_s, backward_s = op_overheads_s(node, grad, cluster)
            in_forward, in_backward = in_op_comm_parts(np_, graph, mesh, plan.identical_axes)
            micro[u] += np_.compute_s + forward_s + backward_s + in_forward + in_backward
            if name in rerun:  # node compute is forward + 2x backward; a collective is run again either way
                forward[u] += np_.compute_s / 3 + forward_s + in_forward
                unsaved[u] += in_forward + (0.0 if saved_by_selective(node.target) else np_.compute_s / 3 + forward_s)
            if saved_by_selective(node.target):  # what lives at the step's peak is there once anyway
                out = local_nbytes(node.meta, np_.output, mesh)
                saved[u] += max(0.0, out - np_.peak_bytes)
                if attention_dropout(node):  # (the math path: the scores are kept too, key length over head dim)
                    saved[u] += out * graph.nodes[node.inputs[1]].meta.shape[-2] / node.meta.shape[-1]
                if np_.family.ring is not None:
                    refused = (f"{name} runs ring attention, whose blocks selective recomputation would each keep "
                               "(priced as one output): recompute it whole or not at all")
            act[u] += np_.memory_bytes - np_.peak_bytes
            peak[u] += np_.peak_bytes
            if not is_view(node.target) and any(param_source(graph, i) is not None for i in node.inputs):
                weight_grads[u] += local_nbytes(node.meta, np_.output, mesh)
                last_weight_op[u] = max(last_weight_op.get(u, -1), position[name])
    for (dst, pos), (forward_s, backward_s) in reshard_parts_by_read(graph, plan.edges, mesh, plan.identical_axes).items():
        if dst in unit and (dst, pos) not in unread:
            micro[unit[dst]] += forward_s + backward_s
            if dst in rerun:
                forward[unit[dst]] += forward_s
                unsaved[unit[dst]] += forward_s
    for v, nbytes, u_made, u_last in _crossing_values(plan, graph, unit, readers, mesh):
        boundary[u_made + 1:u_last + 1] += nbytes  # sent on by every stage up to its last reader
        if v in grad:  # its gradient comes back
            boundary_grads[u_made + 1:u_last + 1] += nbytes
    for name, np_ in plan.nodes.items():  # saved from the unit's last op reading a parameter on
        u = unit.get(name)
        if (u is not None and graph.nodes[name].op == "call_function"
                and position[name] >= last_weight_op.get(u, len(position))):
            tail[u] += np_.memory_bytes - np_.peak_bytes
    syncs = _unit_syncs(plan, graph, mesh, unit, readers, cover, step_share, bucket_bytes)
    return UnitPrices(micro, step, static, act, boundary, plan, forward, shared_params=tuple(shared), peak_bytes=peak,
                      weight_grad_bytes=weight_grads, tail_bytes=tail, syncs=syncs, boundary_grad_bytes=boundary_grads,
                      grad_part_bytes=parts, bucket_bytes=bucket_bytes, accumulating_bytes=acc_bytes,
                      unsaved_forward_s=unsaved, saved_bytes=saved, selective_refused=refused)


def _reader_units(param: str, unit, readers) -> list[int]:
    """The units reading a parameter placeholder (a tied weight read at both ends is held and
    synced by both stages), or its own unit where none reads it."""
    return sorted({unit[r] for r in readers.get(param, ()) if r in unit} or {unit[param]})


def _crossing_values(plan, graph, unit, readers, mesh):
    """(value, bytes each device sends, the unit making it, its last reader's unit) of every value
    a later unit reads: an activation as the shard its producer holds, a user input whole (stage 0
    gets the inputs; codegen's ``sent_specs``)."""
    for v, node in graph.nodes.items():
        last = max((unit[r] for r in readers.get(v, ()) if r in unit), default=-1)
        if node.op == "call_function" and v in unit and last > unit[v] and hasattr(node.meta, "itemsize"):
            yield v, local_bytes(plan.nodes[v].output, mesh.shape, node.meta.itemsize), unit[v], last
        elif node.op == "placeholder" and node.role == Role.INPUT and last > 0 and hasattr(node.meta, "nbytes"):
            yield v, float(node.meta.nbytes), 0, last


def _unit_syncs(plan, graph, mesh, unit, readers, cover, step_share: float, bucket_bytes: int) -> UnitSyncs:
    """The plan's gradient syncs per unit (``UnitSyncs``), each in every unit reading its parameter."""
    precision = MixedPrecision.from_dict(plan.precision) if plan.precision else None
    priced = [(p, q) for p, q, _ in sync_prices(plan, graph, mesh, bucket_bytes=bucket_bytes,
                                                 grad_total_bytes=grad_bytes_total(graph, precision))
              if q is not None and p.node in unit]
    groups = list(dict.fromkeys(q.group for _, q in priced))
    n, index = len(cover), {g: k for k, g in enumerate(groups)}
    first = np.zeros(len(groups))
    sums, floors, after, count = (np.zeros((n, len(groups))) for _ in range(4))
    shared = []
    for p, q in priced:
        g = index[q.group]
        first[g] = (q.latency_s + q.after_latency_s) * step_share
        users = _reader_units(p.node, unit, readers)
        parts = (q.sum_s * step_share, q.floor_s * step_share, (q.gather_s + q.fresh_s) * step_share)
        for u in users:
            sums[u, g] += parts[0]
            floors[u, g] += parts[1]
            after[u, g] += parts[2]
            count[u, g] += 1
        if len(users) > 1:
            shared.append((tuple(users), g, *parts))
    return UnitSyncs(first, sums, floors, after, count, cover, tuple(shared))



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
                      None if p.tail_bytes is None else np.asarray([p.tail_bytes[g[-1]] for g in groups]),
                      p.syncs.grouped(groups),
                      None if p.boundary_grad_bytes is None else np.asarray([p.boundary_grad_bytes[g[0]] for g in groups]),
                      None if p.unsaved_forward_s is None else total(p.unsaved_forward_s),
                      None if p.saved_bytes is None else total(p.saved_bytes), p.selective_refused,
                      None if p.grad_part_bytes is None else total(p.grad_part_bytes), p.bucket_bytes,
                      None if p.accumulating_bytes is None else total(p.accumulating_bytes))


def fastest_prices(model, sm, graph, intra_op_plan, config) -> UnitPrices | None:
    """The prices of the fastest intra-op plan on sub-mesh ``sm``; None where there is no plan (or
    a forced layout does not fit it)."""
    try:
        return unit_prices(intra_op_plan(model, sm, graph=graph, config=config.replace(memory_budget=None)), graph, sm,
                           step_share=1.0 / config.microbatches, bucket_bytes=config.bucket_bytes)
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
            try:
                leaner = intra_op_plan(model, sm, graph=graph, config=lean.replace(memory_budget=memory * fraction))
            except OverBudget as err:  # as far from the least any plan needs instead
                if not err.least < memory:
                    raise
                budget = err.least + fraction * (memory - err.least)
                leaner = intra_op_plan(model, sm, graph=graph, config=lean.replace(memory_budget=budget))
        except PlanError:
            break
        if leaner.predicted["memory_bytes_per_device"] >= out[-1].plan.predicted["memory_bytes_per_device"] * 0.95:
            continue
        out.append(unit_prices(leaner, graph, sm, step_share=1.0 / config.microbatches, bucket_bytes=config.bucket_bytes))
    return out[1:]


def stacked_tables(per_variant: list):
    """The stage DP's tables per (first unit, last unit, variant): each variant's own
    (``variant_tables``) stacked on a last axis."""
    return tuple(np.stack(parts, axis=2) for parts in zip(*per_variant))


def variant_tables(p: UnitPrices, n_units: int, mesh: Mesh, overlapped: bool = True):
    """(time, static memory, activation memory, memory per deferred weight half, receive buffers
    per microbatch of the step, what a stage running its forwards first holds less) per (first
    unit, last unit) of one variant's prices; ``overlapped``: the schedule launches a stage's
    gradient syncs in its last microbatch's backward (``Schedule.overlaps_sync``)."""
    time_t = np.full((n_units, n_units), math.inf)
    mem_t, act_t, deferred_t, received_t, overlap_t = (np.zeros_like(time_t) for _ in range(5))
    c_act = np.concatenate([[0.0], np.cumsum(p.activation_bytes)])
    for i in range(n_units):
        time_t[i, i:] = p.time_from(i, overlapped) + p.receive_s(i, mesh)
        mem_t[i, i:] = p.held_from(i) + p.stage_extra_bytes + p.parts_in_flight_from(i)
        act_t[i, i:] = c_act[i + 1:] - c_act[i]
        deferred_t[i, i:] = p.deferred_from(i)
        received_t[i, i:] = p.receive_buffers_from(i)
        overlap_t[i, i:] = p.overlap_from(i)
    return time_t, mem_t, act_t, deferred_t, received_t, overlap_t


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
