"""Gradient syncs hidden behind backward, in the ILP: the step it minimises is the rest plus
max(0, sync - comm_overlap x backward compute), as the step model prices it. Checked against
every assignment of small random problems, and on a model where charging the syncs in full chose
a plan a hand-written data-parallel layout beat."""
import itertools

import numpy as np
import pytest

import autopar
from autopar import models
from autopar.solver.config import PlanConfig
from autopar.solver.ilp import OnceCost, Problem, evaluate
from autopar.solver.intra_op import _solve_overlapped
from autopar.solver.problem import Overlap


def _random_problem(rng, n_params: int, n_ops: int):
    """Parameters (a synced choice and a cheaper-to-store one) read by a chain of ops whose
    choices trade compute (and so the backward that hides syncs) against resharding."""
    costs, sync, cover, edges = {}, {}, {}, {}
    ops = [f"o{i}" for i in range(n_ops)]
    for i, o in enumerate(ops):
        k = int(rng.integers(2, 4))
        compute = rng.uniform(1.0, 4.0, k)
        costs[o] = compute
        cover[o] = compute * 2 / 3 * rng.uniform(0.3, 1.0)
        if i:
            edges[(ops[i - 1], o)] = rng.uniform(0.0, 1.5, (len(costs[ops[i - 1]]), k))
    for j in range(n_params):
        p = f"p{j}"
        s = rng.uniform(0.5, 3.0, 2) * np.array([1.0, rng.uniform(0.0, 0.5)])
        costs[p] = s + rng.uniform(0.0, 0.5, 2)
        sync[p] = s
        o = ops[int(rng.integers(n_ops))]
        edges[(p, o)] = rng.uniform(0.0, 1.0, (2, len(costs[o])))
    memory = {v: np.zeros(len(c)) for v, c in costs.items()}
    # the params' first choices sync in one group or two, each paying its first call once (never
    # hidden), and a share of each sync is in the last bucket (never hidden either)
    groups = [[], []]
    for p in sync:
        groups[int(rng.integers(2))].append((p, p, np.array([True, False])))
    once = [OnceCost(float(rng.uniform(0.1, 0.6)), members) for members in groups if members]
    spread = {p: s * rng.uniform(0.05, 0.3) for p, s in sync.items()}
    floors = [(oc.cost, [(u, m) for u, _, m in oc.members]) for oc in once]
    return Problem(costs, memory, edges, once=once), Overlap(sync, cover, spread, floors)


def _step(problem, overlap, pick):
    """The rest, the last bucket and what the cover leaves of the syncs past it."""
    hidable = overlap.total(overlap.sync, pick) - overlap.total(overlap.spread, pick)
    return evaluate(problem, pick)[0] - hidable + max(0.0, hidable - overlap.total(overlap.cover, pick))


@pytest.mark.parametrize("simplify", [True, False])
def test_the_overlapped_step_is_minimised_exactly_or_within_its_stated_bound(simplify):
    rng = np.random.default_rng(7)
    config = PlanConfig(reuse_blocks=False, simplify=simplify, solver="highs" if _highs() else "cbc")
    seen, gaps = set(), []
    for _ in range(60):
        problem, overlap = _random_problem(rng, int(rng.integers(1, 4)), int(rng.integers(2, 5)))
        attempt, stats = _solve_overlapped(None, problem, overlap, None, config)
        names = list(problem.costs)
        best = min(_step(problem, overlap, dict(zip(names, combo)))
                   for combo in itertools.product(*(range(len(problem.costs[v])) for v in names)))
        assert attempt[4] == pytest.approx(_step(problem, overlap, attempt[2]), rel=1e-9)
        seen.add(stats["sync_hidden"])
        if stats["sync_hidden"] == "bounded":  # the dual's bound below the best, the answer near it
            assert stats["objective_bound_s"] <= best + 1e-9 <= attempt[4] + 1e-9
            gaps.append(attempt[4] / best - 1)
        else:
            assert attempt[4] == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert {"all", "in part", "bounded"} <= seen, seen
    assert np.median(gaps) <= 1e-9 and max(gaps) < 0.05, sorted(gaps)


def _highs() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def test_no_overlap_no_change():
    """Where ranks share their cores with the collectives (cpu-gloo: comm_overlap 0), nothing is
    hidden: the ILP charges every sync, as before."""
    model, inputs = models.build("gpt", layers=2)
    plan = autopar.plan(model, autopar.Mesh((4,)), inputs, pipeline=False)
    assert "sync_hidden" not in plan.solver


def test_a_gpu_plan_prices_its_syncs_as_the_step_model_hides_them():
    """On H100s (comm_overlap 1) a LLaMA's data-parallel syncs hide behind backward but for the
    last bucket. Charged in full, the ILP took ZeRO-3 and a data-parallel what-if was predicted
    4.7% faster than the plan; now the objective is the step model's step and no data-parallel
    or 2-D layout beats the plan."""
    from autopar.solver.compare import compare

    shape = dict(vocab=8192, width=1024, layers=4, heads=8, kv_heads=4, hidden=2816, seq=1024, batch=32)
    model, inputs = models.build("llama", device="meta", **shape)
    mesh = autopar.Mesh((4, 4), cluster="h100-80g")
    plan = autopar.plan(model, mesh, inputs, pipeline=False)
    p = plan.predicted
    assert plan.solver["sync_hidden"] != "in part" and p["exposed_sync_s"] < p["grad_sync_s"] / 4
    assert plan.solver["objective_s"] <= plan.solver.get("objective_bound_s", plan.solver["objective_s"]) * 1.001
    assert plan.solver["sync_floor_s"] == pytest.approx(p["exposed_sync_s"], rel=1e-9)
    assert plan.solver["objective_s"] == pytest.approx(p["step_time_s"], rel=1e-9)
    rows = compare(model, mesh, inputs, ["dp=16", "dp=16,zero=3", "tp=2,dp=8", "tp=4,dp=4"])
    assert all(r.step_time_s >= p["step_time_s"] * (1 - 1e-9) for r in rows), [(r.name, r.step_time_s) for r in rows]
