"""Pipeline search: which layers run on which sub-mesh, how many microbatches, which schedule.

The orchestration around the stage DP (``autopar.solver.stage_dp``), in the style of Alpa's stage
construction:

1. **Units.** The traced graph's layers (``graph.layers``) in order; the nodes before the first
   layer (embeddings) join the first stage, the nodes after the last (final norm, head, loss) the
   last stage. Tied parameters used at both ends are held by both. More than ``MAX_UNITS`` layers
   are cut only between groups of consecutive layers (``unit_groups``).
2. **Sub-meshes.** A stage runs on a block of consecutive rows of the mesh's slowest axis (axis 0):
   ``k`` rows form a sub-mesh of shape ``(k, *rest)`` with the parent's links, so a (4,) mesh offers
   1-4 devices per stage and a (128, 8) mesh blocks of whole nodes (``k`` a power of two there).
3. **Stage prices** (``autopar.solver.stage_prices``): for each microbatch count, per sub-mesh,
   the intra-op ILP's plan of the whole graph attributed to the units, then the DP's tables. The
   leaner plans of a sub-mesh whose fastest does not fit are solved after a first DP over the
   fastest, cut off where they could not beat the step it found (a stage on 1 / s of the rows runs
   at least 1 / s of the work).
4. **Search.** The DP per (microbatch count, schedule: ``autopar.cost_model.schedules``), then the
   best step time; a one-stage result is the plain intra-op plan. Microbatch counts
   (``autopar.solver.microbatches``): those whose microbatch is a power of two (a given count is
   fixed), searched as a ternary search over the step time (``_search_counts``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import NamedTuple

import numpy as np

from autopar.cost_model.schedules import fill_drain_time, simulate_shared, step_time
from autopar.record.recompute import Recompute
from autopar.record.schedules import SEARCHED, Schedule, schedule_named
from autopar.errors import ConfigError, PlanError, TraceError
from autopar.ir import trace as trace_graph
from autopar.ir.batch_scaling import scaled_graph
from autopar.ir.blocks import node_readers, unit_of_nodes
from autopar.ir.graph import Role
from autopar.sharding_spec.mesh import Mesh
from autopar.solver.config import Pipeline, PlanConfig
from autopar.solver.intra_op import plan_one_stage
from autopar.solver.mesh_views import narrower_views
from autopar.solver.microbatches import batch_mixing, batch_size, microbatch_candidates, microbatch_inputs, mixing_probe
from autopar.solver.plan import PipelinePlan, Plan, StagePlan
from autopar.solver.receives import received_edges
from autopar.solver.stage_dp import StageSolution, solve_stages
from autopar.solver.stage_prices import (
    UnitPrices, fastest_prices, grouped_prices, held_bytes, leaner_prices, multi_unit_params, stacked_tables, step_extras,
    variant_tables,
)

log = logging.getLogger(__name__)

WIDEN_MARGIN = 0.05  # counts whose best stages are within this of the best are widened too (``_Search.best``)
MAX_UNITS = 24  # more layers than this are cut only between groups of consecutive layers (``unit_groups``)




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
    mesh: Mesh | None = None  # the mesh searched (a stage's own may view its devices otherwise)
    # the whole batch's graph where the search holds it without a trace: traced (``whole_traced``),
    # or read off two traces (``ir.batch_scaling``); None: not without tracing it
    whole: object | None = None
    whole_traced: bool = False

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
        schedule's own step from the stage times (``autopar.cost_model.schedules.step_time``) swapped for GPipe's."""
        p = self.pipeline
        times = [s.time_per_microbatch_s for s in p.stages]
        blocks = max(1, len(times) // p.virtual_stages)
        m = p.microbatches
        gpipe = fill_drain_time(times, m, blocks)
        schedule = schedule_named(p.schedule)
        if schedule.simulated:  # the simulated step, as the plan's bubble gives it
            core = m * max(times) / max(1e-12, 1.0 - p.bubble_fraction)
        else:
            core = step_time(schedule, times, m, p.virtual_stages)
        return float(self.step_time_s - core + gpipe)

    def to_plan(self) -> Plan:
        """A Plan holding these stages (see ``Plan.pipeline``)."""
        if self.mesh is not None:
            mesh = self.mesh.to_dict()
        else:
            mesh_dict = self.stages[0].plan.mesh
            mesh = dict(mesh_dict, shape=[max(s.rows[1] for s in self.stages) + 1, *mesh_dict["shape"][1:]])
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
                    pipeline=self.pipeline, precision=self.stages[0].plan.precision)


