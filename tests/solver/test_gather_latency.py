"""Parameters stored split and gathered before use (ZeRO-3 / FSDP) are gathered one collective per
layer. The ILP prices each gathered edge at its share of the call's bytes and the call's latency
once per (layer, axes) (``ilp.OnceCost``), so its objective is the step model's price of the same
reshards (``_uncharged`` is zero: a collective's time is linear in its bytes). These
tests pin that for any storage of the parameters, and the plan's objective against the step model."""
import math
import random

import numpy as np
import pytest

import autopar
from autopar import ir, models
from autopar.cost_model.comm import layout_copy_time, mesh_collective_time
from autopar.record.gathers import param_gather_groups
from autopar.ir.graph import Role
from autopar.solver import ilp
from autopar.cost_model.step import reshard_s
from autopar.solver.problem import build_problem, node_choices, planned_edges

MESH = autopar.Mesh((4,), cluster="cpu-gloo")


@pytest.fixture(scope="module")
def gpt():
    model, inputs = models.build("gpt", device="meta", vocab=64, width=32, layers=2, heads=4, seq=16, batch=8)
    return model, inputs, ir.trace(model, inputs)


def _random_solution(graph, choices, built, rng):
    """The ILP's optimum with every parameter's storage redrawn at random among candidates whose
    edges are all reachable (finite)."""
    problem = built.problem
    sol = ilp.solve(problem)
    full = dict(sol.choice)
    for name, c in choices.items():
        if graph.nodes[name].op == "placeholder" and graph.nodes[name].role == Role.PARAMETER:
            full[name] = rng.randrange(len(c.strategies))
    cost, _ = ilp.evaluate(problem, full)
    return full, cost


@pytest.mark.parametrize("cluster", ["cpu-gloo", "a100-80g"])
def test_the_ilp_prices_any_storage_of_the_parameters_as_the_step_model(gpt, cluster):
    _, _, graph = gpt
    mesh = autopar.Mesh((4,), cluster=cluster)
    choices = node_choices(graph, mesh)
    built = build_problem(graph, mesh, choices=choices)
    rng = random.Random(0)
    checked = gathered = 0
    for _ in range(40):
        full, cost = _random_solution(graph, choices, built, rng)
        if not np.isfinite(cost):
            continue
        # the ILP charged exactly what the step model prices for the parameters' reshards
        assert _uncharged(graph, built, full, mesh) == pytest.approx(0.0, abs=1e-9 * cost)
        gathered += any(oc.paid(full) for oc in built.problem.once)
        checked += 1
    assert checked >= 20 and gathered >= 10


def test_a_plan_gathering_part_of_a_layer_pays_one_call_per_layer(gpt):
    model, inputs, graph = gpt
    # every linear weight stored split over the 4 devices and gathered (ZeRO-3), norms replicated:
    # part of each layer is gathered: still one call per layer
    force = {}
    for fqn, node in graph.params.items():
        if fqn.endswith(".weight") and ("attn" in fqn or "mlp" in fqn):
            force[node] = "sharded"
    # (the dual convention: the problem rebuilt below prices it)
    plan = autopar.plan(model, MESH, inputs, force=force, pipeline=False, identical_axes=())
    groups, _ = param_gather_groups(graph, plan.edges)
    assert groups, "the forced plan gathers split weights layer by layer"
    choices = node_choices(graph, MESH, force=force)
    built = build_problem(graph, MESH, choices=choices)
    full = {name: next(i for i, s in enumerate(c.strategies) if s.output == plan.nodes[name].output
                       and s.family == plan.nodes[name].family and list(s.inputs) == plan.nodes[name].inputs)
            for name, c in choices.items()}
    cost, _ = ilp.evaluate(built.problem, full)
    correction = _uncharged(graph, built, full, MESH)
    # one call's latency per (layer, axes) and direction, however few of the layer's parameters
    # are gathered, and each gathered parameter's bytes once: the ILP pays exactly the step model's
    # groups (a lone parameter is its own), packing copies included
    paid = [oc for oc in built.problem.once if oc.paid(full) and not _is_sync_group(oc, graph)]
    lone, _ = param_gather_groups(graph, plan.edges, least=1)
    assert len(lone) >= len(groups)
    cluster = MESH.resolved_cluster()
    expected = 0.0
    for (_, axes), members in lone.items():
        n = math.prod(MESH.shape[a] for a in axes)
        for kind in ("all_gather", "reduce_scatter"):
            expected += mesh_collective_time(kind, 0, MESH, axes)
            for _, e in members:
                b = e.steps[0].nbytes
                expected += (mesh_collective_time(kind, b, MESH, axes) - mesh_collective_time(kind, 0, MESH, axes)
                             + layout_copy_time(b / n + b, cluster))
    assert sum(oc.cost for oc in paid) == pytest.approx(expected, rel=1e-9)
    assert correction == pytest.approx(0.0, abs=1e-9 * cost)
    step = plan.predicted
    # the objective is the step model's price of the same parts (syncs at the ILP's bucket shares)
    assert plan.solver["objective_s"] == pytest.approx(
        step["compute_s"] + step["overhead_s"] + step["reshard_s"] + step["optimizer_s"] + step["grad_accumulate_s"]
        + _sync_share(plan), rel=1e-6)
    assert plan.solver["objective_s"] == pytest.approx(cost + correction + step["overhead_s"], rel=1e-9)


def _uncharged(graph, built, full, mesh) -> float:
    """The step model's price of solution ``full``'s parameter reshards (``reshard_s``: one
    all-gather and one reduce-scatter of a layer's summed bytes per group) less what the ILP
    charged for them (each gathered edge its bytes, each group its calls' latency once)."""
    params = {n for n in built.choices if graph.nodes[n].op == "placeholder" and graph.nodes[n].role == Role.PARAMETER}
    edges = planned_edges(graph, built, full, mesh, params)
    charged = sum(float(built.problem.edges[(u, v)][full[u], full[v]]) for u, v in {(e.src, e.dst) for e in edges})
    charged += sum(oc.cost for oc in built.problem.once if oc.paid(full) and not _is_sync_group(oc, graph))
    return reshard_s(graph, edges, mesh) - charged


def _is_sync_group(oc, graph) -> bool:
    """Whether a once-paid cost is a gradient sync group's first calls (members: parameters alone)."""
    return all(u == v and graph.nodes[u].op == "placeholder" for u, v, _ in oc.members)


def _sync_share(plan) -> float:
    """What the ILP charges for gradient syncs: each parameter's share of its buckets."""
    return sum(p.grad_sync_s for p in plan.params.values())


@pytest.mark.parametrize("cluster", ["cpu-gloo", "a100-80g"])
def test_the_objective_prices_a_plans_reshards_as_the_step_model(cluster):
    """The plan's objective is the step model's price: compute, the optimizer's, the syncs and the
    reshards', gathers grouped per layer, each parameter once (a tied embedding and head in one
    group are one gather)."""
    model, inputs = models.build("gpt", vocab=256, width=64, layers=2, heads=4, seq=16, batch=8)
    mesh = autopar.Mesh((4,), cluster=cluster)
    for force in (autopar.Layout(dp=4, zero=3), autopar.Layout(dp=2, tp=2, zero=3), None):
        m = mesh if force is None or force.tp == 1 else autopar.Mesh((2, 2), cluster=cluster)
        plan = autopar.plan(model, m, inputs, force=force, pipeline=False, identical_axes=())
        assert plan.solver["objective_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-9), force
