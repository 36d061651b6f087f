"""Intra-op planning: one stage of the whole graph on a mesh (trace, enumerate strategies, price
them, solve the ILP, and package a Plan). ``plan_one_stage`` is what ``autopar.plan`` runs for one
stage and what the pipeline search runs on each sub-mesh; ``autopar.plan`` itself (``solver.api``)
chooses between it and a pipeline.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
import logging
import math
import time
import weakref

from autopar.cost_model import memory as memory_model
from autopar.cost_model.grad_sync import grad_bytes_total, with_group_shares, zero2_pool_bytes
from autopar.cost_model.step import graph_overheads_s, step_time, zero2_totals
from autopar.record.buckets import DEFAULT_BUCKET_BYTES
from autopar.errors import ConfigError, PlanError
from autopar.ir import trace
from autopar.ir.flops import model_flops
from autopar.cost_model.ops import alias_roots, local_nbytes
from autopar.ir.graph import Role, needs_grad
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.strategy import active_axes
import autopar.solver.ilp as ilp
from autopar.solver.config import PlanConfig
from autopar.solver.layout import Layout, layout_force
from autopar.solver.plan import NodePlan, ParamPlan, Plan
from autopar.solver.problem import Overlap, build_problem, edge_itemsize, node_choices, planned_edges
from autopar.solver.simplify import block_ties, eliminate, prune, recover
from autopar.solver.units import parse_bytes

log = logging.getLogger(__name__)
# Relative difference in predicted step time below which two gradient conventions tie (the
# solvers' own tolerance: ``ilp.MIP_GAP`` on the objective, float sums beside it).
TIE = 1e-6


def call_facts(model, example_inputs, example_kwargs, optimizer: str, notes=(), graph=None, flops: float = 0.0) -> dict:
    """What the plan is for, as explain's header says it: the call's tensor inputs (name -> "dtype[shape]"),
    the parameters (count, dtype), the optimizer, the forward's model FLOPs of one step's batch
    (``flops``; default: ``graph``'s: ``ir.flops.model_flops``) and what tracing noted."""
    import torch

    inputs: dict[str, str] = {}
    if graph is not None:
        inputs = {name: str(graph.nodes[name].meta) for name in graph.inputs if graph.nodes[name].tensor_meta is not None}
    else:
        args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        named = [(f"input {i}", t) for i, t in enumerate(args)] + list((example_kwargs or {}).items())
        inputs = {n: f"{str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, t.shape))}]" for n, t in named
                  if isinstance(t, torch.Tensor)}
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in params)
    return {"inputs": inputs, "parameters": sum(p.numel() for p in params),
            "param_dtype": dtypes.most_common(1)[0][0] if dtypes else None, "optimizer": optimizer,
            "flops": float(flops or (model_flops(graph) if graph is not None else 0.0)), "notes": list(notes)}


def default_budget(memory_budget, mesh: Mesh) -> tuple[float | None, str | None]:
    """(bytes per device or None, where that figure comes from) for ``memory_budget`` (see ``plan``)."""
    if memory_budget == "auto":
        cluster = mesh.resolved_cluster()
        if not cluster.memory_is_budget:
            return None, None
        return float(cluster.memory_bytes), f"the {cluster.name} device memory"
    if memory_budget is None:
        return None, None
    return parse_bytes(memory_budget), "memory_budget"


def plan_one_stage(model, mesh: Mesh, example_inputs=(), *, example_kwargs=None, config: PlanConfig | None = None,
                   graph=None, **options) -> Plan:
    """``autopar.plan(..., pipeline=False)``: the cheapest one-stage plan under ``config`` (and
    ``options``, ``PlanConfig`` fields; its ``pipeline`` is not read); the pipeline search plans
    each sub-mesh so."""
    config = PlanConfig.of(config, **options)
    mesh, budget, budget_from = planning_mesh(mesh, config.cluster, config.memory_budget)
    call = dict(model=model, example_inputs=example_inputs, example_kwargs=example_kwargs, optimizer=config.optimizer)
    return one_stage(graph, mesh, call, budget, budget_from, config)


def planning_mesh(mesh: Mesh, cluster, memory_budget) -> tuple[Mesh, float | None, str | None]:
    """``mesh`` with ``cluster`` (when given) and the budget it plans under (``default_budget``)."""
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    if cluster is not None:
        mesh = mesh.with_cluster(cluster)
    return (mesh, *default_budget(memory_budget, mesh))


