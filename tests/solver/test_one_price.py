"""One price: the ILP's objective of the plan it chooses is the step model's price of that plan,
to rounding, on every preset, for the layouts users force and the ones the planner picks. The
ILP's coefficients and the step model read the same formulas: each gradient sync group's first
calls paid once (``cost_model.grad_sync``), a reshard's backward as the step model prices it
(``cost_model.gradients.backward_route_s``), parameters gathered a layer per call, the op
overheads a constant, on GPUs the syncs hidden behind backward but for the last bucket, and the
gradient convention of each set of identical axes tried (``record.gradients``) in its own ILP."""
import sys
from pathlib import Path

import pytest

import autopar
from autopar import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_zoo  # noqa: E402

CLUSTERS = ("cpu-gloo", "a100-80g", "h100-80g")
LAYOUTS = {
    (4,): (None, autopar.Layout(dp=4), autopar.Layout(dp=4, zero=2), autopar.Layout(dp=4, zero=3), autopar.Layout(tp=4)),
    (2, 2): (None, autopar.Layout(dp=2, tp=2), autopar.Layout(dp=2, tp=2, zero=2), autopar.Layout(dp=2, tp=2, zero=3)),
}


def _models():
    return {
        "gpt": models.build("gpt", layers=2),
        "llama": models.build("llama", layers=2),
        "mlp": models.build("mlp"),
        "mingpt": models_zoo.mingpt(),
        "vit": models_zoo.vit(),
    }


def _check(plan, label):
    p = plan.predicted
    assert plan.solver["objective_s"] == pytest.approx(p["step_time_s"], rel=1e-9), (label, plan.solver, p)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_the_objective_is_the_step_models_price_of_the_chosen_plan(cluster):
    checked, whole = 0, 0
    for name, (model, inputs) in _models().items():
        for shape, layouts in LAYOUTS.items():
            mesh = autopar.Mesh(shape, cluster=cluster)
            for layout in layouts:
                if layout is not None and layout.tp > 1 and name in ("vit",):
                    continue  # (tensor parallel layouts name transformer blocks of language models)
                label = (name, shape, cluster, layout)
                try:
                    plan = autopar.plan(model, mesh, inputs, pipeline=False, force=layout)
                except autopar.PlanError:
                    continue  # a layout this model cannot take
                _check(plan, label)
                checked += 1
                whole += bool(plan.identical_axes)
    assert checked >= 35, checked
    assert whole >= 1, "no plan kept gradients whole on any axis: the convention's prices went untested"


def test_the_convention_is_chosen_by_the_ilps_of_each_set():
    """``identical_axes="auto"`` (the default) solves one ILP per set of axes kept whole: the plan
    is the cheapest of them, and every set's objective is its plan's price."""
    model, inputs = models.build("gpt", layers=2)
    for cluster in CLUSTERS:
        mesh = autopar.Mesh((2, 2), cluster=cluster)
        layout = autopar.Layout(dp=2, tp=2)
        plan = autopar.plan(model, mesh, inputs, pipeline=False, force=layout)
        _check(plan, cluster)
        prices = {}
        for axes in ((), (0,), (1,), (0, 1)):
            try:
                forced = autopar.plan(model, mesh, inputs, pipeline=False, force=layout, identical_axes=axes)
            except autopar.PlanError:
                continue
            assert forced.identical_axes == axes
            _check(forced, (cluster, axes))
            prices[axes] = forced.predicted["step_time_s"]
        assert () in prices and (1,) in prices, prices  # dual, and Megatron's on the tensor-parallel axis
        assert plan.predicted["step_time_s"] == pytest.approx(min(prices.values()), rel=1e-9), (cluster, prices)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_accumulated_microbatches_price_as_their_ilp(cluster):
    """One stage run on 4 microbatches (gradient accumulation) is priced through the stage tables:
    its step is 4 x its stage's time per microbatch, which is the ILP's objective of that stage
    (per-step work at a quarter a run). A parameter read by two layers (GPT's tied embedding and
    head) is counted once in a stage holding both."""
    checked = 0
    for name, build in (("gpt", dict(layers=2, batch=16)), ("llama", dict(layers=2, batch=16))):
        model, inputs = models.build(name, **build)
        for shape, layouts in LAYOUTS.items():
            for layout in layouts:
                try:
                    plan = autopar.plan(model, autopar.Mesh(shape, cluster=cluster), inputs, force=layout,
                                        pipeline=autopar.Pipeline(stages=1, microbatches=4))
                except autopar.PlanError:
                    continue
                (stage,) = plan.pipeline.stages
                assert plan.pipeline.microbatches == 4
                label = (name, shape, layout)
                assert stage.time_per_microbatch_s == pytest.approx(stage.plan.solver["objective_s"], rel=1e-9), label
                assert plan.predicted["step_time_s"] == pytest.approx(4 * stage.time_per_microbatch_s, rel=1e-9), label
                checked += 1
    assert checked >= 12, checked


