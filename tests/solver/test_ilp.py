"""The ILP against brute force, and the exactness of chain elimination."""
import numpy as np
import pytest

from autopar.errors import PlanError
from autopar.solver.ilp import NoCheaperPlan, Problem, brute_force, evaluate, min_memory, solve
from autopar.solver.simplify import eliminate, recover


def random_problem(seed: int, n_max: int = 8, budget: bool = False, infinite: bool = True, held: bool = False) -> Problem:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, n_max + 1))
    names = [f"v{i}" for i in range(n)]
    k = {v: int(rng.integers(1, 4)) for v in names}
    costs = {v: rng.random(k[v]) for v in names}
    memory = {v: rng.integers(0, 10, k[v]).astype(float) for v in names}
    edges = {}
    for i in range(1, n):
        for _ in range(int(rng.integers(1, 3))):
            u, v = names[int(rng.integers(0, i))], names[i]
            m = rng.random((k[u], k[v]))
            if infinite and rng.random() < 0.2:
                m[0, -1] = np.inf
            edges[(u, v)] = edges.get((u, v), 0) + m
    # bytes a pair keeps (a reshard saved for backward): on some edges, some pairs
    edge_memory = {e: rng.integers(0, 8, m.shape).astype(float) * (rng.random(m.shape) < 0.5)
                   for e, m in edges.items() if held and rng.random() < 0.6}
    return Problem(costs, memory, edges, budget=float(rng.integers(n, 6 * n)) if budget else None, edge_memory=edge_memory)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("budget", [False, True])
def test_ilp_equals_brute_force(seed, budget):
    p = random_problem(seed, budget=budget)
    sol, _ = _solved_as_brute_force(p)
    if sol is not None and p.budget is not None:
        assert sol.memory <= p.budget


def _solved_as_brute_force(p: Problem):
    """(the ILP's solution, brute force's optimum) after checking they agree; (None, None) where
    brute force finds nothing and the ILP refuses too."""
    try:
        _, best = brute_force(p)
    except PlanError:
        with pytest.raises(PlanError):
            solve(p)
        return None, None
    sol = solve(p)
    assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    return sol, best


@pytest.mark.parametrize("seed", range(60))
def test_memory_held_on_edges_is_in_the_budget(seed):
    """Edge memory (a reshard's copy kept for backward) counts against the budget in the ILP, in
    the simplifier's folding and in evaluate, as brute force counts it."""
    p = random_problem(seed, budget=True, held=True, infinite=seed % 2 == 0)
    sol, best = _solved_as_brute_force(p)
    if sol is None:
        return
    assert evaluate(p, sol.choice)[1] == pytest.approx(sol.memory) and sol.memory <= p.budget
    small, records = eliminate(p)
    folded = recover(solve(small).choice, records)
    assert evaluate(p, folded)[0] == pytest.approx(best, rel=1e-9, abs=1e-12) and evaluate(p, folded)[1] <= p.budget


def test_edge_memory_adds_the_pairs_bytes():
    p = Problem({"a": np.zeros(2), "b": np.zeros(2)}, {"a": np.zeros(2), "b": np.zeros(2)},
                {("a", "b"): np.zeros((2, 2))}, edge_memory={("a", "b"): np.array([[0.0, 5.0], [7.0, 0.0]])})
    assert [evaluate(p, {"a": i, "b": j})[1] for i in (0, 1) for j in (0, 1)] == [0.0, 5.0, 7.0, 0.0]
    assert min_memory(p) == 0.0
    p.budget = 4.0
    p.costs = {"a": np.array([0.0, 1.0]), "b": np.array([1.0, 0.0])}  # cheapest pair (0, 1) holds 5 bytes
    assert solve(p).choice in ({"a": 0, "b": 0}, {"a": 1, "b": 1})


@pytest.mark.parametrize("seed", range(40))
def test_elimination_keeps_the_optimum(seed):
    p = random_problem(seed, infinite=False)
    _, best = brute_force(p)
    small, records = eliminate(p)
    assert len(small.costs) <= len(p.costs)
    choice = recover(solve(small).choice, records)
    assert evaluate(p, choice)[0] == pytest.approx(best, rel=1e-9)


def test_elimination_under_budget_keeps_memory_varying_nodes():
    p = random_problem(3, budget=True, infinite=False)
    small, _ = eliminate(p)
    for v in p.costs:
        if np.ptp(p.memory[v]) > 0:
            assert v in small.costs