def one_stage(graph, mesh, call: dict, budget, budget_from, config: PlanConfig) -> Plan:
    """The plan of the whole batch in one stage: the cheapest over the idle-axis candidates."""
    t0 = time.perf_counter()
    if graph is None:
        example_inputs = call["example_inputs"]
        if not isinstance(example_inputs, (tuple, list)):
            example_inputs = (example_inputs,)
        graph = trace(call["model"], tuple(example_inputs), call["example_kwargs"])
        log.info("traced %s: %d nodes, %d layers (%.1f s)", graph.model_name, len(graph.nodes), len(graph.layers),
                 time.perf_counter() - t0)
    t_trace = time.perf_counter()
    force, idle_axes = config.force, config.idle_axes
    layout = force if isinstance(force, Layout) else None
    if layout is not None:  # a layout uses every mesh axis but those named idle
        idle_axes = () if idle_axes == "auto" else idle_axes
        force = layout_force(graph, view_mesh(mesh, idle_candidates(mesh, idle_axes)[0]), layout)
    best, first_error = None, None
    replicated_s = None
    for idle in idle_candidates(mesh, idle_axes):
        if idle and best is not None:
            # No plan on the remaining devices beats the replicated compute spread perfectly over
            # them: skip candidates whose bound cannot win (big models never leave axes idle).
            replicated_s = replicated_s if replicated_s is not None else _replicated_compute_s(graph, mesh, config.op_table)
            used = math.prod(s for a, s in enumerate(mesh.shape) if a not in idle)
            if replicated_s / used >= best[1][3]["objective_s"]:
                continue
        try:
            attempt = _plan_on(graph, view_mesh(mesh, idle), budget, force, config)
        except (PlanError, ConfigError) as e:
            # the no-idle candidate comes first: its error (least memory; a bad `force`) is the one to show
            first_error = first_error or e
            continue
        if best is None or _simpler_or_cheaper(attempt[3], best[1][3]):
            best = (idle, attempt)
    if best is None:
        raise first_error
    idle, solved = best
    stats = dict(trace_s=t_trace - t0, memory_budget=budget, memory_budget_from=budget_from,
                 layout=layout.name if layout is not None else None, call=call_facts(**call, notes=graph.notes, graph=graph))
    best_plan = _made(graph, mesh, solved, idle, config, total_s=time.perf_counter() - t0, **stats)
    log.info("planned %s on %s: objective %.3g s, %d ILP variables (%.1f s)", graph.model_name, mesh,
             best_plan.solver["objective_s"], best_plan.solver.get("ilp_variables", 0), best_plan.solver["total_s"])
    return best_plan


def _simpler_or_cheaper(stats: dict, best: dict) -> bool:
    """Whether a solve (its stats) beats the best so far: cheaper, or as cheap (within ``TIE``)
    with fewer identical-gradient axes (a model too small for the mesh is then said to leave axes
    idle, not to keep whole gradients on them: the same program)."""
    a, b = stats["objective_s"], best["objective_s"]
    if a < b * (1 - TIE):
        return True
    return a <= b * (1 + TIE) and len(stats["identical_axes"]) < len(best["identical_axes"])


def _made(graph, mesh, solved, idle, config: PlanConfig, **stats) -> Plan:
    """The Plan of one ``_plan_on`` answer on ``mesh`` with ``idle`` axes unused, ``stats`` added
    to its solver figures."""
    view, built, full, solver_stats, memory = solved
    solver_stats.update(idle_axes=list(idle), **stats)
    return make_plan(graph, view, built, full, memory, solver_stats, real_mesh=mesh, idle_axes=idle,
                     bucket_bytes=config.bucket_bytes, precision=config.precision, step_share=1.0 / config.microbatches)


def identical_candidates(mesh: Mesh, axes) -> list[tuple[int, ...]]:
    """Sets of ``axes`` (active ones) to keep gradients whole on (``record.gradients``): none (the
    dual convention) first, then every non-empty set of them."""
    act = [a for a in active_axes(mesh) if a in {mesh.axis(x) for x in (axes or ())}]
    return [c for k in range(len(act) + 1) for c in itertools.combinations(act, k)]


