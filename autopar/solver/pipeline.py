"""Pipeline search: which layers run on which sub-mesh, how many microbatches, which schedule.

The orchestration around the stage DP (``autopar.solver.stage_dp``), in the style of Alpa's stage
construction:

1. **Units.** The traced graph's layers (``graph.layers``) in order; the nodes before the first
   layer (embeddings) join the first stage, the nodes after the last (final norm, head, loss) the
   last stage. Tied parameters used at both ends are held by both.
2. **Sub-meshes.** A stage runs on a block of consecutive rows of the mesh's slowest axis (axis 0):
   ``k`` rows form a sub-mesh of shape ``(k, *rest)`` with the parent's links, so a (4,) mesh offers
   1-4 devices per stage and a (128, 8) mesh blocks of whole nodes (``k`` a power of two there).
3. **Stage prices.** For each microbatch count B the model is traced at the microbatch shape (the
   inputs' dim 0 divided by B) and, on each sub-mesh, the intra-op ILP plans the whole graph once
   (repeated blocks solved once): its chosen strategies' prices, attributed to the unit each node
   belongs to, give every unit's time per microbatch (compute, op overheads, resharding and in-op
   collectives, forward and backward), its time per step (gradient sync, optimizer; amortized over
   the B microbatches in the DP), its bytes held for good (parameters, gradients, optimizer
   states) and per microbatch in flight (activations). A stage's price is the sum over its units
   plus the activation it receives over axis 0's link. Several ILP solutions per sub-mesh (the
   fastest, then ones under tighter memory budgets) become separate options, so a stage can trade
   speed for memory as Alpa's per-stage ILP does. The leaner ones are solved after a first DP over
   the fastest, cut off where they could not beat the step it found (a stage on 1 / s of the rows
   runs at least 1 / s of the work).
4. **Search.** The DP per (B, schedule), then the best step time; a one-stage result is the plain
   intra-op plan. Microbatch counts: powers of two dividing the batch (a given count is fixed).

Prices are linear in the units (a stage of layers i..j costs the sum of their prices): exact for the
attribution, approximate in that one ILP per sub-mesh decides every layer's strategy, as if all
stages on that sub-mesh shared it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np

from autopar.cost_model.comm import mesh_collective_time
from autopar.cost_model.lowered import lowered_comm_s
from autopar.cost_model.schedules import SCHEDULES, SEARCHED, Schedule, listed, schedule_named, simulate_shared
from autopar.errors import ConfigError, PlanError, TraceError
from autopar.ir import trace as trace_graph
from autopar.ir.blocks import node_readers, unit_of_nodes
from autopar.ir.batch_scaling import scaled_graph
from autopar.ir.graph import Role
from autopar.ir.losses import class_means, counted_from_inputs, loss_position, state_weighing
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.reshard import local_bytes
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import needs_lowering
from autopar.solver.intra_op import plan_one_stage
from autopar.solver.plan import PipelinePlan, Plan, StagePlan
from autopar.solver.receives import received_edges
from autopar.solver.stage_dp import solve_stages

log = logging.getLogger(__name__)

MEMORY_VARIANTS = (0.25,)  # leaner ILP solutions per sub-mesh, as fractions of the fastest's memory
MAX_UNITS = 24  # more layers than this are cut only between groups of consecutive layers (``unit_groups``)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline choices for ``autopar.plan``: every given field is fixed, every None searched."""

    stages: int | None = None
    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    recompute: bool | None = None
    layers: tuple[int, ...] | None = None  # layers per stage, in order (e.g. (3, 1)); fixes the stage count

    def __post_init__(self):
        named = SCHEDULES.get(self.schedule) if isinstance(self.schedule, str) else None  # None: searched or unknown
        if self.layers is not None:
            layers = tuple(int(n) for n in self.layers)
            if not layers or min(layers) < 1:
                raise ConfigError(f"Pipeline(layers={self.layers}): every stage needs at least one layer")
            object.__setattr__(self, "layers", layers)
            v = self.virtual_stages or (named.virtual_stages if named else 1)
            if len(layers) % v:
                raise ConfigError(f"Pipeline(layers={self.layers}): {len(layers)} stages do not fill {v} virtual stages per rank")
            if self.stages is not None and self.stages * v != len(layers):
                raise ConfigError(f"Pipeline(stages={self.stages}, layers={self.layers}): {len(layers)} stages given by layers")
            object.__setattr__(self, "stages", len(layers) // v)
        if self.stages is not None and self.stages < 1:
            raise ConfigError(f"Pipeline(stages={self.stages}): need at least one stage")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"Pipeline(microbatches={self.microbatches}): need at least one microbatch")
        if self.schedule is not None:
            named = schedule_named(self.schedule)
        if named is not None and not named.recompute and self.recompute:
            raise ConfigError(f"Pipeline(schedule={named.name!r}, recompute=True): the {named.name} schedule splits each "
                              "backward into one autograd call per group of weights, and a recomputed layer would run "
                              f"its forward again in each; use recompute with {listed(s for s in SCHEDULES.values() if s.recompute)}")
        if self.virtual_stages is not None and self.virtual_stages < 1:
            raise ConfigError(f"Pipeline(virtual_stages={self.virtual_stages}): need at least one stage per rank")
        if self.virtual_stages is not None and self.virtual_stages > 1:
            interleaving = [s for s in SCHEDULES.values() if s.interleaved]
            if named is not None and not named.interleaved:
                raise ConfigError(f"Pipeline(virtual_stages={self.virtual_stages}) runs several stages per rank: only "
                                  f"schedule={listed(interleaving)} does that, not {self.schedule!r}")
            named = named or interleaving[0]
            object.__setattr__(self, "schedule", named.name)
        if named is not None and named.interleaved and self.virtual_stages in (None, 1):
            object.__setattr__(self, "virtual_stages", named.virtual_stages)


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
    # a parameter read by several units (a tied embedding and head): (bytes, those units); each of
    # them counts it in static_bytes, a stage holding several of them holds it once
    shared_static: tuple = ()
    # held at the forward's peak once per stage, not per microbatch in flight (a loss's logits and
    # log-probabilities); None: nothing
    peak_bytes: np.ndarray | None = None

    def static_between(self, i: int, j: int) -> float:
        """What units i..j hold of state, a shared parameter once."""
        total = float(self.static_bytes[i:j + 1].sum())
        for nbytes, units in self.shared_static:
            total -= nbytes * max(0, sum(i <= u <= j for u in units) - 1)
        return total

    def held_between(self, i: int, j: int, state_share: float = 1.0) -> float:
        """What a stage of units i..j holds whatever its microbatches in flight: ``state_share`` of
        their state and what lives at the forward's peak, once."""
        peak = 0.0 if self.peak_bytes is None else float(self.peak_bytes[i:j + 1].sum())
        return self.static_between(i, j) * state_share + peak

    def recomputed(self) -> "UnitPrices":
        """These prices with every unit's activations recomputed in backward (as
        ``torch.utils.checkpoint`` per layer): the forward runs twice; per microbatch in flight a
        unit keeps only its input; while one unit's backward runs, its whole activations are
        live again (the largest unit's, held once per stage)."""
        peak = float(self.activation_bytes.max()) if len(self.activation_bytes) else 0.0
        return dataclasses.replace(self, per_microbatch_s=self.per_microbatch_s + self.forward_s,
                                   activation_bytes=self.boundary_bytes.copy(), recompute=True, stage_extra_bytes=peak)