def test_ties_share_one_choice():
    costs = {"a": np.array([1.0, 0.0]), "b": np.array([0.0, 5.0]), "c": np.array([0.0, 0.0])}
    memory = {v: np.zeros(2) for v in costs}
    edges = {("a", "c"): np.zeros((2, 2)), ("b", "c"): np.zeros((2, 2))}
    free = solve(Problem(costs, memory, edges))
    assert free.choice["a"] == 1 and free.choice["b"] == 0
    tied = solve(Problem(costs, memory, edges, tie={"b": "a"}))
    assert tied.choice["a"] == tied.choice["b"] == 0  # 1 + 0 beats 0 + 5
    assert tied.objective == pytest.approx(1.0)


def test_infeasible_budget_names_the_smallest_memory():
    costs = {"a": np.array([0.0, 1.0]), "b": np.array([0.0, 1.0])}
    memory = {"a": np.array([8.0, 3.0]), "b": np.array([8.0, 2.0])}
    p = Problem(costs, memory, {("a", "b"): np.zeros((2, 2))}, budget=4.0)
    assert min_memory(p) == 5.0
    with pytest.raises(PlanError, match=r"smallest plan needs 5 B per device"):
        solve(p)
    # each node's least memory adds up under the budget, but those choices cannot go together:
    # the message says so instead of naming an unreachable "smallest plan"
    apart = Problem(costs, memory, {("a", "b"): np.array([[0.0, 0.0], [0.0, np.inf]])}, budget=6.0)
    assert min_memory(apart) == 5.0
    for solver in ("highs", "cbc") if _highs() else ("cbc",):
        with pytest.raises(PlanError, match=r"no plan needs less than 5 B per device, but those that come near it do not go together"):
            solve(apart, solver=solver)


def test_budget_forces_the_small_choice():
    costs = {"a": np.array([0.0, 1.0])}
    memory = {"a": np.array([10.0, 1.0])}
    assert solve(Problem(costs, memory, {})).choice["a"] == 0
    assert solve(Problem(costs, memory, {}, budget=5.0)).choice["a"] == 1