def _record_prices(plan, model, inputs):
    """Each stage's time per microbatch and what of it is paid once a step, priced afresh from the
    plan's record: the stage's own plan and the reshards of what it receives
    (``StagePlan.received``) by the step model run ``microbatches`` times
    (``cost_model.step.step_time``), and the values codegen sends it (``codegen.stages``) point to
    point, forward and their gradients back."""
    import dataclasses

    from autopar import ir
    from autopar.codegen.stages import cut_stages, sent_specs
    from autopar.cost_model.comm import send_time
    from autopar.cost_model.grad_sync import grad_bytes_total
    from autopar.cost_model.step import step_time
    from autopar.ir.precision import MixedPrecision, working_call
    from autopar.record.schedules import schedule_named
    from autopar.sharding_spec.reshard import local_bytes
    from autopar.solver.microbatches import microbatch_inputs

    p = plan.pipeline
    m = p.microbatches
    precision = MixedPrecision.from_dict(plan.precision) if plan.precision else None
    if precision is not None:
        model, (inputs, _) = working_call(model, (inputs, {}), precision)
    graph = ir.trace(model, microbatch_inputs(inputs, {}, m)[0])
    assert graph.fingerprint() == plan.model_fingerprint
    cuts = cut_stages(graph, plan)
    specs, grads = sent_specs(graph, plan, cuts), ir.graph.needs_grad(graph)
    overlapped = schedule_named(p.schedule).overlaps_sync
    times, once = [], []
    for k, (stage, cut) in enumerate(zip(p.stages, cuts)):
        mesh = autopar.Mesh.from_dict(stage.plan.mesh)
        record = dataclasses.replace(stage.plan, edges=list(stage.plan.edges) + list(stage.received))
        parts = step_time(record, graph, mesh, runs=m, overlapped=overlapped, recomputed=stage.recomputed,
                          grad_total_bytes=grad_bytes_total(graph, precision))
        t = parts["step_time_s"] / m
        if k:
            sender = autopar.Mesh.from_dict(p.stages[k - 1].plan.mesh)
            nbytes = {v: local_bytes(specs[v], sender.shape, graph.nodes[v].meta.itemsize) for v in cut.receives}
            back = sum(n for v, n in nbytes.items() if v in grads)
            t += send_time(sum(nbytes.values()), plan.mesh_obj, (0,)) + (send_time(back, plan.mesh_obj, (0,)) if back else 0)
        times.append(t)
        once.append(sum(parts[part] for part in ("exposed_sync_s", "param_gather_s", "zero2_fresh_s", "optimizer_s")))
    return graph, times, once