def backward_comm_axes(graph, built, full: dict[str, int], mesh: Mesh) -> tuple[int, ...]:
    """The mesh axes a solution communicates over in backward, besides gradient syncs: where it
    reads some parameter split (tensor parallelism) or reshards a value gradients flow back
    through with a collective (a batch norm's statistics, a row-parallel all-reduce).
    ``identical_axes="auto"`` tries keeping gradients whole on these (Megatron's convention: a
    forward all-reduce's backward is then local); on an axis the solution only syncs gradients over,
    every parameter could leave its gradient pending as the dual convention does."""
    axes = set()
    for name, node in graph.nodes.items():
        if name not in full or node.op != "call_function":
            continue
        strategy = built.choices[name].strategies[full[name]]
        for pos, src in enumerate(node.inputs):
            spec = strategy.inputs[pos] if pos < len(strategy.inputs) else None
            if graph.nodes[src].op == "placeholder" and graph.nodes[src].role == Role.PARAMETER and spec is not None \
                    and hasattr(spec, "used_axes"):
                axes |= set(spec.used_axes)
    for e in planned_edges(graph, built, full, mesh):
        if e.backward:
            axes |= {a for st in e.steps if st.kind not in ("slice", "to_partial") for a in st.axes}
    return tuple(sorted(axes))


def _with_sync_seconds(params: dict[str, ParamPlan], prices: dict, step_share: float) -> dict[str, ParamPlan]:
    """``params`` with each ``grad_sync_s`` its sync's seconds per run (``step_share`` of a step):
    its price as the ILP's choice held it (``prices``: fqn -> ``SyncPrice``), with its share of its
    group's first calls (``cost_model.grad_sync.with_group_shares``), so that they add up to what
    the ILP paid for the syncs."""
    out = {fqn: dataclasses.replace(p, grad_sync_s=0.0) for fqn, p in params.items()}
    synced = list(prices)
    for fqn, seconds in zip(synced, with_group_shares([prices[f] for f in synced])):
        out[fqn] = dataclasses.replace(params[fqn], grad_sync_s=seconds * step_share)
    return out


def _replicated_compute_s(graph, mesh, op_table) -> float:
    """Training compute of the whole graph run unsplit on one device (forward + backward)."""
    from autopar.cost_model.compute import node_time

    return sum(sum(node_time(n, None, graph, mesh, op_table)) for n in graph.nodes.values() if n.op == "call_function")


def idle_candidates(mesh: Mesh, idle_axes) -> list[tuple[int, ...]]:
    """Sets of active mesh axes to try leaving unused: with ``"auto"``, none first, then every
    subset (up to two active axes) or each single axis and all of them (three or more)."""
    act = active_axes(mesh)
    if idle_axes != "auto":
        idle = tuple(sorted(mesh.axis(a) for a in (idle_axes or ())))
        return [tuple(a for a in idle if a in act)]
    if len(act) <= 2:
        subsets = [c for k in range(len(act) + 1) for c in itertools.combinations(act, k)]
    else:
        subsets = [()] + [(a,) for a in act] + [tuple(act)]
    return subsets


def view_mesh(mesh: Mesh, idle: tuple[int, ...]) -> Mesh:
    """The mesh as the planner sees it with ``idle`` axes unused: those axes at size 1, every axis
    keeping its real link."""
    if not idle:
        return mesh
    shape = tuple(1 if a in idle else s for a, s in enumerate(mesh.shape))
    return Mesh(shape, mesh.axis_names, mesh.resolved_cluster().with_axis_links(mesh.links()))


def _plan_on(graph, mesh, budget, force, config: PlanConfig):
    """Solve on one (view of the) mesh, ``force`` being the config's as node restrictions, under
    each gradient convention tried (``identical_candidates``; each its own ILP, a later one with
    the best objective so far as its cutoff): (mesh, built problem, choice per node, stats, memory)
    of the cheapest. A tie keeps the earlier (fewer identical axes): its sums wait in buckets for
    the end of backward, where a whole axis's block mid-backward."""
    best, first_error = None, None
    queue = [()] if config.identical_axes == "auto" else identical_candidates(mesh, config.identical_axes)[-1:]
    while queue:
        identical = queue.pop(0)
        cutoff = config.objective_cutoff_s
        if best is not None:
            better = best[3]["objective_s"] * (1 - TIE)
            cutoff = better if cutoff is None else min(cutoff, better)
        try:
            attempt = _plan_under(graph, mesh, budget, force, config.replace(objective_cutoff_s=cutoff), identical)
        except ilp.NoCheaperPlan as err:
            first_error = first_error or err
            continue
        except (PlanError, ConfigError) as err:
            if config.identical_axes != "auto" and identical:
                raise PlanError(f"this plan cannot keep gradients whole on axes {identical}: {err}") from err
            if config.identical_axes != "auto" or not identical:
                raise
            first_error = first_error or err
            continue
        if best is None or _simpler_or_cheaper(attempt[3], best[3]):
            best = attempt
        if config.identical_axes == "auto" and not identical:
            queue += identical_candidates(mesh, backward_comm_axes(graph, attempt[1], attempt[2], mesh))[1:]
    if best is None:
        raise first_error
    return best


