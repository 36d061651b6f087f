"""`autopar.plan()`: the one-stage plan (``solver.intra_op``) or a pipeline (``solver.pipeline``),
whichever is predicted faster."""
from __future__ import annotations

import logging

from autopar.errors import ConfigError, PlanError, TraceError
from autopar.ir.precision import working_call
from autopar.ir.flops import model_flops
from autopar.ir.trace import trace
from autopar.sharding_spec.mesh import Mesh
from autopar.solver.config import PlanConfig
from autopar.solver.explain import pipeline_words
from autopar.solver.intra_op import call_facts, one_stage, planning_mesh
from autopar.solver.layout import Layout
from autopar.solver.microbatches import batch_size
from autopar.solver.pipeline import search
from autopar.solver.plan import Plan
from autopar.solver.units import fmt_s

log = logging.getLogger(__name__)


def plan(model, mesh: Mesh, example_inputs=(), *, example_kwargs=None, config: PlanConfig | None = None,
         graph=None, **options) -> Plan:
    """The cheapest plan of ``model`` on ``mesh``, called as ``model(*example_inputs,
    **example_kwargs)`` (no processes needed: a mesh of 1024 GPUs plans on a laptop).

    config: an ``autopar.PlanConfig``, the planning options ``autopar.parallelize`` and the CLI
        share (its docstring lists them: memory_budget, cluster, pipeline, force, optimizer,
        idle_axes, identical_axes, bucket_bytes, time_limit_s, solver); default: every option at
        its default.
    options: any ``PlanConfig`` field as a keyword, applied over ``config``
        (``plan(model, mesh, x, pipeline=False, memory_budget="40GB")``).
    graph: an already traced ``autopar.ir.Graph`` of the call (skips tracing).

    A plan of more than one stage (or microbatch) has ``plan.pipeline`` set; ``plan.solver["decided"]``
    says why it was chosen over one stage.
    """
    config = PlanConfig.of(config, **options)
    if config.precision is not None:  # traced (and so priced) as it computes
        model, (example_inputs, example_kwargs) = working_call(model, (example_inputs, example_kwargs), config.precision)
    mesh, budget, budget_from = planning_mesh(mesh, config.cluster, config.memory_budget)
    call = dict(model=model, example_inputs=example_inputs, example_kwargs=example_kwargs, optimizer=config.optimizer)
    pipeline = config.pipeline
    if pipeline == "auto" and not can_pipeline(model, mesh, example_inputs, example_kwargs, config.force):
        pipeline = None
    pipelined, search_notes, scaled = None, [], False
    if pipeline is not None:
        try:  # (stages keep the dual gradient convention)
            choice = search(model, mesh, example_inputs, example_kwargs, memory_budget=budget,
                            config=config.replace(identical_axes=()))
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
                                    call=call_facts(**call, notes=choice.graph.notes,
                                                    flops=model_flops(choice.graph) * choice.microbatches))
            if pipeline != "auto":  # the caller asked for this pipeline
                return pipelined
        elif graph is None and choice is not None:
            # one stage, one microbatch: the search traced the whole batch's graph
            graph = choice.graph
            log.info("traced %s: %d nodes, %d layers (in the pipeline search)", graph.model_name, len(graph.nodes),
                     len(graph.layers))
        if graph is None and choice is not None and choice.whole is not None:
            # the whole batch's graph as the search holds it: a trace saved where it was read off two
            graph, scaled = choice.whole, not choice.whole_traced
    one, chosen = _one_stage_or_pipeline(graph, mesh, call, budget, budget_from, config, pipelined)
    if scaled and chosen is one:  # a one-stage plan is run on its own trace: planned on a scaled graph, check it
        inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        traced = trace(model, tuple(inputs), example_kwargs)
        if traced.fingerprint() != graph.fingerprint():
            one, chosen = _one_stage_or_pipeline(traced, mesh, call, budget, budget_from, config, pipelined)
    if pipeline is not None and search_notes:  # said once, in the plan explain prints
        chosen.solver["call"]["notes"] = list(chosen.solver["call"].get("notes", [])) + list(search_notes)
    return chosen


def _one_stage_or_pipeline(graph, mesh, call, budget, budget_from, config, pipelined):
    """(the one-stage plan or None where there is none beside a pipeline, the plan chosen)."""
    try:
        one = one_stage(graph, mesh, call, budget, budget_from, config)
    except (PlanError, ConfigError) as err:
        if pipelined is None:
            raise
        pipelined.solver["decided"] = f"a pipeline: one stage cannot be planned ({str(err).splitlines()[0].split('. ')[0]})"
        return None, pipelined
    return one, one if pipelined is None else simpler_unless_faster(one, pipelined, mesh)


# A plan with more parts (stages, microbatches, recomputation) must be predicted faster than the
# plain one-stage plan by more than the live profile's measured spread (the rank contention's
# standard error) to be chosen: within it, the moment's noise in the profile would decide, and the
# same job would get other plans run to run. The rule is the measurement's own; no constant bounds it.


def simpler_unless_faster(one: Plan, pipelined: Plan, mesh: Mesh) -> Plan:
    """The one-stage plan, unless the pipelined one is predicted faster by more than the cluster's
    ``measured_spread`` (0 for presets: strictly faster), or the one-stage plan does not fit.
    The choice and its margin are written in ``solver["decided"]`` (``explain`` prints it)."""
    spread = mesh.resolved_cluster().measured_spread
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