def _pipeline_step(plan, graph, times, once):
    """The step of stages taking ``times`` a microbatch (``once`` of it per step) under the plan's
    schedule: its formula, or where ranks share cores the simulated one
    (``pipeline.shared_core_time``), and what the step runs after it (``step_extras``)."""
    import numpy as np

    from autopar.cost_model.schedules import step_time as schedule_step
    from autopar.record.schedules import schedule_named
    from autopar.solver.pipeline import shared_core_time
    from autopar.solver.stage_dp import StageSolution
    from autopar.solver.stage_prices import step_extras

    p, mesh = plan.pipeline, plan.mesh_obj
    schedule = schedule_named(p.schedule)
    stages = [(s.layers[0], s.layers[1], k) for k, s in enumerate(p.stages)]
    sol = StageSolution(stages, schedule_step(schedule, times, p.microbatches, p.virtual_stages), max(times), times)
    rows = np.array([s.rows[1] - s.rows[0] + 1 for s in p.stages])
    step = shared_core_time(sol, rows, p.microbatches, mesh.resolved_cluster().rank_contention, mesh.shape[0], schedule,
                            [p.microbatches * t for t in once])
    groups = [[u] for u in range(len(graph.layers))]
    return step + step_extras(graph, groups, stages, len(stages) // p.virtual_stages, mesh)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_a_pipeline_is_priced_as_its_record_runs(cluster):
    """Every stage of a pipelined plan takes, per microbatch, what its record prices afresh: the
    step model over its own plan and received reshards, run once per microbatch, its gradient
    syncs once a step (each group's first calls in full, hidden behind its last microbatch's
    backward under GPipe and 1F1B, after the schedule under the others), recomputation, and the
    values it receives; the plan's step is its schedule over those times and the step's extras.
    Tied (GPT) and untied (LLaMA) weights, bf16 over fp32 masters, data x tensor parallel stages,
    every schedule, and the stages the search picks unforced."""
    checked = 0
    cases = [("gpt", (4,), dict(schedule=s)) for s in ("1f1b", "gpipe", "zero-bubble", "interleaved-1f1b")]
    cases += [("llama", (4,), dict(schedule="1f1b")), ("llama", (2, 2), dict(recompute=True)),
              ("gpt", (4, 2), dict(microbatches=8)), ("llama", (4, 2), {}),
              ("gpt", (2, 2), dict(schedule="gpipe", recompute="selective"))]
    for name, shape, pipeline in cases:
        model, inputs = models.build(name, layers=4, batch=16)
        for precision in (None, "bf16"):
            plan = autopar.plan(model, autopar.Mesh(shape, cluster=cluster), inputs, precision=precision,
                                pipeline=autopar.Pipeline(**{"stages": 2, **pipeline}))
            label = (name, shape, pipeline, precision)
            graph, times, once = _record_prices(plan, model, inputs)
            assert [s.time_per_microbatch_s for s in plan.pipeline.stages] == pytest.approx(times, rel=1e-9), label
            assert plan.predicted["step_time_s"] == pytest.approx(_pipeline_step(plan, graph, times, once), rel=1e-9), label
            checked += 1
    assert checked == 18


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_one_stage_and_a_pipeline_are_priced_by_one_function(cluster):
    """``autopar.plan`` compares the one-stage plan with the best pipeline (``simpler_unless_faster``)
    by one price: a one-stage, one-microbatch result of the pipeline search (its stage tables,
    schedule and extras) prices the plan the one-stage ILP makes at the one-stage plan's step."""
    from autopar.solver.pipeline import search

    checked = 0
    for name in ("gpt", "llama"):
        model, inputs = models.build(name, layers=2, batch=8)
        for shape in ((4,), (2, 2)):
            mesh = autopar.Mesh(shape, cluster=cluster)
            choice = search(model, mesh, inputs, identical_axes=(), pipeline=autopar.Pipeline(stages=1, microbatches=1))
            one = autopar.plan(model, mesh, inputs, pipeline=False, identical_axes=())
            (stage,) = choice.stages
            assert set(stage.plan.nodes) == set(one.nodes)
            if any(stage.plan.nodes[k].family != n.family for k, n in one.nodes.items()):
                continue  # a tie the two ILPs broke otherwise
            assert choice.step_time_s == pytest.approx(one.predicted["step_time_s"], rel=1e-9), (name, shape)
            checked += 1
    assert checked >= 3, checked
