"""Simplification keeps the optimum: on small real models, the plan solved with chain elimination
and repeated-block reuse costs the same as the full ILP; on graphs of at most 8 nodes the full ILP
equals brute-force enumeration."""
import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar import ir, models
from autopar.solver.ilp import brute_force, solve
from autopar.solver.problem import build_problem

warnings.simplefilter("ignore")


@pytest.mark.parametrize(
    "name, kw, mesh",
    [
        ("mlp", {"layers": 3}, (2,)),
        ("mlp", {"layers": 2}, (2, 2)),
        ("gpt", {"layers": 2}, (2,)),
        ("llama", {"layers": 2}, (2,)),
    ],
)
def test_simplified_optimum_equals_full_ilp(name, kw, mesh):
    model, inputs = models.build(name, **kw)
    graph = ir.trace(model, inputs)
    m = autopar.Mesh(mesh, cluster="a100-80g")
    fast = autopar.plan(model, m, inputs, graph=graph, pipeline=False)
    full = autopar.plan(model, m, inputs, graph=graph, simplify=False, reuse_blocks=False, pipeline=False)
    assert fast.solver["ilp_nodes_solved"] < full.solver["ilp_nodes_solved"]
    assert fast.solver["objective_s"] == pytest.approx(full.solver["objective_s"], rel=1e-6)


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 32)

    def forward(self, x):
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
def test_ilp_equals_brute_force_on_a_real_small_graph(mesh):
    model = OneLinear()
    graph = ir.trace(model, (torch.randn(16, 64),))
    assert len(graph.nodes) <= 8
    problem = build_problem(graph, autopar.Mesh(mesh, cluster="a100-80g")).problem
    _, best = brute_force(problem)
    assert solve(problem).objective == pytest.approx(best, rel=1e-9)