class _BuiltProblems:
    """The problems built for the last graph planned, by everything but the memory budget: the
    pipeline search plans each sub-mesh's fastest, then, after a first stage DP, its leaner plans
    under budgets (``stage_prices.leaner_prices``): the same strategies and prices, which take a
    large graph longer to build than to solve. One graph at a time (a graph per microbatch count)."""

    def __init__(self):
        self.graph, self.built = None, {}  # the graph held weakly: its problems go with it

    def get(self, graph, mesh, budget, force, config: PlanConfig, identical):
        if force is not None:  # (forced restrictions: built for the call)
            return _build(graph, mesh, budget, force, config, identical)
        if self.graph is None or self.graph() is not graph:
            built = self.built = {}
            self.graph = weakref.ref(graph, lambda _: built.clear())
        key = (mesh, config.optimizer, id(config.op_table), config.optimizer_sharding, config.bucket_bytes,
               config.microbatches, repr(config.precision), identical)
        if key not in self.built:
            self.built[key] = _build(graph, mesh, None, None, config, identical)
        return self.built[key].with_budget(budget)


def _build(graph, mesh, budget, force, config: PlanConfig, identical):
    choices = node_choices(graph, mesh, optimizer=config.optimizer, op_table=config.op_table,
                           optimizer_sharding=config.optimizer_sharding, force=force, bucket_bytes=config.bucket_bytes,
                           step_share=1.0 / config.microbatches, precision=config.precision, identical=identical)
    log.info("strategies of %d nodes on %s priced", len(choices), mesh)
    return build_problem(graph, mesh, memory_budget=budget, optimizer=config.optimizer, choices=choices,
                         step_share=1.0 / config.microbatches, identical=identical)


_BUILT = _BuiltProblems()


def _plan_under(graph, mesh, budget, force, config: PlanConfig, identical: tuple[int, ...]):
    """``_plan_on``'s solve under one gradient convention (``identical`` axes)."""
    t0 = time.perf_counter()
    built = _BUILT.get(graph, mesh, budget, force, config, identical)
    choices = built.choices
    t_build = time.perf_counter()
    overlap = Overlap.of(graph, choices, built.requires_grad, mesh, 1.0 / config.microbatches)
    # the op overheads are the same for every choice: out of the ILP, in the objective (a step's price)
    overheads = graph_overheads_s(graph, mesh.resolved_cluster())
    cutoff = config.objective_cutoff_s
    attempt, overlap_stats = _solve_overlapped(graph, built.problem, overlap, choices,
                                               config if cutoff is None else config.replace(objective_cutoff_s=cutoff - overheads),
                                               built.lower_bounds)
    tie, period, full, solution, objective, memory, reduced, small = attempt
    objective += overheads
    if "objective_bound_s" in overlap_stats:
        overlap_stats["objective_bound_s"] += overheads
    problem = built.problem
    problem.tie = tie
    stats = {
        "status": solution.status,
        "objective_s": objective,
        "identical_axes": list(identical),
        "graph_nodes": len(graph.nodes),
        "ilp_nodes_full": len(problem.costs),
        "ilp_nodes_after_block_reuse": len(reduced.costs),
        "block_period": period,
        "pruned": solution.pruned,
        "ilp_nodes_solved": len(small.costs),
        "ilp_variables": solution.n_variables,
        "ilp_constraints": solution.n_constraints,
        "build_s": t_build - t0,
        "solve_s": time.perf_counter() - t_build,
        **overlap_stats,
    }
    return mesh, built, full, stats, memory