# ---- units and sub-meshes -------------------------------------------------------------------------------
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


def row_options(mesh: Mesh) -> list[int]:
    """Rows of axis 0 a stage may take: every count up to 8 rows, powers of two beyond."""
    rows = mesh.shape[0]
    return [k for k in range(1, rows + 1) if rows <= 8 or k & (k - 1) == 0 or k == rows]


def sub_mesh(mesh: Mesh, rows: int) -> Mesh:
    cluster = mesh.resolved_cluster().with_axis_links(mesh.links())
    return Mesh((rows, *mesh.shape[1:]), mesh.axis_names, cluster)


def _stage_rows(mesh: Mesh, stages: int | None, equal: bool) -> list[int]:
    """Rows a stage may take (``row_options``); with equal stages only those that tile the mesh's
    rows (and give ``stages`` stages, where given)."""
    options = row_options(mesh)
    if not equal:
        return options
    rows = mesh.shape[0]
    options = [k for k in options if rows % k == 0 and stages in (None, rows // k)]
    if not options:
        fits = [rows // k for k in row_options(mesh) if rows % k == 0]
        raise ConfigError(f"Pipeline(stages={stages}) cuts the mesh's first axis ({rows} rows) into "
                          f"{stages} equal stages, which {rows} rows do not divide into: use stages in "
                          f"{sorted(fits)}, or a mesh whose first axis has a multiple of {stages} rows")
    return options


def _stage_shapes(devices: np.ndarray, rows: int, stages: int | None, equal: bool):
    """(variant mask, allowed stage counts) pairs the DP runs: all variants and any count, or per
    stage size ``k`` (dividing ``rows``) the variants of ``k`` rows and ``rows // k`` stages."""
    if not equal:
        yield np.ones(len(devices), dtype=bool), ({stages} if stages else None)
        return
    for k in sorted(set(devices.tolist())):
        if rows % k == 0 and (stages is None or stages == rows // k):
            yield devices == k, {rows // k}


def _fixed_cuts(time_t: np.ndarray) -> np.ndarray:
    """``time_t`` on units that are the given stages (``unit_groups``): every stage of more than
    one unit ruled out."""
    out = np.full_like(time_t, math.inf)
    diag = np.arange(time_t.shape[0])
    out[diag, diag] = time_t[diag, diag]
    return out


# ---- the DP's answer under a schedule -------------------------------------------------------------------
class StageMemory(NamedTuple):
    """A stage's memory per (first unit, last unit, variant) (``stacked_tables``): what it holds for
    good, per microbatch in flight, per microbatch whose weight half it defers, per microbatch of
    the step (receive buffers), and what it holds less where it runs its forwards first."""

    static: np.ndarray
    activations: np.ndarray
    deferred: np.ndarray
    received: np.ndarray
    overlap: np.ndarray

    def kept(self, keep) -> "StageMemory":
        return StageMemory(*(a[:, :, keep] for a in self))

    def held_for_good(self, count: int, schedule: Schedule, virtual: int = 1) -> np.ndarray:
        """What the DP counts a stage to hold besides its microbatches in flight: its state and
        the step's receive buffers, less the overlap where every stage runs its forwards first
        (``_fits_inflight`` checks each stage's own)."""
        static = self.static + count * self.received
        return static - self.overlap if schedule.forwards_first(0, 1, count, virtual) else static

    def at(self, i: int, j: int, m: int, stage: int, blocks: int, count: int, schedule: Schedule,
           virtual: int = 1) -> float:
        """Bytes of the stage of units i..j (variant m), stage ``stage`` in pipeline order on
        ``blocks`` blocks of ranks (``virtual`` stages each) under ``schedule``."""
        first = schedule.forwards_first(stage, blocks, count, virtual)
        return float(self.static[i, j, m] + schedule.held_inflight(stage, blocks, count, virtual) * self.activations[i, j, m]
                     + schedule.deferred(stage % blocks, blocks, count) * self.deferred[i, j, m]
                     + count * self.received[i, j, m] - (self.overlap[i, j, m] if first else 0.0))


def _fits_inflight(sol, memory: StageMemory, schedule: Schedule, count: int, budget: float, virtual: int = 1) -> bool:
    """Every block of ranks of the DP's answer within ``budget``, its stages holding the
    microbatches the schedule holds in flight there (``Schedule.held_inflight``: torch's
    interleaved order replayed where a block runs several) and their deferred weight halves
    (``Schedule.deferred``). The DP counted each stage as the first of those from it to the end,
    short of zero bubble's count, and an interleaved one against the budget over its stages."""
    blocks = len(sol.stages) // virtual
    held = [0.0] * blocks
    for s, (i, j, m) in enumerate(sol.stages):
        held[s % blocks] += memory.at(i, j, m, s, blocks, count, schedule, virtual)
    return all(h <= budget for h in held)


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
    the schedule's own step (``autopar.cost_model.schedules.step_time``)."""
    schedule = schedule_named(schedule)
    if contention <= 1.0 or schedule.interleaved:
        return sol.step_time
    c, capacity = contention, total_rows / contention
    rows = [int(devices[m]) for _, _, m in sol.stages]
    tail = [float(x) for x in per_step] if per_step is not None else [0.0] * len(sol.stages)
    alone = [(t - once / count) / c for t, once in zip(sol.stage_times, tail)]
    return simulate_shared(alone, rows, count, schedule, capacity) + max(tail)


class _StagePricer:
    """The step of a stage list ((first unit, last unit, option) per stage) of one DP run, as
    ``best_stages`` compares them: the schedule's step, simulated where ranks share cores
    (``shared_core_time``), plus what the stages add (``step_extras``); None where a stage is
    ruled out or does not fit."""

    def __init__(self, search, schedule: Schedule, virtual: int, count: int, time_t, memory: StageMemory, devices,
                 prices, graph, groups, shared):
        self.search, self.schedule, self.virtual, self.count = search, schedule, virtual, count
        self.time_t, self.memory, self.devices, self.prices = time_t, memory, devices, prices
        self.graph, self.groups, self.shared = graph, groups, shared

    def __call__(self, stages: list) -> StageSolution | None:
        search, count = self.search, self.count
        times = [float(self.time_t[i, j, m]) for i, j, m in stages]
        if not all(math.isfinite(t) for t in times):
            return None
        sol = StageSolution(list(stages), step_time(self.schedule, times, count, self.virtual), max(times), times)
        if not _fits_inflight(sol, self.memory, self.schedule, count, search.budget, self.virtual):
            return None
        overlapped = self.schedule.overlaps_sync
        per_step = [count * self.prices[m].per_step_between(i, j, overlapped) for i, j, m in stages]
        sol.step_time = shared_core_time(sol, self.devices, count, search.contention, search.mesh.shape[0],
                                         self.schedule, per_step)
        sol.step_time += step_extras(self.graph, self.groups, stages, len(stages) // self.virtual, search.mesh,
                                     self.shared)
        return sol


def _nudged(sol: StageSolution, priced) -> StageSolution:
    """``sol`` with its cuts moved a unit at a time while that lowers ``priced``'s step. Where ranks
    share cores the step is the simulated one (``shared_core_time``), which the DP's objective
    (the slowest stage once per microbatch) does not see: a rank waiting for its neighbour frees a
    core for the others, so a heavier stage costs less than the DP counts, and the once-a-step
    gradient sync and optimizer go with where the parameters are. (Measured, a GPT-2 of 8 layers
    in bf16 on 4 ranks sharing 2 cores, 2 stages x dp2, 1F1B: 3+5 layers 542 ms a step, 4+4 549,
    2+6 559 in one run, 4+4 544 and the DP's own 5+3 562 in another; simulated 0.658, 0.667,
    0.667 and 0.675 s.)"""
    while True:
        moved = [m for m in (priced(st) for st in _moved_cuts(sol.stages)) if m is not None]
        best = min(moved, key=lambda m: m.step_time, default=None)
        if best is None or best.step_time >= sol.step_time - 1e-12 * max(1.0, sol.step_time):
            return sol
        sol = best


def _moved_cuts(stages: list):
    """Every stage list with one cut between neighbours moved by one unit, each stage keeping one."""
    for c in range(len(stages) - 1):
        (i, j, m), (_, last, n) = stages[c], stages[c + 1]
        for d in (-1, 1):
            if i <= j + d < last:
                yield stages[:c] + [(i, j + d, m), (j + d + 1, last, n)] + stages[c + 2:]


# ---- search ----------------------------------------------------------------------------------------------
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


class Found(NamedTuple):
    """The best stages for one microbatch count: the DP's ``sol`` (stages as (first unit, last unit,
    index into ``variants``)) under ``schedule``, on ``graph`` cut into units ``groups``, with the
    stage memory tables the DP read (``memory``, every variant)."""

    sol: StageSolution
    count: int
    schedule: Schedule
    variants: list  # (rows, UnitPrices)
    graph: object
    groups: list
    memory: StageMemory


class _StageTables:
    """The stage DP's tables over ``variants`` (``stage_prices.stacked_tables``) per grouping of the
    layers into units (``unit_groups``), built on first use; each variant's own tables kept in
    ``per_variant`` (shared by the DP runs of one search: a count's leaner and wider variants join
    the ones it already priced)."""

    def __init__(self, variants, graph, mesh: Mesh, layers: tuple[int, ...] | None, per_variant: dict):
        self.variants, self.graph, self.mesh, self.layers = variants, graph, mesh, layers
        self.built: dict[tuple, tuple] = {}  # (group sizes, overlapped) -> (groups, grouped variants, time, StageMemory)
        self.per_variant = per_variant  # (id of UnitPrices, group sizes, overlapped) -> (it, grouped, tables)

    def for_stages(self, stage_count: int | None, schedule: Schedule):
        """(groups, grouped variants, time, StageMemory) on units fit for ``stage_count`` stages
        under ``schedule`` (where its syncs start: ``Schedule.overlaps_sync``)."""
        groups = unit_groups(len(self.graph.layers), stage_count, self.layers)
        key = (tuple(map(len, groups)), schedule.overlaps_sync)
        if key not in self.built:
            grouped, tables = [], []
            for rows, p in self.variants:
                own = (id(p), *key)
                if own not in self.per_variant:
                    g = grouped_prices(p, groups)
                    self.per_variant[own] = (p, g, variant_tables(g, len(groups), self.mesh, schedule.overlaps_sync))
                grouped.append((rows, self.per_variant[own][1]))
                tables.append(self.per_variant[own][2])
            time_t, *memory = stacked_tables(tables)
            if self.layers is not None:
                time_t = _fixed_cuts(time_t)
            self.built[key] = (groups, grouped, time_t, StageMemory(*memory))
        return self.built[key]


def _recompute_variants(p: UnitPrices, recompute: Recompute | None) -> list[UnitPrices]:
    """``p`` as the DP may use it (``Pipeline.recompute``): as is, or recomputed whole or
    selectively; None: every one (the DP chooses per stage)."""
    kinds = list(Recompute) if recompute is None else [recompute]
    if p.selective_refused:
        if recompute is Recompute.SELECTIVE:
            raise ConfigError(f"Pipeline(recompute='selective'): {p.selective_refused}")
        kinds = [k for k in kinds if k is not Recompute.SELECTIVE]
    return [p.recomputed(k) for k in kinds]


class _Search:
    """One search: its inputs, the graphs traced (or scaled) per microbatch count, the best stages
    found per count (``evaluate``), and where the time went (``timing``)."""

    def __init__(self, model, mesh: Mesh, example_inputs, example_kwargs, pipeline: Pipeline,
                 memory_budget: float | None, config: PlanConfig, tolerance: float, equal_stages: bool):
        self.model, self.mesh, self.pipeline = model, mesh, pipeline
        self.config = config
        self.inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        self.kwargs = example_kwargs
        self.batch = batch_size(self.inputs, example_kwargs)
        self.memory_budget = memory_budget
        self.budget = math.inf if memory_budget is None else float(memory_budget)
        self.tolerance, self.equal_stages = tolerance, equal_stages
        self.schedules = [schedule_named(pipeline.schedule)] if pipeline.schedule else list(SEARCHED)
        self.contention = mesh.resolved_cluster().rank_contention
        self.options = _stage_rows(mesh, pipeline.stages, equal_stages)
        self.timing = {"trace_s": 0.0, "intra_op_s": 0.0, "dp_s": 0.0, "traces": 0, "scaled_graphs": 0}
        self.results: dict[int, Found | None] = {}
        self.tables_by_variant: dict = {}  # (see _StageTables)
        self.graphs: dict[int, object] = {}
        self.real: list[int] = []  # the counts whose graph was traced (the others were scaled from two of them)

    # ---- graphs ----
    def trace(self, count: int):
        """A trace of the model on one microbatch of ``count`` (recorded in ``real``)."""
        t0 = time.perf_counter()
        micro_in, micro_kw = microbatch_inputs(self.inputs, self.kwargs, count)
        graph = trace_graph(self.model, micro_in, micro_kw or None)
        self.timing["trace_s"] += time.perf_counter() - t0
        self.timing["traces"] += 1
        self.real.append(count)
        return graph

    def traced(self, count: int):
        """The graph at the microbatch shape of ``count`` microbatches (one microbatch: the whole
        batch, which the batch-independence check reads too): traced for the first two counts,
        then read off two traces where that holds (``ir.batch_scaling``; a trace costs seconds)."""
        if count not in self.graphs:
            t0 = time.perf_counter()
            scaled = self.untraced(count)
            self.timing["trace_s"] += time.perf_counter() - t0
            if scaled is not None:
                self.timing["scaled_graphs"] += 1
            else:
                self.graphs[count] = self.trace(count)
        return self.graphs[count]

    def untraced(self, count: int):
        """The graph at ``count`` where it is held or can be read off two traces; None where only
        a trace would give it."""
        if count not in self.graphs and len(self.real) >= 2:
            real = self.real
            scaled = scaled_graph(self.graphs[real[0]], self.batch // real[0], self.graphs[real[1]],
                                  self.batch // real[1], self.batch // count)
            if scaled is not None:
                self.graphs[count] = scaled
        return self.graphs.get(count)

    # ---- microbatch counts ----
    def microbatch_counts(self) -> tuple[list[int], list[str]]:
        """The counts to search, and notes on why there are fewer (one, where splitting dim 0 would
        change the step: ``batch_mixing``)."""
        pipeline, batch = self.pipeline, self.batch
        counts = microbatch_candidates(batch, pipeline.microbatches)
        notes: list[str] = []
        if counts != [1]:
            probe = mixing_probe(counts, batch, self.inputs, self.kwargs)
            try:
                why = batch_mixing(self.traced(probe), batch // probe)
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
        return counts, notes

    def best(self, counts: list[int]) -> Found | None:
        """The best stages over ``counts`` (``_search_counts``), widened (``widen``), on a traced
        graph. Every count within ``WIDEN_MARGIN`` of the best is widened too: narrower views can
        reorder close counts. A chosen count whose graph was scaled is traced, as parallelize
        will: the same program keeps its result; another one (the model is not linear in the batch
        there) is priced again."""
        best = _search_counts(counts, self.evaluate)
        if best is None:
            return None
        limit = best.sol.step_time * (1 + WIDEN_MARGIN)
        widened = {r.count: self.widen(r) for r in self.results.values() if r is not None and r.sol.step_time <= limit}
        while widened:
            best = min(widened.values(), key=lambda r: r.sol.step_time)
            count = best.count
            if count in self.real:
                return best
            graph = self.trace(count)
            same = graph.fingerprint() == self.graphs[count].fingerprint()
            self.graphs[count] = graph
            if same:
                self.results[count] = self.results[count]._replace(graph=graph)
                return best._replace(graph=graph)
            del self.results[count], widened[count]
            found = self.evaluate(count)
            rest = [r for r in self.results.values() if r is not None and r.count not in widened]
            if found is not None or (not widened and rest):
                found = found or min(rest, key=lambda r: r.sol.step_time)
                widened[found.count] = self.widen(found)
        return None

    def nothing_fits(self) -> PlanError:
        """Why the search found nothing, and what it tried."""
        why = (f"fits {self.memory_budget} bytes per device" if self.memory_budget is not None else
               "can be planned (a forced layout must fit each stage's devices and the microbatch; stages must tile "
               "the mesh rows)")
        return PlanError(f"no pipeline of {type(self.model).__name__} on {self.mesh} {why}: stage counts, sub-meshes of "
                         f"{self.options} rows and microbatch counts {sorted(self.results)} tried")

    # ---- one microbatch count ----
    def evaluate(self, count: int) -> Found | None:
        """The best stages for ``count`` microbatches, or None when nothing fits."""
        if count in self.results:
            return self.results[count]
        t_trace = time.perf_counter()
        try:
            graph = self.traced(count)
        except TraceError as err:  # this microbatch size is not a call the model takes
            log.info("%d microbatches: the microbatch does not trace (%s)", count, str(err).splitlines()[0])
            self.results[count] = None
            return None
        unit_of_nodes(graph)  # a graph without layers cannot be cut: PlanError
        unit_groups(len(graph.layers), None, self.pipeline.layers)  # fixed layers must cover the model: ConfigError
        config = self.config.replace(microbatches=count, prove_overlap=False)
        rows = [r for r in self.options  # not more stages of a size than layers
                if not (self.equal_stages and self.mesh.shape[0] // r > len(graph.layers))]
        variants, lean = self._fastest_variants(graph, config, [(r, sub_mesh(self.mesh, r)) for r in rows])
        found = self._stages_over(variants, lean, count, graph, config)
        self.results[count] = found
        log.info("pipeline search, %d microbatches: %s (%d sub-mesh options, %.1f s)", count,
                 "nothing fits" if found is None else
                 f"{len(found.sol.stages)} stage(s), {found.schedule}, step {found.sol.step_time:.3g} s",
                 len(variants), time.perf_counter() - t_trace)
        return found

    def _fastest_variants(self, graph, config: PlanConfig, meshes):
        """(rows, UnitPrices) of the fastest intra-op plan on each (rows, sub-mesh) of ``meshes``
        (and recomputed, per ``Pipeline.recompute``); and (rows, sub-mesh, those prices) where it
        does not fit."""
        t_ilp = time.perf_counter()
        variants, lean = [], []
        for rows, sm in meshes:
            share = rows / self.mesh.shape[0] if self.equal_stages else None  # of the layers a stage holds
            fastest = fastest_prices(self.model, sm, graph, plan_one_stage, config)
            if fastest is not None:
                variants += [(rows, p) for p in _recompute_variants(fastest, self.pipeline.recompute)]
                if held_bytes(fastest, share) > self.budget:
                    lean.append((rows, sm, fastest))
        self.timing["intra_op_s"] += time.perf_counter() - t_ilp
        return variants, lean

    def _stages_over(self, variants: list, lean: list, count: int, graph, config: PlanConfig, floor: Found | None = None):
        """The stage DP over ``variants``, then again with leaner plans of the ``lean`` sub-meshes
        where any could still win (``_add_leaner``; cut off at what was found, or ``floor``)."""
        found = self.best_stages(variants, count, graph)
        if lean and self._add_leaner(variants, lean, found or floor, count, graph, config):
            found = self.best_stages(variants, count, graph)
        return found

    def _add_leaner(self, variants: list, lean: list, found: Found | None, count: int, graph, config: PlanConfig) -> bool:
        """Leaner plans of the sub-meshes whose fastest does not fit, added to ``variants``, each cut
        off where it could not beat the pipeline found: a stage on 1 / s of the rows runs at least
        1 / s of the whole graph's work per microbatch (busy ranks sharing cores at most c times
        faster). Whether any was added."""
        t_ilp = time.perf_counter()
        before = len(variants)
        rows_total = self.mesh.shape[0]
        for rows, sm, fastest in lean:
            cutoff = (found.sol.step_time * max(1.0, self.contention) * rows_total / (rows * count)
                      if found is not None and self.equal_stages else None)
            for p in leaner_prices(self.model, sm, graph, plan_one_stage, config, fastest, cutoff):
                variants += [(rows, q) for q in _recompute_variants(p, self.pipeline.recompute)]
        self.timing["intra_op_s"] += time.perf_counter() - t_ilp
        return len(variants) > before

    def widen(self, best: Found | None) -> Found | None:
        """``best`` again with narrower tensor-parallel views of the sub-meshes its stages run on
        (``mesh_views.narrower_views``: a stage of r rows of nodes of 8 also as (2r, 4), (4r, 2),
        (8r,)), the widths a hand-written configuration can name. Only at the best count and
        stage size: each view is a whole intra-op plan, and the sub-mesh's own shape decides the
        count and the stage size before the width does. A forced layout fixes the widths."""
        if best is None or self.config.force is not None:
            return best
        config = self.config.replace(microbatches=best.count, prove_overlap=False)
        views = [(rows, view) for rows in sorted({best.variants[m][0] for _, _, m in best.sol.stages})
                 for view in narrower_views(sub_mesh(self.mesh, rows))]
        added, lean = self._fastest_variants(best.graph, config, views)
        if not added:
            return best
        found = self._stages_over(list(best.variants) + added, lean, best.count, best.graph, config, floor=best)
        return found if found is not None and found.sol.step_time < best.sol.step_time - 1e-15 else best

    # ---- the stage DP ----
    def _schedules(self):
        """(schedule, stages per rank) pairs the DP runs."""
        pipeline = self.pipeline
        for schedule in self.schedules:
            if schedule.interleaved and pipeline.virtual_stages == 1:
                continue  # searched (Pipeline refuses the pair when asked for): one stage per rank was asked for
            virtual = schedule.stages_per_rank(pipeline.virtual_stages)
            if virtual > 1 and not self.equal_stages:
                if pipeline.schedule is None:
                    continue  # searched, not asked for: it needs equal stages
                raise ConfigError("interleaved 1F1B places several equal stages on each rank: plan it with equal_stages")
            yield schedule, virtual

    def best_stages(self, variants: list, count: int, graph) -> Found | None:
        """The stage DP over ``variants`` for every schedule and stage shape: the fastest, or None
        when nothing fits."""
        t_dp = time.perf_counter()
        if not variants:
            return None
        found = None
        mesh = self.mesh
        tables = _StageTables(variants, graph, mesh, self.pipeline.layers, self.tables_by_variant)
        shared = multi_unit_params(graph)
        devices = np.array([rows for rows, _ in variants])
        recomputed = np.array([bool(p.recompute) for _, p in variants])
        views = [tuple(p.plan.mesh["shape"]) for _, p in variants]
        for schedule, virtual in self._schedules():
            for keep, counts in _stage_shapes(devices, mesh.shape[0], self.pipeline.stages, self.equal_stages):
                groups, grouped, time_t, memory = tables.for_stages(
                    next(iter(counts)) * virtual if counts is not None and len(counts) == 1 else None, schedule)
                if not schedule.recompute:  # (see Pipeline)
                    keep = keep & ~recomputed
                # the stage counts (of ranks) torch's schedule class runs ``count`` microbatches over
                counts = {c for c in (counts or range(1, mesh.shape[0] + 1)) if schedule.takes(c, count)}
                if not counts:
                    continue
                for one_view in _by_view(keep, views, virtual):
                    sol = self._dp_solution(schedule, virtual, counts, count, devices, one_view, time_t, memory,
                                            grouped, graph, groups, shared)
                    if sol is not None and (found is None or sol.step_time < found.sol.step_time - 1e-15):
                        found = Found(sol, count, schedule, variants, graph, groups, memory)
        self.timing["dp_s"] += time.perf_counter() - t_dp
        return found

    def _dp_solution(self, schedule, virtual, counts, count, devices, keep, time_t, memory, grouped, graph, groups,
                     shared):
        """The DP over the variants ``keep`` marks, priced (``_StagePricer``), its stages indexing
        the whole variants list; None when nothing fits."""
        if not keep.any():
            return None
        time_k, memory_k = time_t[:, :, keep], memory.kept(keep)
        sol = self._solve(schedule, virtual, counts, count, devices[keep], time_k, memory_k)
        if sol is None:
            return None
        kept = np.flatnonzero(keep)  # the DP's variant index -> the variants list's
        priced = _StagePricer(self, schedule, virtual, count, time_k, memory_k, devices[keep],
                              [grouped[k][1] for k in kept], graph, groups, shared)
        sol = priced(sol.stages)
        if self.contention > 1.0 and not schedule.interleaved:
            sol = _nudged(sol, priced)
        sol.stages = [(i, j, int(kept[m])) for i, j, m in sol.stages]
        return sol

    def _solve(self, schedule: Schedule, virtual: int, counts: set[int], count: int, devices, time_t,
               memory: StageMemory):
        """The DP for ``schedule`` over these variants and stage counts (of ranks): its stages (the
        DP's objective is GPipe's and 1F1B's step; ``_StagePricer`` prices them), or None when
        nothing fits."""
        if virtual > 1:  # v stages per rank: the DP cuts p * v stages on v copies of the rows
            counts = {c * virtual for c in counts}
        sol = solve_stages(time_t, devices, self.mesh.shape[0] * virtual, count,
                           mem=memory.held_for_good(count, schedule, virtual), act=memory.activations,
                           budget=self.budget / virtual, schedule=schedule.name, stage_counts=counts,
                           tolerance=self.tolerance)
        if sol is None or not _fits_inflight(sol, memory, schedule, count, self.budget, virtual):
            return None
        return sol


def _by_view(keep, views: list, virtual: int) -> list:
    """``keep`` as one mask, or under several stages per rank one mask per view of the devices
    (sub-mesh shape): a rank's stages run on one set of process groups, so the stages that share
    a block of ranks share its view."""
    if virtual == 1:
        return [keep]
    return [keep & np.array([v == view for v in views]) for view in dict.fromkeys(views)]


def search(model, mesh: Mesh, example_inputs, example_kwargs=None, *, config: PlanConfig | None = None,
           memory_budget: float | None = None, tolerance: float = 0.01, equal_stages: bool = True,
           **options) -> PipelineChoice:
    """The fastest pipeline for ``model`` on ``mesh`` within ``memory_budget`` bytes per device, its
    stages planned under ``config`` and ``options`` (``PlanConfig`` fields; the ``pipeline``
    field's given fields fixed, the others searched).
    ``equal_stages``: every stage takes as many rows (what torch's schedules run: each rank talks
    to one rank per stage); False lets the DP size each stage on its own, as Alpa does."""
    config = PlanConfig.of(config, **options)
    pipeline = config.searched_pipeline or Pipeline()
    t0 = time.perf_counter()
    run = _Search(model, mesh, example_inputs, example_kwargs, pipeline, memory_budget, config, tolerance,
                  equal_stages)
    counts, notes = run.microbatch_counts()
    best = run.best(counts)
    if best is None:
        raise run.nothing_fits()
    virtual = best.schedule.stages_per_rank(pipeline.virtual_stages)
    stages = _stage_plans(best, mesh, virtual, run.budget)
    return PipelineChoice(PipelinePlan(best.schedule.name, best.count, stages, virtual), best.sol.step_time, best.graph,
                          time.perf_counter() - t0, run.timing, notes, mesh, run.untraced(1), 1 in run.real)


def _stage_plans(found: Found, mesh: Mesh, virtual: int, budget: float) -> list[StagePlan]:
    """The stages of ``found``: each one's layers, rows and ranks, time and memory, and the
    whole-graph plan of its variant cut to its nodes (``restrict``)."""
    sol, count, schedule, variants, graph, groups, memory = found
    unit = unit_of_nodes(graph)
    stages, row = [], 0
    per_row = math.prod(mesh.shape[1:])
    blocks = len(sol.stages) // virtual  # ranks of the pipeline (stage s runs on block s mod blocks)
    for (gi, gj, m), t in zip(sol.stages, sol.stage_times):
        i, j = groups[gi][0], groups[gj][-1]
        rows, prices = variants[m]
        if virtual > 1:
            row = (len(stages) % blocks) * rows
        mem = memory.at(gi, gj, m, len(stages), blocks, count, schedule, virtual)  # as the DP checked it
        nodes = {name for name, u in unit.items() if i <= u <= j}
        if not stages:  # state nothing reads is held by the first stage (as codegen's cut_stages holds it)
            nodes |= {n for n, node in graph.nodes.items()
                      if node.op == "placeholder" and node.role != Role.INPUT and not node.users}
        sub = restrict(prices.plan, graph, nodes, t, float(mem), budget)
        stages.append(StagePlan((i, j), (graph.layers[i], graph.layers[j]), (row, row + rows - 1),
                                list(range(row * per_row, (row + rows) * per_row)), tuple(prices.plan.mesh["shape"]),
                                t, float(mem), sub, list(range(i, j + 1)) if prices.recompute else [],
                                selective=prices.recompute is Recompute.SELECTIVE))
        row += rows
    return [dataclasses.replace(s, received=edges) for s, edges in zip(stages, received_edges(graph, stages))]


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
    # (the call's facts are the whole pipeline's, said once by its plan: not a stage's)
    solver = {k: v for k, v in plan.solver.items() if k != "call"}
    solver["memory_budget"] = None if budget is None or math.isinf(budget) else budget
    return Plan(plan.model_name, plan.model_fingerprint, plan.mesh, node_plans, edges, params, predicted,
                solver, idle_axes=plan.idle_axes, precision=plan.precision)
