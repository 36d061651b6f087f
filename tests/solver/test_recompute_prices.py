"""Recomputation priced as the runtime runs it (``record.recompute``; the runtime's side:
``tests/runtime/test_recompute.py``): whole, a layer keeps its input and runs its forward again;
selective, it keeps besides the outputs of its matmuls and attention and runs the rest again. The
planner chooses among the three per stage, and what-ifs say each."""
import pytest

import autopar
from autopar import ir, models
from autopar.cost_model.step import in_op_comm_parts, op_overheads_s, reshard_parts_by_read, step_time
from autopar.cost_model.memory import run_again
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
        if node.op == "call_function" and not saved_by_selective(node.target) and name in run_again(graph):
            again[unit[name]] += n.compute_s / 3 + op_overheads_s(node, grad, cluster)[0]
    again = [a + c for a, c in zip(again, _forward_comm(plan, graph, mesh, unit))]  # (the next test's)
    selective, full = p.recomputed(Recompute.SELECTIVE), p.recomputed(Recompute.FULL)
    assert list(selective.per_microbatch_s - p.per_microbatch_s) == pytest.approx(again, rel=1e-12)
    assert (p.per_microbatch_s < selective.per_microbatch_s).all()
    assert (selective.per_microbatch_s < full.per_microbatch_s).all()
    # the step model prices a one-stage record the same
    steps = {r: step_time(plan, graph, mesh, recomputed=r)["step_time_s"] for r in Recompute}
    assert steps[Recompute.SELECTIVE] - steps[Recompute.NONE] == pytest.approx(sum(again), rel=1e-9)
    assert steps[Recompute.NONE] < steps[Recompute.SELECTIVE] < steps[Recompute.FULL]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_layer_runs_again_up_to_its_last_op_that_saves_a_tensor(name):
    """torch's checkpoint stops recomputing once it has every tensor backward saved: after a
    block's last matmul (its input saved) come only the dropout (GPT's, p = 0) and the residual add,
    which do not run again; in the last unit the head and the loss save their inputs, so all runs."""
    model, inputs = models.build(name, device="meta", **SHAPE)
    graph = ir.trace(model, inputs)
    unit = unit_of_nodes(graph)
    skipped = [n for n, node in graph.nodes.items() if node.op == "call_function" and n not in run_again(graph)]
    per_unit = {u: [graph.nodes[n].target for n in skipped if unit[n] == u] for u in range(len(graph.layers))}
    tail = ["aten.dropout.default", "aten.add.Tensor"] if name == "gpt" else ["aten.add.Tensor"]
    assert per_unit == {**{u: tail for u in range(len(graph.layers) - 1)}, len(graph.layers) - 1: []}


def _forward_comm(plan, graph, mesh, unit) -> list[float]:
    """Per unit, the forward seconds of the collectives its ops run: its reads' reshards and
    those inside its ops."""
    comm = [0.0] * len(graph.layers)
    for (dst, _), (forward, _) in reshard_parts_by_read(graph, plan.edges, mesh, plan.identical_axes).items():
        if dst in run_again(graph):
            comm[unit[dst]] += forward
    for name, n in plan.nodes.items():
        if name in run_again(graph):
            comm[unit[name]] += in_op_comm_parts(n, graph, mesh, plan.identical_axes)[0]
    return comm


@pytest.mark.parametrize("force", [autopar.Layout(dp=2, tp=2), autopar.Layout(tp=4), autopar.Layout(dp=4, zero=3)])
def test_recomputation_runs_the_forward_collectives_again(force):
    """Every piece of a recomputed stage is checkpointed, and no policy saves a collective's
    output: whole or selective, the forward of its reshards (a ZeRO-3 group's gather once) and
    of the collectives inside its ops (the vocabulary-parallel loss's) run again in backward."""
    model, inputs = models.build("gpt", device="meta", **SHAPE)
    graph = ir.trace(model, inputs)
    mesh = autopar.Mesh((2, 2) if force.dp == 2 else (4,), cluster="a100-80g")
    plan = autopar.plan(model, mesh, graph=graph, force=force, pipeline=False)
    cluster, grad, unit = mesh.resolved_cluster(), needs_grad(graph), unit_of_nodes(graph)
    compute = {r: [0.0] * len(graph.layers) for r in Recompute}
    for name, n in plan.nodes.items():
        node = graph.nodes[name]
        if node.op == "call_function" and name in run_again(graph):
            again = n.compute_s / 3 + op_overheads_s(node, grad, cluster)[0]
            compute[Recompute.FULL][unit[name]] += again
            compute[Recompute.SELECTIVE][unit[name]] += 0.0 if saved_by_selective(node.target) else again
    comm = _forward_comm(plan, graph, mesh, unit)
    assert sum(comm) > 0
    if force.zero == 3:  # a group's gather is once per layer, not once per parameter read
        assert sum(comm) < sum(e.forward_s for e in plan.edges)
    p = unit_prices(plan, graph, mesh)
    base = step_time(plan, graph, mesh)["step_time_s"]
    for r in (Recompute.FULL, Recompute.SELECTIVE):
        want = [c + m for c, m in zip(compute[r], comm)]
        assert list(p.recomputed(r).per_microbatch_s - p.per_microbatch_s) == pytest.approx(want, rel=1e-9)
        assert step_time(plan, graph, mesh, recomputed=r)["step_time_s"] - base == pytest.approx(sum(want), rel=1e-9)


def test_the_planner_recomputes_selectively_where_that_fits_and_whole_is_slower():
    """Left to choose (``Pipeline(recompute=None)``) under a budget that the plain layer does not
    fit and the selectively recomputed one does, the planner recomputes selectively; with room for
    the plain one, not at all; with room only for whole recomputation, whole. (A batch whose
    activations outweigh a bucket of gradients: below that the gradients the reducer collects set
    the peak, recomputed or not: ``memory.grad_parts_in_flight``.)"""
    model, inputs = models.build("gpt", device="meta", **dict(SHAPE, batch=64))
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