def _solve_overlapped(graph, problem, overlap: Overlap | None, choices, config: PlanConfig, bounds: dict | None = None):
    """``_solve_tied`` with the gradient syncs that backward hides left out of the objective: the
    step is b + max(0, r) (``Overlap``: b the rest and the last bucket, r the syncs past the
    last bucket less their cover), which no sum over choices gives. For every l in [0, 1], min b + l r is a sum the
    ILP minimises and a lower bound of the step. At l = 0 (every
    sync hidden) the minimiser is optimal if its syncs stay hidden (r <= 0); at l = 1 (every sync
    paid less its cover) if they do not (r >= 0). Otherwise the two bracket the answer, and l
    moves to where their sums meet (the Lagrangian dual's search: each new minimiser replaces the
    bracket end of its sign of r, and the bound rises) until a minimiser proves optimal, no new one
    appears, or ``DUAL_STEPS`` ILPs more are spent. Returns (the cheapest attempt, with the step as
    its objective; stats, with the bound where unproven). ``bounds``: the problem's lower bounds
    per (costs variant, block period) (``Built.lower_bounds``), read and added to."""
    periods = (1, 2) if config.reuse_blocks else (0,)

    def run(costs, lam=None, cutoff=None):
        variant = dataclasses.replace(problem, costs=costs, tie={})
        cutoffs = [c for c in (cutoff, config.objective_cutoff_s) if c is not None]
        return _solve_tied(graph, variant, periods, choices, config.simplify, config.time_limit_s, config.solver,
                           min(cutoffs) if cutoffs else None, bounds, lam)

    if overlap is None:
        return run(problem.costs), {}

    def split(attempt):  # (b, r) of an attempt's assignment
        full = attempt[2]
        hidable = overlap.total(overlap.sync, full) - overlap.total(overlap.spread, full)
        return ilp.evaluate(problem, full)[0] - hidable, hidable - overlap.total(overlap.cover, full)


    def priced(attempt):  # the attempt with the step as its objective
        b, r = split(attempt)
        return (*attempt[:4], b + max(0.0, r), *attempt[5:])

    def at(lam):  # the costs of b + l r (the groups' first calls, once-paid, are never hidden)
        return {v: c - (1 - lam) * (overlap.sync.get(v, 0.0) - overlap.spread.get(v, 0.0)) - lam * overlap.cover.get(v, 0.0)
                for v, c in problem.costs.items()}

    if not config.prove_overlap:
        # (the pipeline search's ILPs, one per sub-mesh, count and budget) the end that charges
        # the syncs less their cover, one ILP: optimal where they do not all hide (a stage's hide
        # behind one microbatch's backward, seldom wholly), a bound of the step else
        paid = run(at(1.0), 1.0)
        b1, r1 = split(paid)
        floor = overlap.last_bucket(paid[2])
        if r1 >= 0:
            return priced(paid), {"sync_hidden": "in part", "sync_floor_s": floor}
        return priced(paid), {"sync_hidden": "bounded", "sync_floor_s": floor, "objective_bound_s": b1 + r1}
    hidden = run(at(0.0), 0.0)
    b0, r0 = split(hidden)
    if r0 <= 0:
        return priced(hidden), {"sync_hidden": "all", "sync_floor_s": overlap.last_bucket(hidden[2])}
    paid = run(at(1.0), 1.0)
    b1, r1 = split(paid)
    if r1 >= 0:
        return priced(paid), {"sync_hidden": "in part", "sync_floor_s": overlap.last_bucket(paid[2])}
    best = min((priced(hidden), priced(paid)), key=lambda a: a[4])
    bound = max(b0, b1 + r1)
    for _ in range(DUAL_STEPS):
        if best[4] <= bound * (1 + 1e-9):
            break
        lam = (b1 - b0) / (r0 - r1)  # where the bracket ends' sums meet
        try:
            found = run(at(lam), lam, cutoff=b0 + lam * r0)
        except ilp.NoCheaperPlan:  # the dual's maximum: nothing below the ends' meeting point
            bound = max(bound, b0 + lam * r0)
            break
        b, r = split(found)
        bound = max(bound, b + lam * r)
        best = min((best, priced(found)), key=lambda a: a[4])
        if r > 0:
            b0, r0 = b, r
        elif r < 0:
            b1, r1 = b, r
        else:
            break
    floor = overlap.last_bucket(best[2])
    if best[4] <= bound * (1 + 1e-9):
        return best, {"sync_hidden": "balanced", "sync_floor_s": floor}
    return best, {"sync_hidden": "bounded", "sync_floor_s": floor, "objective_bound_s": bound}


# Lagrangian steps past the two ends when the answer's syncs are partly hidden (see
# ``_solve_overlapped``); each is one ILP.
DUAL_STEPS = 4