@dataclasses.dataclass
class PipelineChoice:
    """The search's answer: ``pipeline`` (stages with their restricted intra-op plans) and how
    long the search took."""

    pipeline: PipelinePlan
    step_time_s: float
    graph: object  # the microbatch graph the stages were planned on
    search_s: float
    timing: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)  # what the search had to give up, and why

    @property
    def stages(self) -> list[StagePlan]:
        return self.pipeline.stages

    @property
    def microbatches(self) -> int:
        return self.pipeline.microbatches

    @property
    def schedule(self) -> str:
        return self.pipeline.schedule

    def summary(self) -> dict:
        out = self.to_plan().pipeline_summary()
        out["step_time_s"] = self.step_time_s
        return out

    def call_step_time_s(self) -> float:
        """The step of a call (``pmodel(...)`` then ``backward()``: ``runtime.pipeline_call``),
        which runs GPipe's order over every stage, each rank its stages in turn: this step with the
        schedule's own step from the stage times (``Schedule.step_time``) swapped for GPipe's."""
        p = self.pipeline
        times = [s.time_per_microbatch_s for s in p.stages]
        blocks = max(1, len(times) // p.virtual_stages)
        m = p.microbatches
        gpipe = sum(times) + (m - 1) * max(sum(times[b::blocks]) for b in range(blocks))
        schedule = schedule_named(p.schedule)
        if schedule.simulated:  # the simulated step, as the plan's bubble gives it
            core = m * max(times) / max(1e-12, 1.0 - p.bubble_fraction)
        else:
            core = schedule.step_time(times, m, p.virtual_stages)
        return float(self.step_time_s - core + gpipe)

    def to_plan(self) -> Plan:
        """A Plan holding these stages (see ``Plan.pipeline``)."""
        mesh_dict = self.stages[0].plan.mesh
        full_rows = max(s.rows[1] for s in self.stages) + 1
        mesh = dict(mesh_dict, shape=[full_rows, *mesh_dict["shape"][1:]])
        compute = sum(s.plan.predicted.get("compute_s", 0.0) for s in self.stages)
        predicted = {
            "step_time_s": self.step_time_s,
            "compute_s": compute * self.microbatches / max(1, len(self.stages) // self.pipeline.virtual_stages),
            "comm_s": 0.0,
            "memory_bytes_per_device": self.pipeline.memory_per_device(),
            "bubble_fraction": self.pipeline.bubble_fraction,
            "call_step_time_s": self.call_step_time_s(),
        }
        solver = {"status": "pipeline", "objective_s": self.step_time_s, "search_s": self.search_s, **self.timing}
        return Plan(self.graph.model_name, self.graph.fingerprint(), mesh, {}, [], {}, predicted, solver,
                    pipeline=self.pipeline)


# ---- units ---------------------------------------------------------------------------------------------
def unit_prices(plan, graph, mesh) -> UnitPrices:
    """Attribute a whole-graph intra-op plan's prices to the units (see the module docstring)."""
    cluster = mesh.resolved_cluster()
    unit = unit_of_nodes(graph)
    n = len(graph.layers)
    micro, step, static, act, boundary, forward, peak = (np.zeros(n) for _ in range(7))
    readers = node_readers(graph)
    crossing: set[tuple[str, int]] = set()
    unread = _unread_outputs(graph)
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
                shared.append((np_.memory_bytes, tuple(sorted(users))))
            for uu in users:  # a tied weight read at both ends is held by both stages
                static[uu] += np_.memory_bytes
                step[uu] += np_.compute_s - acc  # the optimizer's share
                micro[uu] += acc  # its gradient added up, every microbatch
        elif node.op == "call_function":
            micro[u] += np_.compute_s + cluster.op_overhead_s + cluster.backward_op_overhead_s
            forward[u] += np_.compute_s / 3 + cluster.op_overhead_s  # node compute is forward + 2x backward
            act[u] += np_.memory_bytes - np_.peak_bytes
            peak[u] += np_.peak_bytes
            if needs_lowering(np_.family):
                micro[u] += lowered_comm_s(np_.target, np_.family, np_.inputs, np_.output, mesh,
                                           counted_locally=counted_from_inputs(graph, node))
    for e in plan.edges:
        if e.dst in unit and (e.dst, e.position) not in unread:
            micro[unit[e.dst]] += e.cost_s
        src = graph.nodes[e.src]
        if src.op == "call_function" and e.src in unit and e.dst in unit and unit[e.src] < unit[e.dst]:
            # an activation read by a later unit crosses every boundary up to it, once, as the
            # shard each device of the sending stage holds
            nbytes = local_bytes(e.src_spec, mesh.shape, src.meta.itemsize) if hasattr(src.meta, "itemsize") else 0
            for b in range(unit[e.src] + 1, unit[e.dst] + 1):
                if (e.src, b) not in crossing:
                    crossing.add((e.src, b))
                    boundary[b] += nbytes
    for p in plan.params.values():
        if p.grad_sync is not None and p.node in unit:
            step[unit[p.node]] += p.grad_sync_s
    return UnitPrices(micro, step, static, act, boundary, plan, forward, shared_static=tuple(shared), peak_bytes=peak)


def _unread_outputs(graph) -> set[tuple[str, int]]:
    """(output node, position) of the outputs a pipelined step does not read: all but the loss
    (the last stage's program returns the loss alone, so their resharding to whole values never
    runs). Every output is read when there is no loss to find (nothing trains such a model pipelined)."""
    out = next(n for n in graph.nodes.values() if n.op == "output")
    try:
        loss = loss_position(graph)
    except ConfigError:
        return set()
    return {(out.name, i) for i in range(len(out.inputs)) if i != loss}


# ---- sub-meshes --------------------------------------------------------------------------------------------
def row_options(mesh: Mesh) -> list[int]:
    """Rows of axis 0 a stage may take: every count up to 8 rows, powers of two beyond."""
    rows = mesh.shape[0]
    return [k for k in range(1, rows + 1) if rows <= 8 or k & (k - 1) == 0 or k == rows]


def sub_mesh(mesh: Mesh, rows: int) -> Mesh:
    cluster = mesh.resolved_cluster().with_axis_links(mesh.links())
    return Mesh((rows, *mesh.shape[1:]), mesh.axis_names, cluster)


# ---- search ----------------------------------------------------------------------------------------------
def microbatch_candidates(batch: int, fixed: int | None, max_count: int = 512) -> list[int]:
    """Microbatch counts to try: those whose microbatch size is a power of two (it then splits
    evenly over power-of-two data-parallel degrees), ascending; a given count alone."""
    if fixed is not None:
        if batch % fixed:
            raise ConfigError(f"Pipeline(microbatches={fixed}) does not divide the batch of {batch}")
        return [fixed]
    sizes = [2 ** i for i in range(batch.bit_length()) if batch % 2 ** i == 0]
    return sorted({1} | {batch // b for b in sizes if batch // b <= max_count})


def batch_size(example_inputs, example_kwargs=None) -> int:
    """The batch: dim 0 of the first tensor input (what microbatches split)."""
    import torch

    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    tensors = [t for t in inputs + tuple((example_kwargs or {}).values()) if isinstance(t, torch.Tensor) and t.dim()]
    if not tensors:
        raise ConfigError("a pipeline splits the batch into microbatches: pass the batch as tensor inputs")
    return tensors[0].shape[0]


_IOTA_THROUGH = {"aten.unsqueeze.default", "aten.view.default", "aten.reshape.default", "aten.expand.default",
                 "aten._to_copy.default", "aten.to.dtype", "aten.to.device", "aten.clone.default"}


def _iota_args(size: int) -> dict:
    """target -> args of the aranges 0, 1, ..., size - 1."""
    return {"aten.arange.default": (size,), "aten.arange.start": (0, size), "aten.arange.start_step": (0, size, 1)}


def _iota_index_rows(graph, node, spec) -> int | None:
    """The output dim that carries the samples of ``aten.index.Tensor(x, indices)`` when ``x`` is
    split on one dim d (``spec``), the indices are the leading ones, and index d is an ``arange``
    over all of dim d (through views and casts: transformers' masks read ``mask[batch_arange,
    kv_arange]``), every other index unsplit. Each sample then reads its own row, and a
    microbatch, traced at its own size, indexes its rows with its own ``arange``. None otherwise."""
    if node.target != "aten.index.Tensor" or len(node.args) < 2 or not node.inputs:
        return None
    src = spec.get(node.inputs[0])
    indices = node.args[1]
    if not isinstance(src, ShardingSpec) or src.partial or not isinstance(indices, (list, tuple)):
        return None
    split = [d for d, axes in enumerate(src.dim_axes) if axes]
    if len(split) != 1 or split[0] >= len(indices) or any(i is None for i in indices):
        return None
    d = split[0]
    names = [getattr(i, "name", None) for i in indices]
    if None in names or any(spec.get(n) is not None for n in names):
        return None
    iota = graph.nodes[names[d]]
    while iota.target in _IOTA_THROUGH:
        iota = graph.nodes[iota.inputs[0]]
    size = src.shape[d]
    if _iota_args(size).get(iota.target) != tuple(iota.args):
        return None
    shape = tuple(graph.nodes[names[d]].meta.shape)
    broadcast = len(node.meta.shape) - (len(src.shape) - len(indices))  # the indices' broadcast dims lead the output
    if shape.count(size) != 1 or any(n not in (1, size) for n in shape) or len(shape) > broadcast:
        return None
    return broadcast - len(shape) + shape.index(size)


def batch_mixing(graph, batch: int) -> str | None:
    """Why splitting the inputs' dim 0 into microbatches would change the step, or None when it
    would not: the op where the samples of dim 0 meet (attention over a time-first sequence, batch
    norm's statistics, a loss term nonlinear in batch means), a loss that sums over dim 0 (a
    pipelined step averages its microbatches' losses), or a mean over class targets weighed by
    model state (``codegen.loss_weights`` weighs microbatches by their counts from the inputs).
    The sharding rules decide it: dim 0 split over a virtual axis must reach the outputs split, or
    as a pending mean, with no op needing the samples together."""
    from autopar.sharding_spec.rules import strategies_for
    from autopar.sharding_spec.strategy import OpContext

    out = next(n for n in graph.nodes.values() if n.op == "output")
    for mean in (m for name in out.inputs if name in graph.nodes for m in class_means(graph, name)[0]):
        state = state_weighing(graph, mean)
        if state is not None:  # microbatches count their targets apart (``codegen.loss_weights``)
            return f"{mean.target} ({mean.name}) averages over targets weighed by model state ({state})"
    parts = next(p for p in range(2, batch + 1) if batch % p == 0)
    mesh = Mesh((parts,))

    def plain(x):  # a spec that neither splits nor holds a pending sum is the same as none
        if isinstance(x, tuple):
            x = tuple(plain(e) for e in x)
            return None if all(e is None for e in x) else x
        return None if x is None or (not x.partial and not any(x.dim_axes)) else x

    def reads(want, held) -> bool:
        """A strategy reads an input as it is held; a value the split does not reach (a parameter
        expanded to the batch) may be read split too: each microbatch makes its own slice."""
        if held is None:
            return not any(isinstance(w, ShardingSpec) and w.partial for w in (want if isinstance(want, tuple) else (want,)))
        return plain(want) == held

    spec, kind = {}, {}  # node -> its spec under the split; pending sums: "mean" or "sum"
    for node in graph.nodes.values():
        meta = node.meta
        if node.op == "placeholder":
            if node.role == Role.INPUT and getattr(meta, "shape", None) and meta.shape[0] == batch:
                spec[node.name] = ShardingSpec(meta.shape, ((0,),) + ((),) * (len(meta.shape) - 1), (), 1)
            continue
        have = [spec.get(i) for i in node.inputs]
        if node.target == "operator.getitem" and isinstance(have[0], tuple):  # it reads element i
            have[0] = plain(have[0][node.args[1]])
        if node.op == "output":
            for name, x in zip(node.inputs, have):
                if isinstance(x, ShardingSpec) and x.partial and kind.get(name) != "mean":
                    return f"the output {name} sums over dim 0 (a pipelined step averages its microbatches' losses)"
            continue
        if node.op != "call_function" or not any(x is not None for x in have):
            continue
        rows = _iota_index_rows(graph, node, spec)
        if rows is not None:  # x[arange(b)[:, None], ...]: each sample reads its own row
            spec[node.name] = ShardingSpec(node.meta.shape, tuple((0,) if d == rows else () for d in range(len(node.meta.shape))),
                                           (), 1)
            continue
        ctx = OpContext(node, mesh, [graph.nodes[i].meta for i in node.inputs], graph)
        pending = {kind[i] for i, x in zip(node.inputs, have) if isinstance(x, ShardingSpec) and x.partial}
        match = next((st for st in strategies_for(ctx) if all(reads(w, h) for w, h in zip(list(st.inputs) + [None] * len(have), have))),
                     None)
        if match is None or len(pending) > 1:
            where = f" in {node.module_path}" if node.module_path else ""
            return f"{node.target} ({node.name}{where}) reads the samples of dim 0 together"
        out = plain(match.output)
        if out is not None:
            spec[node.name] = out
            if isinstance(out, ShardingSpec) and out.partial:
                kind[node.name] = pending.pop() if pending else ("mean" if "(mean)" in match.family else "sum")
    return None


def microbatch_inputs(example_inputs, example_kwargs, count: int):
    """One microbatch of the example inputs: every tensor whose dim 0 is the batch, cut to
    ``batch // count`` rows (others, like a shared mask, whole)."""
    import torch

    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    batch = batch_size(inputs, example_kwargs)

    def cut(t):
        return t[: batch // count] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t

    return tuple(cut(t) for t in inputs), {k: cut(v) for k, v in (example_kwargs or {}).items()}


def search(model, mesh: Mesh, example_inputs, example_kwargs=None, *, pipeline: Pipeline | None = None,
           memory_budget: float | None = None, plan_kwargs: dict | None = None, tolerance: float = 0.01,
           equal_stages: bool = True) -> PipelineChoice:
    """The fastest pipeline for ``model`` on ``mesh`` within ``memory_budget`` bytes per device.
    ``equal_stages``: every stage takes as many rows (what torch's schedules run: each rank talks
    to one rank per stage); False lets the DP size each stage on its own, as Alpa does."""
    pipeline = pipeline or Pipeline()
    t0 = time.perf_counter()
    plan_kwargs = dict(plan_kwargs or {})
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    batch = batch_size(inputs, example_kwargs)
    budget = math.inf if memory_budget is None else float(memory_budget)
    schedules = [schedule_named(pipeline.schedule)] if pipeline.schedule else list(SEARCHED)
    options = row_options(mesh)
    contention = mesh.resolved_cluster().rank_contention
    if equal_stages:  # only stage sizes that tile the rows (and give the fixed stage count)
        options = [k for k in options if mesh.shape[0] % k == 0 and pipeline.stages in (None, mesh.shape[0] // k)]
        if not options:
            rows = mesh.shape[0]
            fits = [rows // k for k in row_options(mesh) if rows % k == 0]
            raise ConfigError(f"Pipeline(stages={pipeline.stages}) cuts the mesh's first axis ({rows} rows) into "
                              f"{pipeline.stages} equal stages, which {rows} rows do not divide into: use stages in "
                              f"{sorted(fits)}, or a mesh whose first axis has a multiple of {pipeline.stages} rows")
    timing = {"trace_s": 0.0, "intra_op_s": 0.0, "dp_s": 0.0, "traces": 0, "scaled_graphs": 0}
    results: dict[int, tuple | None] = {}
    graphs: dict[int, object] = {}
    real: list[int] = []  # the counts whose graph was traced (the others were scaled from two of them)

    def trace(count: int):
        t0 = time.perf_counter()
        micro_in, micro_kw = microbatch_inputs(inputs, example_kwargs, count)
        graph = trace_graph(model, micro_in, micro_kw or None)
        timing["trace_s"] += time.perf_counter() - t0
        timing["traces"] += 1
        real.append(count)
        return graph

    def traced(count: int):
        """The graph at the microbatch shape of ``count`` microbatches (one microbatch: the whole
        batch, which the batch-independence check reads too): traced for the first two counts,
        then read off two traces where that holds (``ir.batch_scaling``; a trace costs seconds)."""
        if count not in graphs:
            t0 = time.perf_counter()
            scaled = (scaled_graph(graphs[real[0]], batch // real[0], graphs[real[1]], batch // real[1], batch // count)
                      if len(real) >= 2 else None)
            timing["trace_s"] += time.perf_counter() - t0
            if scaled is not None:
                timing["scaled_graphs"] += 1
            graphs[count] = scaled if scaled is not None else trace(count)
        return graphs[count]

    def best_stages(variants, count: int, graph):
        """The stage DP over ``variants`` for every schedule: (solution, count, schedule, variants,
        graph, groups) of the fastest, or None when nothing fits."""
        t_dp = time.perf_counter()
        found = None
        tables: dict[tuple, tuple] = {}  # group sizes -> (groups, grouped variants, time, memory, activations)

        def tables_for(stage_count: int | None):
            """The stage tables on units fit for ``stage_count`` stages (``unit_groups``)."""
            groups = unit_groups(len(graph.layers), stage_count, pipeline.layers)
            key = tuple(map(len, groups))
            if key not in tables:
                grouped = [(rows, _grouped(p, groups)) for rows, p in variants]
                time_t, mem_t, act_t = _tables(grouped, len(groups), count, mesh)
                if pipeline.layers is not None:
                    time_t = _fixed_cuts(time_t)
                tables[key] = (groups, grouped, time_t, mem_t, act_t)
            return tables[key]

        if not variants:
            return None
        shared = multi_unit_params(graph)
        devices = np.array([rows for rows, _ in variants])
        recomputed = np.array([p.recompute for _, p in variants])
        for schedule in schedules:
            if schedule.interleaved and pipeline.virtual_stages == 1:
                continue  # searched (Pipeline refuses the pair when asked for): one stage per rank was asked for
            virtual = schedule.stages_per_rank(pipeline.virtual_stages)
            if virtual > 1 and not equal_stages:
                if pipeline.schedule is None:
                    continue  # searched, not asked for: it needs equal stages
                raise ConfigError("interleaved 1F1B places several equal stages on each rank: plan it with equal_stages")
            for keep, counts in _stage_shapes(devices, mesh.shape[0], pipeline.stages, equal_stages):
                groups, grouped, time_t, mem_t, act_t = tables_for(
                    next(iter(counts)) * virtual if counts is not None and len(counts) == 1 else None)
                if not schedule.recompute:  # (see Pipeline)
                    keep = keep & ~recomputed
                if not keep.any():
                    continue
                # the stage counts (of ranks) torch's schedule class runs ``count`` microbatches over
                counts = {c for c in (counts or range(1, mesh.shape[0] + 1)) if schedule.takes(c, count)}
                if not counts:
                    continue
                if virtual > 1:  # v stages per rank: the DP cuts p * v stages on v copies of the rows
                    counts = {c * virtual for c in counts}
                sol = solve_stages(time_t[:, :, keep], devices[keep], mesh.shape[0] * virtual, count,
                                   mem=mem_t[:, :, keep], act=act_t[:, :, keep], budget=budget / virtual,
                                   schedule=schedule.name, stage_counts=counts, tolerance=tolerance)
                if sol is not None and virtual == 1 and not _fits_inflight(
                        sol, mem_t[:, :, keep], act_t[:, :, keep], schedule, count, budget):
                    sol = None
                if sol is not None:  # the schedule's own step (the DP's objective is GPipe's and 1F1B's)
                    sol.step_time = schedule.step_time(sol.stage_times, count, virtual)
                if sol is not None:
                    kept = np.flatnonzero(keep)  # the DP's variant index -> the variants list's
                    per_step = [count * grouped[kept[m]][1].per_step_s[i:j + 1].sum() for i, j, m in sol.stages]
                    sol.step_time = shared_core_time(sol, devices[keep], count, contention, mesh.shape[0], schedule,
                                                     per_step)
                    sol.step_time += step_extras(graph, groups, sol.stages, len(sol.stages) // virtual, mesh, shared)
                    if found is None or sol.step_time < found[0].step_time - 1e-15:
                        sol.stages = [(i, j, int(kept[m])) for i, j, m in sol.stages]
                        found = (sol, count, schedule, variants, graph, groups)
        timing["dp_s"] += time.perf_counter() - t_dp
        return found

    def evaluate(count: int):
        """The best stages for ``count`` microbatches: (solution, count, schedule, variants,
        graph, groups), or None when nothing fits."""
        if count in results:
            return results[count]
        t_trace = time.perf_counter()
        try:
            graph = traced(count)
        except TraceError as err:  # this microbatch size is not a call the model takes
            log.info("%d microbatches: the microbatch does not trace (%s)", count, str(err).splitlines()[0])
            results[count] = None
            return None
        t_ilp = time.perf_counter()
        unit_of_nodes(graph)  # a graph without layers cannot be cut: PlanError
        unit_groups(len(graph.layers), None, pipeline.layers)  # fixed layers must cover the model: ConfigError
        variants, lean = [], []  # (rows, UnitPrices); (rows, the fastest's prices) where it does not fit

        def add(rows: int, p: UnitPrices):
            if pipeline.recompute is not True:
                variants.append((rows, p))
            if pipeline.recompute is not False:  # None: both, the DP chooses per stage
                variants.append((rows, p.recomputed()))

        kwargs = {**plan_kwargs, "microbatches": count}
        for rows in options:
            if equal_stages and mesh.shape[0] // rows > len(graph.layers):
                continue  # more stages of this size than layers
            share = rows / mesh.shape[0] if equal_stages else None  # of the layers a stage holds
            fastest = _fastest(model, sub_mesh(mesh, rows), graph, plan_one_stage, kwargs)
            if fastest is not None:
                add(rows, fastest)
                if _held_bytes(fastest, share) > budget:
                    lean.append((rows, fastest))
        timing["intra_op_s"] += time.perf_counter() - t_ilp
        found = best_stages(variants, count, graph)
        if lean:
            # Leaner plans of the sub-meshes whose fastest does not fit, each cut off where it could
            # not beat the pipeline found: a stage on 1 / s of the rows runs at least 1 / s of the
            # whole graph's work per microbatch (busy ranks sharing cores at most c times faster)
            t_ilp = time.perf_counter()
            before = len(variants)
            for rows, fastest in lean:
                cutoff = (found[0].step_time * max(1.0, contention) * mesh.shape[0] / (rows * count)
                          if found is not None and equal_stages else None)
                for p in _leaner(model, sub_mesh(mesh, rows), graph, plan_one_stage, kwargs, fastest, cutoff):
                    add(rows, p)
            timing["intra_op_s"] += time.perf_counter() - t_ilp
            if len(variants) > before:
                found = best_stages(variants, count, graph)
        results[count] = found
        log.info("pipeline search, %d microbatches: %s (%d sub-mesh options, %.1f s)", count,
                 "nothing fits" if found is None else
                 f"{len(found[0].stages)} stage(s), {found[2]}, step {found[0].step_time:.3g} s",
                 len(variants), time.perf_counter() - t_trace)
        return found

    counts = microbatch_candidates(batch, pipeline.microbatches)
    notes: list[str] = []
    if counts != [1]:
        probe = _mixing_probe(counts, batch, inputs, example_kwargs)
        try:
            why = batch_mixing(traced(probe), batch // probe)
        except TraceError as err:  # a microbatch of the inputs is not a call the model takes
            why = f"a microbatch of the inputs does not trace ({str(err).splitlines()[0]})"
        if why is not None:
            if pipeline.microbatches is not None:
                raise ConfigError(f"Pipeline(microbatches={pipeline.microbatches}) splits the inputs' dim 0 into "
                                  f"microbatches, but it is not a batch of independent samples here: {why}. Use "
                                  "microbatches=1, or pipeline=False")
            log.info("one microbatch only: %s", why)
            notes.append(f"one microbatch: {why}")
            counts = [1]
    best = _search_counts(counts, evaluate)
    while best is not None and best[1] not in real:
        # The chosen count's graph was scaled: trace it, as parallelize will. The same program
        # keeps its plan; another one (the model is not linear in the batch there) is priced again.
        count = best[1]
        graph = trace(count)
        if graph.fingerprint() == graphs[count].fingerprint():
            graphs[count] = graph
            best = results[count] = (*best[:4], graph, *best[5:])
        else:
            graphs[count] = graph
            del results[count]
            evaluate(count)
            best = min((r for r in results.values() if r is not None), key=lambda r: r[0].step_time, default=None)
    if best is None:
        why = (f"fits {memory_budget} bytes per device" if memory_budget is not None else
               "can be planned (a forced layout must fit each stage's devices and the microbatch; stages must tile the mesh rows)")
        raise PlanError(f"no pipeline of {type(model).__name__} on {mesh} {why}: stage counts, sub-meshes of "
                        f"{options} rows and microbatch counts {sorted(results)} tried")
    sol, count, schedule, variants, graph, groups = best
    unit = unit_of_nodes(graph)
    stages, row = [], 0
    per_row = math.prod(mesh.shape[1:])
    virtual = schedule.stages_per_rank(pipeline.virtual_stages)
    blocks = len(sol.stages) // virtual  # ranks of the pipeline (stage s runs on block s mod blocks)
    for (gi, gj, m), t in zip(sol.stages, sol.stage_times):
        i, j = groups[gi][0], groups[gj][-1]
        rows, prices = variants[m]
        if virtual > 1:
            row = (len(stages) % blocks) * rows
        inflight = schedule.inflight(len(stages) % blocks, blocks, count)
        mem = prices.held_between(i, j) + inflight * prices.activation_bytes[i:j + 1].sum() + prices.stage_extra_bytes
        nodes = {name for name, u in unit.items() if i <= u <= j}
        if not stages:  # state nothing reads is held by the first stage (as codegen's cut_stages holds it)
            nodes |= {n for n, node in graph.nodes.items()
                      if node.op == "placeholder" and node.role != Role.INPUT and not node.users}
        sub = restrict(prices.plan, graph, nodes, t, float(mem), budget)
        stages.append(StagePlan((i, j), (graph.layers[i], graph.layers[j]), (row, row + rows - 1),
                                list(range(row * per_row, (row + rows) * per_row)), (rows, *mesh.shape[1:]),
                                t, float(mem), sub, list(range(i, j + 1)) if prices.recompute else []))
        row += rows
    stages = [dataclasses.replace(s, received=edges) for s, edges in zip(stages, received_edges(graph, stages))]
    return PipelineChoice(PipelinePlan(schedule.name, count, stages, virtual), sol.step_time, graph, time.perf_counter() - t0,
                          timing, notes)


def restrict(plan: Plan, graph, nodes: set[str], time_s: float, memory: float, budget: float | None = None) -> Plan:
    """``plan`` (a whole-graph plan on a stage's sub-mesh) cut to the nodes the stage runs: those
    nodes, the parameters and inputs they read, the edges between them."""
    readers = node_readers(graph)
    keep = set(nodes) | {src for n in nodes for src in graph.nodes[n].inputs if graph.nodes[src].op == "placeholder"}
    keep |= {n for n in nodes if graph.nodes[n].op == "placeholder" and any(r in nodes for r in readers.get(n, ()))}
    node_plans = {k: v for k, v in plan.nodes.items() if k in keep}
    edges = [e for e in plan.edges if e.src in keep and e.dst in keep]
    params = {k: v for k, v in plan.params.items() if v.node in keep}
    compute = sum(v.compute_s for k, v in node_plans.items() if graph.nodes[k].op == "call_function")
    predicted = {"step_time_s": time_s, "compute_s": compute, "comm_s": max(0.0, time_s - compute),
                 "memory_bytes_per_device": memory}
    solver = dict(plan.solver, memory_budget=None if budget is None or math.isinf(budget) else budget)
    return Plan(plan.model_name, plan.model_fingerprint, plan.mesh, node_plans, edges, params, predicted,
                solver, idle_axes=plan.idle_axes)


def _fixed_cuts(time_t: np.ndarray) -> np.ndarray:
    """``time_t`` on units that are the given stages (``unit_groups``): every stage of more than
    one unit ruled out."""
    out = np.full_like(time_t, math.inf)
    diag = np.arange(time_t.shape[0])
    out[diag, diag] = time_t[diag, diag]
    return out


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
    tied embedding and head) summed over them (an all-reduce of its whole gradient). Both cross
    the mesh's first axis. 0 for one stage. ``shared``: ``multi_unit_params(graph)``."""
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


def _fits_inflight(sol, mem_t: np.ndarray, act_t: np.ndarray, schedule: Schedule, count: int, budget: float) -> bool:
    """Every stage of the DP's answer (one stage per rank) within ``budget`` with the microbatches
    the schedule holds in flight there: the DP counted each stage as the first of those from it
    to the end, short of zero bubble's count (``Schedule.inflight``)."""
    p = len(sol.stages)
    return all(mem_t[i, j, m] + schedule.inflight(pos, p, count) * act_t[i, j, m] <= budget
               for pos, (i, j, m) in enumerate(sol.stages))


def shared_core_time(sol, devices: np.ndarray, count: int, contention: float, total_rows: int,
                     schedule: Schedule | str = "1f1b", per_step=None) -> float:
    """A pipeline's step time where ranks share CPU cores (``rank_contention`` c > 1: an op runs c
    times slower while every rank computes). Stage prices assume every rank busy; in a pipeline
    fewer are at times (fill, drain, a stage waiting for its neighbour), and the busy ones run
    faster. So the schedule is simulated (``simulate_shared``): each stage runs its microbatches'
    tasks in the schedule's order, and the busy ranks share the host's capacity (``total_rows / c``
    ranks' worth of full speed). ``per_step``: what each stage pays once per step (gradient sync,
    optimizer; the DP spreads it over the microbatches): on shared cores it runs after the
    schedule, every rank at once, so it joins the simulated step as the slowest stage's, at the
    all-busy price (measured on the 10M GPT and LLaMA, 2 stages x dp2: 1F1B priced 2-4% off its
    step this way, 5-12% under with it spread and sped up with the tasks). At c = 1 (a device per
    rank), and for interleaved schedules (which the simulation does not order), ``sol.step_time``:
    the schedule's own step (``Schedule.step_time``)."""
    schedule = schedule_named(schedule)
    if contention <= 1.0 or schedule.interleaved:
        return sol.step_time
    c, capacity = contention, total_rows / contention
    rows = [int(devices[m]) for _, _, m in sol.stages]
    tail = [float(x) for x in per_step] if per_step is not None else [0.0] * len(sol.stages)
    alone = [(t - once / count) / c for t, once in zip(sol.stage_times, tail)]
    return simulate_shared(alone, rows, count, schedule, capacity) + max(tail)


def _stage_shapes(devices: np.ndarray, rows: int, stages: int | None, equal: bool):
    """(variant mask, allowed stage counts) pairs the DP runs: all variants and any count, or per
    stage size ``k`` (dividing ``rows``) the variants of ``k`` rows and ``rows // k`` stages."""
    if not equal:
        yield np.ones(len(devices), dtype=bool), ({stages} if stages else None)
        return
    for k in sorted(set(devices.tolist())):
        if rows % k == 0 and (stages is None or stages == rows // k):
            yield devices == k, {rows // k}


def _mixing_probe(counts: list[int], batch: int, inputs, kwargs) -> int:
    """The microbatch count whose graph ``batch_mixing`` reads: the one ``_search_counts``
    evaluates first, so that no graph is traced for the check alone. The whole batch (1) when that
    microbatch holds one sample (nothing to split) or when an input that is not cut has as many
    rows as it (the check could not tell them apart)."""
    import torch

    count = counts[(len(counts) - 1) // 3] if len(counts) > 3 else counts[0]
    rows = batch // count
    uncut = {t.shape[0] for t in (*inputs, *(kwargs or {}).values())
             if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] != batch}
    return 1 if rows < 2 or rows in uncut else count


def _search_counts(counts: list[int], evaluate):
    """The best result over ``counts`` (ascending), evaluating few of them: a ternary search that
    assumes the step time falls, then rises, with the microbatch count (a bigger count shrinks the
    bubble but runs smaller, less efficient microbatches), and treats a count where nothing fits as
    too few (activations of bigger microbatches)."""
    def value(i):
        r = evaluate(counts[i])
        return math.inf if r is None else r[0].step_time

    lo, hi = 0, len(counts) - 1
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        v1, v2 = value(m1), value(m2)
        if math.isinf(v1) and math.isinf(v2):
            lo = m1 + 1
        elif v1 <= v2:
            hi = m2 - 1 if v1 < v2 else m2
        else:
            lo = m1 + 1
    found = [evaluate(counts[i]) for i in range(lo, hi + 1)]
    found = [r for r in found if r is not None]
    return min(found, key=lambda r: r[0].step_time) if found else None


def layer_groups(n_layers: int, units: int) -> list[list[int]]:
    """Consecutive layers in ``min(units, n_layers)`` groups whose sizes differ by at most one (the
    longer ones first)."""
    units = max(1, min(units, n_layers))
    size, extra = divmod(n_layers, units)
    out, start = [], 0
    for g in range(units):
        n = size + (g < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


def unit_groups(n_layers: int, stages: int | None, layers: tuple[int, ...] | None = None) -> list[list[int]]:
    """The units the stage DP cuts between. Fixed ``layers`` per stage: those stages. Otherwise at
    most ``MAX_UNITS`` groups of consecutive layers (Alpa clusters layers too, to bound the DP),
    and for a known stage count a multiple of it, so that equal stages exist: 96 layers in 16
    stages are 16 units of 6 layers, in 8 stages 24 units of 4."""
    if layers is not None:
        if sum(layers) != n_layers:
            raise ConfigError(f"Pipeline(layers={layers}) covers {sum(layers)} layers; the model has {n_layers}")
        starts = np.concatenate([[0], np.cumsum(layers)])
        return [list(range(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:])]
    if stages is None or stages > n_layers:
        return layer_groups(n_layers, MAX_UNITS)
    return layer_groups(n_layers, stages * max(1, MAX_UNITS // stages))


def _grouped(p: UnitPrices, groups) -> UnitPrices:
    """Per-layer prices summed per group; a group receives what its first layer receives."""
    def total(a):
        return np.asarray([a[g].sum() for g in groups])

    group_of = {u: k for k, g in enumerate(groups) for u in g}
    return UnitPrices(total(p.per_microbatch_s), total(p.per_step_s), total(p.static_bytes),
                      total(p.activation_bytes), np.asarray([p.boundary_bytes[g[0]] for g in groups]), p.plan,
                      total(p.forward_s), p.recompute, p.stage_extra_bytes,
                      tuple((b, tuple(group_of[u] for u in units)) for b, units in p.shared_static),
                      None if p.peak_bytes is None else total(p.peak_bytes))


def _fastest(model, sm, graph, intra_op_plan, plan_kwargs) -> UnitPrices | None:
    """The prices of the fastest intra-op plan on sub-mesh ``sm``; None where there is no plan (or
    a forced layout does not fit it)."""
    try:
        return unit_prices(intra_op_plan(model, sm, graph=graph, memory_budget=None, **plan_kwargs), graph, sm)
    except (PlanError, ConfigError):
        return None


def _held_bytes(p: UnitPrices, share: float | None) -> float:
    """What a stage of plan ``p`` holds: ``share`` of the layers' state (stages equal; None: the whole
    plan's peak, a bound) and at most one microbatch of every layer's activations in flight (1F1B)."""
    if share is None:
        return p.plan.predicted["memory_bytes_per_device"]
    return p.held_between(0, len(p.static_bytes) - 1, share) + p.activation_bytes.sum()


def _leaner(model, sm, graph, intra_op_plan, plan_kwargs, fastest: UnitPrices, cutoff_s: float | None):
    """Leaner intra-op plans on ``sm`` than ``fastest`` (tighter memory budgets, no idle axes, a
    short time limit), each costing under ``cutoff_s`` per microbatch (None: no cutoff)."""
    out = [fastest]
    memory = fastest.plan.predicted["memory_bytes_per_device"]
    lean_kwargs = {**plan_kwargs, "idle_axes": (), "time_limit_s": min(plan_kwargs.get("time_limit_s", 2.0), 2.0),
                   "objective_cutoff_s": cutoff_s}
    for fraction in MEMORY_VARIANTS:
        try:
            lean = intra_op_plan(model, sm, graph=graph, memory_budget=memory * fraction, **lean_kwargs)
        except PlanError:
            break
        if lean.predicted["memory_bytes_per_device"] >= out[-1].plan.predicted["memory_bytes_per_device"] * 0.95:
            continue
        out.append(unit_prices(lean, graph, sm))
    return out[1:]


def _tables(variants, n_units, count, mesh):
    """(time, static memory, activation memory) per (first unit, last unit, variant)."""
    n_opt = len(variants)
    time_t = np.full((n_units, n_units, n_opt), math.inf)
    mem_t = np.zeros_like(time_t)
    act_t = np.zeros_like(time_t)
    link = mesh.links()[0]
    call_s = mesh.resolved_cluster().collective_overhead_s  # a send reached from compute, as a collective
    for m, (rows, p) in enumerate(variants):
        per_unit = p.per_microbatch_s + p.per_step_s  # per-step prices are already 1 / count (plan(microbatches=))
        c_time, c_act = (np.concatenate([[0.0], np.cumsum(a)]) for a in (per_unit, p.activation_bytes))
        for i in range(n_units):
            # the activation entering the stage (forward) and its gradient leaving it (backward)
            recv = 0.0 if i == 0 else 2 * (link.alpha + call_s + p.boundary_bytes[i] * link.beta)
            j = np.arange(i, n_units)
            time_t[i, i:, m] = c_time[j + 1] - c_time[i] + recv
            mem_t[i, i:, m] = [p.held_between(i, jj) + p.stage_extra_bytes for jj in j]
            act_t[i, i:, m] = c_act[j + 1] - c_act[i]
    return time_t, mem_t, act_t