def test_cbc_and_highs_agree():
    p = random_problem(7, infinite=False)
    assert solve(p, solver="cbc").objective == pytest.approx(solve(p, solver="highs").objective, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_a_cutoff_keeps_the_optimum_above_it_and_refuses_below_it(seed, solver):
    """A cutoff just above the optimum changes nothing; just below it, no assignment is cheaper:
    NoCheaperPlan (a PlanError), whatever HiGHS's bound-cut search returned."""
    p = random_problem(seed, budget=seed % 2 == 1)
    try:
        _, best = brute_force(p)
    except PlanError:  # nothing is feasible: a cutoff does not hide that
        with pytest.raises(PlanError):
            solve(p, solver=solver, cutoff_s=1e9)
        return
    sol = solve(p, solver=solver, cutoff_s=best * (1 + 1e-6) + 1e-9)
    assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    with pytest.raises(NoCheaperPlan, match="no assignment costs under the cutoff") as err:
        solve(p, solver=solver, cutoff_s=best * (1 - 1e-3) - 1e-9)
    assert isinstance(err.value, PlanError)
    assert err.value.proven  # (solved to the end: not a time limit)


@pytest.mark.parametrize("seed", range(12))
def test_a_budgeted_solve_below_what_the_unbudgeted_one_proved_is_not_run(seed, monkeypatch):
    """The pipeline search's leaner plans: the unbudgeted solve records its optimum as a lower
    bound (``Built.lower_bounds``); a budgeted solve of the same costs whose cutoff lies below it
    raises a proven NoCheaperPlan without a solver run, and one above it solves as brute force
    does under the budget."""
    import dataclasses

    from autopar.solver import ilp as ilp_module
    from autopar.solver.intra_op import _solve_tied

    free = random_problem(seed, infinite=False)
    _, unbudgeted = brute_force(free)
    bounds: dict = {}
    best = _solve_tied(None, free, (0,), None, True, 60.0, None, None, bounds, "paid")
    assert best[4] == pytest.approx(unbudgeted, rel=1e-9, abs=1e-12)
    assert bounds[("paid", 0)] == pytest.approx(unbudgeted, rel=1e-5)
    rng = np.random.default_rng(seed)
    budgeted = dataclasses.replace(free, budget=min_memory(free) + float(rng.integers(0, 10)), tie={})
    runs = []
    real = ilp_module.solve
    monkeypatch.setattr(ilp_module, "solve", lambda *a, **k: runs.append(1) or real(*a, **k))
    with pytest.raises(NoCheaperPlan) as err:
        _solve_tied(None, budgeted, (0,), None, True, 60.0, None, unbudgeted * (1 - 1e-3), bounds, "paid")
    assert err.value.proven and not runs
    try:
        _, least = brute_force(budgeted)
    except PlanError:
        return  # (nothing fits this budget: the solve says so, as without the bound)
    found = _solve_tied(None, budgeted, (0,), None, True, 60.0, None, least * (1 + 1e-6) + 1e-9, bounds, "paid")
    assert runs and found[4] == pytest.approx(least, rel=1e-9, abs=1e-12)
    # another costs variant has no bound yet: its solve runs
    with pytest.raises(NoCheaperPlan):
        _solve_tied(None, budgeted, (0,), None, True, 60.0, None, unbudgeted * (1 - 1e-3), bounds, "hidden")
    assert len(runs) == 2


def test_prune_only_when_too_big_and_keeps_valid_indices():
    from autopar.solver.simplify import prune

    p = random_problem(11, infinite=False)
    same, keep = prune(p, max_edge_pairs=10**9)
    assert all((k == np.arange(len(p.costs[v]))).all() for v, k in keep.items())
    rng = np.random.default_rng(0)
    names = [f"v{i}" for i in range(4)]
    big = Problem({v: rng.random(40) for v in names}, {v: rng.random(40) for v in names},
                  {(names[i], names[i + 1]): rng.random((40, 40)) for i in range(3)}, budget=100.0)
    small, keep = prune(big, max_edge_pairs=1000)
    assert sum(m.size for m in small.edges.values()) <= 1000
    for v, k in keep.items():
        assert len(k) == len(small.costs[v]) and (np.diff(k) > 0).all()
        assert int(np.argmin(big.memory[v])) in k  # the smallest-memory candidate survives a budget
    choice = {v: int(keep[v][i]) for v, i in solve(small).choice.items()}
    assert evaluate(big, choice)[0] == pytest.approx(evaluate(small, solve(small).choice)[0])


# ---- costs paid once for a group of pairs (a layer's gather call) ---------------------------------
def _with_once(p: Problem, seed: int) -> Problem:
    """``p`` with a few once-paid costs over random pairs of its edges (and, sometimes, a node's own
    choices), as a layer's all-gather call is paid once whichever of its parameters are gathered."""
    from autopar.solver.ilp import OnceCost

    rng = np.random.default_rng(seed + 1000)
    once = []
    edges = list(p.edges)
    for _ in range(int(rng.integers(1, 4))):
        members = []
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < 0.2:
                v = list(p.costs)[int(rng.integers(0, len(p.costs)))]
                members.append((v, v, rng.random(len(p.costs[v])) < 0.5))
            else:
                u, v = edges[int(rng.integers(0, len(edges)))]
                members.append((u, v, rng.random(p.edges[(u, v)].shape) < 0.4))
        once.append(OnceCost(float(rng.random()) * 2, members))
    p.once = once
    return p


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("budget", [False, True])
def test_once_paid_costs_equal_brute_force(seed, budget):
    """A cost paid once when any member takes a pair of its set: the ILP (its y >= e rows), the
    simplifier (which keeps the nodes such a cost reads, or folds a leaf into labels of its
    choices) and evaluate agree with brute force."""
    p = _with_once(random_problem(seed, budget=budget), seed)
    sol, best = _solved_as_brute_force(p)
    if sol is None:
        return
    assert evaluate(p, sol.choice)[0] == pytest.approx(best, rel=1e-9, abs=1e-12)
    small, records = eliminate(p)
    # what the costs read survives (a leaf they read as labels of its choices)
    assert {x for oc in small.once for x in oc.nodes()} <= set(small.costs)
    assert len(small.once) == len(p.once)
    folded = recover(solve(small).choice, records)
    assert evaluate(p, folded)[0] == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_a_once_paid_cost_is_paid_once_and_only_when_a_member_takes_its_pairs():
    from autopar.solver.ilp import OnceCost

    # two parameters (p, q) read by two ops (a, b): choice 1 of a parameter is "stored split",
    # gathered for its reader; the call's latency (3) is paid once if either is gathered
    gathered = np.array([[False, False], [True, True]])
    costs = {"p": np.array([2.0, 0.0]), "q": np.array([2.0, 0.0]), "a": np.zeros(2), "b": np.zeros(2)}
    memory = {v: np.zeros(2) for v in costs}
    edges = {("p", "a"): np.zeros((2, 2)), ("q", "b"): np.zeros((2, 2))}
    call = OnceCost(3.0, [("p", "a", gathered), ("q", "b", gathered)])
    p = Problem(costs, memory, edges, once=[call])
    assert [evaluate(p, {"p": i, "q": j, "a": 0, "b": 0})[0] for i in (0, 1) for j in (0, 1)] == [4.0, 5.0, 5.0, 3.0]
    sol = solve(p)
    assert sol.choice["p"] == sol.choice["q"] == 1 and sol.objective == pytest.approx(3.0)
    # gathering one alone pays the whole call: with one parameter cheaper kept whole, keep both
    p.costs["q"] = np.array([0.5, 0.0])
    sol = solve(p)
    assert (sol.choice["p"], sol.choice["q"]) == (0, 0) and sol.objective == pytest.approx(2.5)


def test_tied_copies_pay_their_calls_as_often_as_there_are_copies():
    from autopar.solver.ilp import OnceCost

    gathered = np.array([[False, False], [True, True]])
    costs = {f"{x}{k}": np.array([1.0, 0.0]) if x == "p" else np.zeros(2) for k in range(3) for x in "pa"}
    memory = {v: np.zeros(2) for v in costs}
    edges = {(f"p{k}", f"a{k}"): np.zeros((2, 2)) for k in range(3)}
    once = [OnceCost(0.9, [(f"p{k}", f"a{k}", gathered)]) for k in range(3)]
    tie = {"p1": "p0", "p2": "p0", "a1": "a0", "a2": "a0"}
    p = Problem(costs, memory, edges, tie=tie, once=once)
    red = p.reduced()
    assert len(red.once) == 1 and red.once[0].cost == pytest.approx(2.7)
    sol = solve(p)
    assert all(sol.choice[f"p{k}"] == 1 for k in range(3)) and sol.objective == pytest.approx(2.7)


@pytest.mark.parametrize("seed", range(30))
def test_a_leaf_read_by_once_paid_costs_folds_into_labels_exactly(seed):
    """A parameter (a leaf: one reader) whose gathers a layer's call pays for: the simplifier
    folds its choices into one label per pattern of the masks, exactly, and its reader may fold."""
    from autopar.solver.ilp import OnceCost

    rng = np.random.default_rng(seed)
    p = random_problem(seed, infinite=False)
    names = list(p.costs)
    once = []
    for g in range(int(rng.integers(1, 3))):
        members = []
        for r in range(int(rng.integers(1, 4))):  # parameters: leaves with several choices
            leaf, reader = f"p{g}_{r}", names[int(rng.integers(0, len(names)))]
            k = int(rng.integers(2, 7))
            p.costs[leaf], p.memory[leaf] = rng.random(k), np.zeros(k)
            p.edges[(leaf, reader)] = rng.random((k, len(p.costs[reader])))
            members.append((leaf, reader, rng.random((k, len(p.costs[reader]))) < 0.4))
        once.append(OnceCost(float(rng.random()) * 2, members))
    p.once = once
    _, best = brute_force(p)
    small, records = eliminate(p)
    assert sum(map(len, small.costs.values())) < sum(map(len, p.costs.values()))
    choice = recover(solve(small).choice, records)
    assert evaluate(p, choice)[0] == pytest.approx(best, rel=1e-9, abs=1e-12)


def _highs() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_pruned_solve_records_no_lower_bound(monkeypatch):
    """Pruning keeps some candidates of the widest nodes (and, under a budget, the leanest too): an
    unbudgeted pruned optimum bounds only what it kept, so it is not recorded, and a cutoff it
    misses is not proven."""
    from autopar.solver import intra_op, simplify

    rng = np.random.default_rng(3)
    names = ["a", "b", "c"]
    p = Problem({v: rng.random(8) for v in names}, {v: rng.random(8) for v in names},
                {("a", "b"): rng.random((8, 8)), ("b", "c"): rng.random((8, 8))})
    monkeypatch.setattr(intra_op, "prune", lambda q: simplify.prune(q, max_edge_pairs=1))
    bounds: dict = {}
    best = intra_op._solve_tied(None, p, (0,), None, True, 60.0, None, None, bounds, "paid")
    assert best[3].pruned and not bounds
    with pytest.raises(NoCheaperPlan) as err:
        intra_op._solve_tied(None, p, (0,), None, True, 60.0, None, 1e-9, bounds, "paid")
    assert not err.value.proven and not bounds