def _solve_tied(graph, problem, periods, choices, simplify, time_limit_s, solver, cutoff_s=None, bounds=None,
                costs_key=None):
    """Solve with repeated blocks sharing one solution, for each block period (0: no sharing):
    (tie, period, choice per node, solution, objective, memory, reduced, solved) of the cheapest.
    A period of 2 lets neighbouring copies alternate (e.g. column- then row-parallel when each copy
    is a single linear). ``cutoff_s``: see ``ilp.solve`` (NoCheaperPlan when no period gets under it).
    A later period is solved with the best objective so far as its cutoff: it is kept only where
    it is cheaper, and HiGHS drops the branches that cannot be. ``bounds``: lower bounds per
    (``costs_key``, period) that unbudgeted solves proved (their optimum, or a cutoff nothing got
    under); a budgeted solve whose cutoff lies below one is not run (the pipeline search's leaner
    plans under a cutoff: most cannot beat the stages found)."""
    best, above = None, None
    budgeted = problem.budget is not None
    for period in periods:
        problem.tie = block_ties(graph, choices, period) if period else {}
        if best is not None and problem.tie == best[0]:
            continue
        cutoff = cutoff_s if best is None else min(best[4], math.inf if cutoff_s is None else cutoff_s)
        key = (costs_key, period)
        if budgeted and bounds is not None and cutoff is not None and bounds.get(key, -math.inf) >= cutoff:
            above = ilp.NoCheaperPlan(f"no assignment costs under the cutoff of {cutoff:.3g} s (none does without "
                                      "a memory budget)", proven=True)
            continue
        try:
            attempt = _solve(problem, simplify, time_limit_s, solver, cutoff)
        except ilp.NoCheaperPlan as err:
            if not budgeted and bounds is not None and err.proven:
                bounds[key] = max(bounds.get(key, -math.inf), cutoff)
            above = err
            continue
        if not budgeted and bounds is not None and attempt[1].status == "Optimal" and not attempt[1].pruned:
            # (less a margin for the solver's tolerances: a cutoff near the optimum is solved; a
            # pruned problem's optimum bounds only the candidates it kept, and a budget keeps others)
            bounds[key] = max(bounds.get(key, -math.inf), attempt[2] - 1e-6 * abs(attempt[2]))
        if best is None or attempt[2] < best[4] - 1e-15:
            best = (problem.tie, period, *attempt)
    if best is None:
        raise above
    return best


def _solve(problem, simplify: bool, time_limit_s: float, solver, cutoff_s=None):
    """(choice per node, solution, objective, memory, reduced problem, solved problem)."""
    reduced = problem.reduced()
    small, records = eliminate(reduced) if simplify else (reduced, [])
    pruned, keep = prune(small) if simplify else (small, {v: None for v in small.costs})
    cut = any(k is not None and len(k) < len(small.costs[v]) for v, k in keep.items())
    try:
        solution = ilp.solve(pruned, time_limit_s=time_limit_s, solver=solver, cutoff_s=cutoff_s)
    except ilp.NoCheaperPlan as err:
        err.proven = err.proven and not cut  # (proven of the candidates pruning kept, not of all)
        raise
    choice = {v: (i if keep[v] is None else int(keep[v][i])) for v, i in solution.choice.items()}
    solution.pruned = cut
    picked = recover(choice, records)
    full = {v: picked[problem.rep(v)] for v in problem.costs}
    objective, memory = ilp.evaluate(problem, full)
    return full, solution, objective, memory, reduced, small


