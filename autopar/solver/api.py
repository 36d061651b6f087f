"""`autopar.plan()`: the one-stage plan (``solver.intra_op``) or a pipeline (``solver.pipeline``),
whichever is predicted faster."""
from __future__ import annotations

import logging

from autopar.cost_model.step import DEFAULT_BUCKET_BYTES
from autopar.errors import ConfigError, PlanError, TraceError
from autopar.sharding_spec.mesh import Mesh
from autopar.solver.explain import pipeline_words
from autopar.solver.intra_op import call_facts, one_stage, planning_mesh
from autopar.solver.layout import Layout
from autopar.solver.microbatches import batch_size
from autopar.solver.pipeline import Pipeline, search
from autopar.solver.plan import Plan
from autopar.solver.units import fmt_s

log = logging.getLogger(__name__)

# The options ``autopar.plan``, ``autopar.parallelize`` and the CLI all take (the rest of ``plan``'s
# keywords serve its own callers).
PLANNING_OPTIONS = ("memory_budget", "cluster", "pipeline", "force", "optimizer", "idle_axes", "identical_axes",
                    "bucket_bytes", "time_limit_s", "solver")


def plan(
    model,
    mesh: Mesh,
    example_inputs=(),
    *,
    example_kwargs=None,
    memory_budget="auto",
    cluster=None,
    pipeline="auto",
    force=None,
    optimizer: str = "adamw",
    idle_axes="auto",
    identical_axes="auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    time_limit_s: float = 60.0,
    solver: str | None = None,
    graph=None,
    op_table=None,
    reuse_blocks: bool = True,
    simplify: bool = True,
    optimizer_sharding: bool = True,
    microbatches: int = 1,
    objective_cutoff_s: float | None = None,
) -> Plan:
    """The cheapest plan of ``model`` on ``mesh``, called as ``model(*example_inputs,
    **example_kwargs)`` (no processes needed: a mesh of 1024 GPUs plans on a laptop).

    The planning options (``PLANNING_OPTIONS``; ``autopar.parallelize`` and the CLI take the same):

    memory_budget: bytes per device (int/float) or a string like "40GB"/"512MiB"; None: no limit;
        "auto" (default): the cluster's device memory where that is a hard limit (the GPU presets:
        80 GB; ``plan.solver["memory_budget_from"]`` says so), else no limit (cpu-gloo).
    cluster: a preset name ("a100-80g", "h100-80g", "cpu-gloo"), a JSON file or a ClusterSpec to
        price with, instead of the mesh's own (``Mesh(..., cluster=)``; default cpu-gloo).
    pipeline: "auto" (default): search pipeline stages too (``autopar.solver.pipeline``), one
        stage allowed; it plans one stage where no pipeline can be searched (``can_pipeline``: no
        batch among the example inputs, a mesh whose slowest axis has one row, a forced
        ``Layout``, a model with no layers to cut). An ``autopar.Pipeline``: search with its given
        fields fixed. None / False: one stage. A plan of more than one stage (or microbatch) has
        ``plan.pipeline`` set.
    force: an ``autopar.Layout`` (e.g. ``Layout(dp=2, tp=2, zero=2)``): the plan of that
        hand-style layout, on every mesh axis; or node name -> family label (e.g. ``{"linear":
        "1d-row", "p_fc_weight": "sharded"}``) or -> a predicate on a ``Strategy``: restricts that
        node's candidates (hand-written plans, tests).
    optimizer: the optimizer whose states are priced: "adamw" / "adam" (2 fp32 values a parameter),
        "sgd_momentum" / "momentum" (1), "sgd" (0).
    idle_axes: mesh axes the plan may leave unused (every rank along them computes the same thing
        and needs no gradient sync there): "auto" tries the candidates of ``idle_candidates`` and
        keeps the cheapest; a tuple fixes them (``()``: use every axis).
    identical_axes: mesh axes on which gradients of replicated values are kept whole on every rank
        (Megatron's tensor-parallel convention; ``autopar.cost_model.gradients``): "auto" prices
        every set the plan can run and keeps the cheapest; a tuple fixes it (``()``: none).
    bucket_bytes: the runtime's gradient bucket size, for pricing the gradient sync.
    time_limit_s, solver: the ILP solver's time limit and name ("highs" / "cbc"; default HiGHS
        where installed).

    For the planner's own callers (the pipeline search, tests): ``graph`` (an already traced
    ``autopar.ir.Graph``: skips tracing), ``op_table`` (profiled op times), ``reuse_blocks`` (tie
    structurally identical layers: solve one block, reuse it), ``simplify`` (eliminate chain nodes
    exactly before solving), ``optimizer_sharding`` (allow ZeRO-2 choices), ``microbatches`` (how
    many times a step runs the traced graph: gradient sync and optimizer are priced at 1 /
    microbatches of a run), ``objective_cutoff_s`` (a plan whose ILP objective is above this is
    of no use: ``ilp.NoCheaperPlan`` instead, found quickly).
    """
    mesh, budget, budget_from = planning_mesh(mesh, cluster, memory_budget)
    call = dict(model=model, example_inputs=example_inputs, example_kwargs=example_kwargs, optimizer=optimizer)
    if pipeline == "auto" and not can_pipeline(model, mesh, example_inputs, example_kwargs, force):
        pipeline = None
    pipelined, search_notes = None, []
    if pipeline not in (None, False):
        if pipeline != "auto" and not isinstance(pipeline, Pipeline):
            raise ConfigError(f"pipeline={pipeline!r}: use None/False (one stage), 'auto' or autopar.Pipeline(...)")
        kw = dict(optimizer=optimizer, op_table=op_table, reuse_blocks=reuse_blocks, simplify=simplify,
                  time_limit_s=time_limit_s, solver=solver, optimizer_sharding=optimizer_sharding, bucket_bytes=bucket_bytes,
                  force=force, idle_axes=idle_axes, identical_axes=())  # stages keep the dual convention
        try:
            choice = search(model, mesh, example_inputs, example_kwargs, pipeline=None if pipeline == "auto" else pipeline,
                            memory_budget=budget, plan_kwargs=kw)
        except (PlanError, TraceError) as err:
            if pipeline != "auto":
                raise
            # e.g. a model without layers to cut; planning one stage says what else is wrong
            log.info("no pipeline searched (%s); planning one stage", err)
            choice = None
        search_notes = choice.notes if choice is not None else []
        if choice is not None and (len(choice.stages) > 1 or choice.microbatches > 1 or choice.stages[0].recompute):
            pipelined = choice.to_plan()
            pipelined.solver.update(memory_budget=budget, memory_budget_from=budget_from,
                                    call=call_facts(**call, notes=choice.graph.notes))
            if pipeline != "auto":  # the caller asked for this pipeline
                return pipelined
        elif graph is None and choice is not None:
            # one stage, one microbatch: the search traced the whole batch's graph
            graph = choice.graph
            log.info("traced %s: %d nodes, %d layers (in the pipeline search)", graph.model_name, len(graph.nodes),
                     len(graph.layers))
    try:
        one = one_stage(graph, mesh, call, budget, budget_from, force, op_table, reuse_blocks, simplify, time_limit_s,
                        solver, optimizer_sharding, idle_axes, identical_axes, bucket_bytes, microbatches,
                        objective_cutoff_s)
    except (PlanError, ConfigError) as err:
        if pipelined is None:
            raise
        pipelined.solver["decided"] = f"a pipeline: one stage cannot be planned ({str(err).splitlines()[0].split('. ')[0]})"
        one = None
    chosen = pipelined if one is None else one if pipelined is None else simpler_unless_faster(one, pipelined, mesh)
    if pipeline not in (None, False) and search_notes:  # said once, in the plan explain prints
        chosen.solver["call"]["notes"] = list(chosen.solver["call"].get("notes", [])) + list(search_notes)
    return chosen


