"""Recomputation priced as the runtime runs it (``record.recompute``; the runtime's side:
``tests/runtime/test_recompute.py``): whole, a layer keeps its input and runs its forward again;
selective, it keeps besides the outputs of its matmuls and attention and runs the rest again. The
planner chooses among the three per stage, and what-ifs say each."""
import pytest

import autopar
from autopar import ir, models
from autopar.cost_model.step import op_overheads_s, step_time
from autopar.ir.blocks import unit_of_nodes
from autopar.ir.graph import needs_grad
from autopar.record.recompute import Recompute, saved_by_selective
from autopar.solver.stage_prices import unit_prices

SHAPE = dict(layers=4, width=64, heads=4, seq=32, vocab=256, batch=8)


@pytest.fixture(scope="module")
def priced():
    model, inputs = models.build("gpt", device="meta", **SHAPE)
    graph = ir.trace(model, inputs)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    plan = autopar.plan(model, mesh, graph=graph, force=autopar.Layout(dp=4), pipeline=False)
    return model, inputs, graph, mesh, plan, unit_prices(plan, graph, mesh)


def test_a_layer_keeps_its_matmul_and_attention_outputs(priced):
    """A GPT block on data parallel 4 keeps, per microbatch, the outputs of c_attn (3 x width), the
    attention, c_proj, c_fc (4 x width) and the MLP's c_proj: 10 x batch / 4 x seq x width floats."""
    *_, p = priced
    b, t, c = SHAPE["batch"] // 4, SHAPE["seq"], SHAPE["width"]
    assert list(p.saved_bytes[1:3]) == [10 * b * t * c * 4] * 2
    selective, full = p.recomputed(Recompute.SELECTIVE), p.recomputed(Recompute.FULL)
    assert selective.recompute is Recompute.SELECTIVE and full.recompute is Recompute.FULL
    assert list(selective.activation_bytes) == list(p.boundary_bytes + p.saved_bytes)
    assert list(full.activation_bytes) == list(p.boundary_bytes)
    assert (selective.activation_bytes[1:3] < p.activation_bytes[1:3]).all()
    # while a layer's backward runs, what it recomputed is live again (the largest layer's, once)
    assert selective.stage_extra_bytes == max(p.activation_bytes - p.saved_bytes) < full.stage_extra_bytes


def test_selective_runs_again_the_forward_of_what_it_does_not_keep(priced):
    _, _, graph, mesh, plan, p = priced
    cluster, grad, unit = mesh.resolved_cluster(), needs_grad(graph), unit_of_nodes(graph)
    again = [0.0] * len(graph.layers)
    for name, n in plan.nodes.items():
        node = graph.nodes[name]
        if node.op == "call_function" and not saved_by_selective(node.target):
            again[unit[name]] += n.compute_s / 3 + op_overheads_s(node, grad, cluster)[0]
    selective, full = p.recomputed(Recompute.SELECTIVE), p.recomputed(Recompute.FULL)
    assert list(selective.per_microbatch_s - p.per_microbatch_s) == pytest.approx(again, rel=1e-12)
    assert (p.per_microbatch_s < selective.per_microbatch_s).all()
    assert (selective.per_microbatch_s < full.per_microbatch_s).all()
    # the step model prices a one-stage record the same
    steps = {r: step_time(plan, graph, mesh, recomputed=r)["step_time_s"] for r in Recompute}
    assert steps[Recompute.SELECTIVE] - steps[Recompute.NONE] == pytest.approx(sum(again), rel=1e-9)
    assert steps[Recompute.NONE] < steps[Recompute.SELECTIVE] < steps[Recompute.FULL]


def test_the_planner_recomputes_selectively_where_that_fits_and_whole_is_slower(priced):
    """Left to choose (``Pipeline(recompute=None)``) under a budget that the plain layer does not
    fit and the selectively recomputed one does, the planner recomputes selectively; with room for
    the plain one, not at all; with room only for whole recomputation, whole."""
    model, inputs, *_ = priced
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    held = {}
    for kind in Recompute:
        plan = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=4), memory_budget=None,
                            pipeline=autopar.Pipeline(stages=1, microbatches=1, recompute=kind))
        assert _recomputed(plan) is kind
        held[kind] = plan.predicted["memory_bytes_per_device"]
    assert held[Recompute.FULL] < held[Recompute.SELECTIVE] < held[Recompute.NONE]
    budgets = {Recompute.NONE: held[Recompute.NONE] * 1.01,
               Recompute.SELECTIVE: (held[Recompute.SELECTIVE] + held[Recompute.NONE]) / 2,
               Recompute.FULL: (held[Recompute.FULL] + held[Recompute.SELECTIVE]) / 2}
    for want, budget in budgets.items():
        plan = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=4), memory_budget=budget,
                            pipeline=autopar.Pipeline(stages=1, microbatches=1))
        assert _recomputed(plan) is want, (want, budget)
        assert _recomputed(autopar.Plan.from_json(plan.to_json())) is want


def _recomputed(plan) -> Recompute:
    """A one-stage plan's recomputation (a plan of one stage and one microbatch recomputing nothing
    is the plain plan: no pipeline)."""
    return Recompute.NONE if plan.pipeline is None else plan.pipeline.stages[0].recomputed


def test_a_schedule_that_splits_the_backward_refuses_selective_recomputation_too():
    from autopar.errors import ConfigError

    with pytest.raises(ConfigError, match="recompute='selective'"):
        autopar.Pipeline(schedule="zero-bubble", recompute="selective")


def test_attention_with_dropout_keeps_its_scores_too():
    """Attention with dropout runs torch's math path on CPU, whose two matmuls' outputs selective
    recomputation keeps: the scores (batch x heads x seq x seq) besides the output."""
    shape = dict(SHAPE, dropout=0.1)
    model, inputs = models.build("gpt", device="meta", **shape)
    graph = ir.trace(model, inputs)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    plan = autopar.plan(model, mesh, graph=graph, force=autopar.Layout(dp=4), pipeline=False)
    p = unit_prices(plan, graph, mesh)
    b, t, c, h = shape["batch"] // 4, shape["seq"], shape["width"], shape["heads"]
    assert list(p.saved_bytes[1:3]) == [(10 * b * t * c + b * h * t * t) * 4] * 2
    assert p.recomputed(Recompute.NONE) is p


def test_ring_attention_is_not_recomputed_selectively():
    """Ring attention's blocks would each be kept: a plan splitting the sequence over a ring is
    recomputed whole or not at all, and asking for selective says why."""
    from autopar.errors import ConfigError

    model, inputs = models.build("gpt", device="meta", **dict(SHAPE, seq=256, batch=2))
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    with pytest.raises(ConfigError, match="recompute='selective'.*ring attention"):
        autopar.plan(model, mesh, inputs, force=autopar.Layout(cp=4), memory_budget=None,
                     pipeline=autopar.Pipeline(stages=1, microbatches=1, recompute="selective"))
    plan = autopar.plan(model, mesh, inputs, force=autopar.Layout(cp=4), memory_budget=None,
                        pipeline=autopar.Pipeline(stages=1, microbatches=1, recompute=None))
    assert _recomputed(plan) is not Recompute.SELECTIVE