def make_plan(graph, mesh, built, full: dict[str, int], memory: float, stats: dict, *, real_mesh=None,
              idle_axes=(), bucket_bytes: int = DEFAULT_BUCKET_BYTES, precision=None, step_share: float = 1.0) -> Plan:
    """The Plan of a solved problem. ``mesh`` is the mesh the problem was priced on (a view with
    idle axes at size 1); the Plan records ``real_mesh`` and the idle axes (and ``precision``, a
    ``MixedPrecision``, its recipe)."""
    choices = built.choices
    nodes = {}
    for name, c in choices.items():
        node = graph.nodes[name]
        s = c.strategies[full[name]]
        target = node.target if node.op == "call_function" else node.op
        nodes[name] = NodePlan(name, target, node.layer, s.family, list(s.inputs), s.output, float(c.compute_s[full[name]]),
                               float(c.memory[full[name]]), 0.0 if c.peak_memory is None else float(c.peak_memory[full[name]]))
    for (src, dst), held in built.problem.edge_memory.items():  # a kept reshard is its consumer's memory
        nodes[dst].memory_bytes += float(held[full[src], full[dst]])
    edges = planned_edges(graph, built, full, mesh)
    for e in edges:  # what the output node reads is what it returns (``problem.returned_spec``)
        if graph.nodes[e.dst].op == "output":
            nodes[e.dst].inputs[e.position] = e.dst_spec
    credit, held_for, released = _kept_copies(graph, nodes, edges, mesh)
    memory -= credit
    activation_peak = _activation_peak(graph, nodes, edges, mesh, held_for, released, tuple(built.identical))
    params, prices = {}, {}
    for fqn, node_name in list(graph.params.items()) + list(graph.buffers.items()):
        if node_name not in choices:
            continue
        c = choices[node_name]
        i = full[node_name]
        s = c.strategies[i]
        is_buffer = graph.nodes[node_name].role == Role.BUFFER
        params[fqn] = ParamPlan(
            fqn, node_name, s.output, s.family, c.grad_sync[i], 0.0,
            tuple(graph.param_aliases.get(fqn, (fqn,))), is_buffer,
            0.0 if c.accumulate_s is None else float(c.accumulate_s[i]),
        )
        if c.grad_sync[i] is not None and not is_buffer:
            prices[fqn] = c.sync_prices[i]
    total = grad_bytes_total(graph, precision)
    params = _with_sync_seconds(params, prices, step_share)
    real_mesh = real_mesh or mesh
    plan = Plan(graph.model_name, graph.fingerprint(), real_mesh.to_dict(), nodes, edges, params, {}, stats,
                idle_axes=tuple(idle_axes), identical_axes=tuple(built.identical),
                precision=precision.to_dict() if precision is not None else None)
    # The ILP's objective ranks plans; the prediction prices what the runtime runs (buckets,
    # overheads, optimizer): see autopar.cost_model.step.
    parts, after_backward = memory_parts(plan, graph, mesh, memory, precision, bucket_bytes, accumulated=step_share < 1.0,
                                         activations_at_least=activation_peak)
    # the ILP's memory is the step's peak; a bucket's gradient parts may outlast it (memory.grad_parts_in_flight)
    in_flight = memory_model.grad_parts_in_flight(_grad_part_bytes(plan, graph, mesh), bucket_bytes, parts["activations"])
    parts["gradients"] += in_flight
    plan.predicted = dict(step_time(plan, graph, mesh, runs=round(1 / step_share), bucket_bytes=bucket_bytes,
                                    grad_total_bytes=total), memory_bytes_per_device=sum(parts.values()),
                          memory_parts=parts, gradient_bytes_after_backward=after_backward + in_flight)
    return plan


def _kept_copies(graph, nodes: dict, edges, mesh) -> tuple[float, dict, frozenset]:
    """(what the prediction holds less than the ILP priced, the reshard copies each op's backward
    keeps {op: bytes}, the saved values freed): ``nodes``' memory is corrected in place. A saved
    value every keeping read of which reshards it to a new tensor is freed once they have
    (``memory.released_by_reshards``), and the copies nearest their readers are kept whole in its
    place. A reshard of only slices of the leading dim may be a view of its source
    (``collectives.SliceWhole``): not counted as a new tensor."""
    fresh = {(e.dst, e.position) for e in edges
             if e.steps and not all(st.kind == "slice" and st.dst_dim == 0 for st in e.steps)}
    released, holding = memory_model.released_by_reshards(graph, fresh)
    released = released & nodes.keys()
    credit = 0.0
    for r in released:
        out = float(local_nbytes(graph.nodes[r].meta, nodes[r].output, mesh))
        nodes[r].memory_bytes -= out
        credit += out
    kept, roots = memory_model.saved_inputs(graph), alias_roots(graph)
    held_for: dict[str, float] = {}
    for e in edges:
        if (e.dst, e.position) not in kept or not e.steps:
            continue
        itemsize = edge_itemsize(graph.nodes[e.src].meta, graph.nodes[e.dst])
        static = all(str(graph.nodes[r].role) in memory_model.STATIC_ROLES for r in roots[e.src])
        held = priced = memory_model.held_reshard_bytes(static, e.src_spec, e.dst_spec, mesh, itemsize)
        if (e.dst, e.position) in fresh and roots[e.src] <= released:
            held = memory_model.held_reshard_bytes(False, e.src_spec, e.dst_spec, mesh, itemsize,
                                                   released=True) if (e.dst, e.position) in holding else 0
            nodes[e.dst].memory_bytes += held - priced
            credit -= held - priced
        held_for[e.dst] = held_for.get(e.dst, 0.0) + held
    return credit, held_for, frozenset(released)