# A plan with more parts (stages, microbatches, recomputation) must be predicted faster than the
# plain one-stage plan by more than the tie margin to be chosen: the live profile's measured spread
# (the rank contention's standard error), at most TIE_MARGIN_CAP. Near a tie the moment's noise in a
# live profile would otherwise decide, and the same job would get other plans run to run. The cap:
# this VM's contention measures 3-6% noisy, and a margin that wide gave up the 4-7% a 2-stage
# pipeline measures over data parallel for the bench's 10M LLaMA (predicted 2.5%).
TIE_MARGIN_CAP = 0.02


def simpler_unless_faster(one: Plan, pipelined: Plan, mesh: Mesh) -> Plan:
    """The one-stage plan, unless the pipelined one is predicted faster by more than the tie margin
    (the cluster's ``measured_spread``, at most ``TIE_MARGIN_CAP``; 0 for presets: strictly
    faster), or the one-stage plan does not fit.
    The choice and its margin are written in ``solver["decided"]`` (``explain`` prints it)."""
    spread = min(mesh.resolved_cluster().measured_spread, TIE_MARGIN_CAP)
    t1, tp = one.predicted["step_time_s"], pipelined.predicted["step_time_s"]
    gain = 1.0 - tp / t1
    what = pipeline_words(pipelined)
    noise = f"the live profile's measured spread ({spread:.1%})"
    if gain > spread:
        pipelined.solver["decided"] = (f"{what}: predicted {gain:.1%} faster than one stage ({fmt_s(t1)})"
                                       + (f", more than {noise}" if spread else ""))
        return pipelined
    if gain > 0:
        one.solver["decided"] = f"one stage: {what} is predicted {gain:.1%} faster, within {noise}, which decides nothing"
    else:
        one.solver["decided"] = f"one stage: the best pipeline ({what}) is predicted {-gain:.1%} slower"
    return one


def can_pipeline(model, mesh: Mesh, example_inputs, example_kwargs, force) -> bool:
    """Whether ``pipeline="auto"`` searches stages: a model and a batch to split (a tensor input
    with a leading dim), a mesh whose slowest axis can be cut, and no forced ``Layout`` (a hand
    layout of the whole mesh, with no pipeline degree)."""
    if model is None or isinstance(force, Layout) or mesh.shape[0] < 2:
        return False
    try:
        batch_size(example_inputs, example_kwargs)  # what the microbatches would split
    except ConfigError:
        return False
    return True