def _activation_peak(graph, nodes: dict, edges, mesh, held_for: dict, released, identical) -> float:
    """The plan's activations at their largest while any op runs, forward or backward, with its
    local sizes and what its reshards make and hold (``memory.plan_forward_peak``,
    ``memory.plan_backward_peak``)."""
    in_specs = {name: n.inputs for name, n in nodes.items()}  # (what each edge's steps end at)
    out_specs = {k: n.output for k, n in nodes.items()}
    kept = memory_model.saved_inputs(graph)  # (their copies are in ``held_for``)
    forward, backward = {}, {}
    for e in edges:
        if not e.steps or graph.nodes[e.dst].op == "output":
            continue
        itemsize = edge_itemsize(graph.nodes[e.src].meta, graph.nodes[e.dst])
        copy, buffers = memory_model.reshard_forward_bytes(e.steps, e.src_spec, mesh, itemsize)
        forward[(e.dst, e.position)] = (0 if (e.dst, e.position) in kept else copy, buffers)
        if e.backward:
            backward[(e.dst, e.position)] = memory_model.reshard_backward_bytes(e.steps, e.src_spec, mesh, itemsize,
                                                                                identical)
    return float(max(memory_model.plan_forward_peak(graph, mesh, out_specs, in_specs, held_for, released, forward),
                     memory_model.plan_backward_peak(graph, mesh, out_specs, in_specs, held_for, released, backward)))


def _grad_part_bytes(plan, graph, mesh) -> float:
    """The gradient parts a backward hands the reducer: every trained parameter's local shard, in
    the dtype the program reads it."""
    grad = needs_grad(graph)
    return float(sum(local_nbytes(graph.nodes[p.node].meta, p.storage, mesh) for p in plan.params.values()
                     if not p.buffer and p.node in grad))


def memory_parts(plan, graph, mesh, total: float, precision=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 accumulated: bool = False, activations_at_least: float = 0.0) -> tuple[dict, float]:
    """Memory per device by kind: parameters (their stored shards; under ZeRO-2 the working copy
    and the updated chunk), gradients (with ZeRO-2's share of the reducer's pool of bucket
    buffers, or over several microbatches, ``accumulated``, its whole buckets), optimizer states
    (and fp32 master copies), and activations (the rest of the total: saved values and the
    reshards kept for backward). Gradients that no bucket holds from step to step (a parameter
    with no gradient sync, in a step of one microbatch) are made in backward as the activations
    are freed, after the step's peak: they count only by what they exceed the activations by
    (``memory.gradients_made_late``; the ILP's budget counts them whole). ``activations_at_least``:
    the plan's activations where they are largest with its local sizes and reshards
    (``memory.plan_forward_peak``, ``plan_backward_peak``), where that is above what the ILP
    priced. Also returned: the gradient bytes held once backward is done (until
    ``zero_grad``)."""
    zero2_bytes, saved = zero2_totals(plan, mesh)
    params = grads = held = late = 0.0
    for p in plan.params.values():
        node = plan.nodes.get(p.node)
        if node is None:
            continue
        held += node.memory_bytes
        if p.buffer:
            params += node.memory_bytes
            continue
        zero_axes = p.grad_sync.axes if p.grad_sync is not None and p.grad_sync.split else ()
        parts = memory_model.param_memory_parts(graph.nodes[p.node].meta, p.storage, mesh, opt_state_sharded_axes=zero_axes,
                                                precision=precision, accumulated=accumulated)
        params += parts["parameters"]
        grads += parts["gradients"]
        if p.grad_sync is None and not accumulated:
            late += parts["gradients"]
        if zero_axes and not accumulated:
            grads += zero2_pool_bytes(p.grad_sync.nbytes, p.grad_sync.sum_by, zero2_bytes, saved, bucket_bytes)
    states, activations = max(0.0, held - params - grads), max(0.0, total - held, activations_at_least)
    after_backward = grads
    grads += memory_model.gradients_made_late(late, activations) - late
    return {"parameters": params, "gradients": grads, "optimizer_states": states, "activations": activations}, after_backward
