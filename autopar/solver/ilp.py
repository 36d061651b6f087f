"""The intra-op ILP: one strategy per node, resharding costs on edges, a per-device memory budget.

Notation. Node v has k_v strategies; s_v in {0,1}^{k_v} picks one. Edge (u, v) carries a cost
matrix R_uv[i, j]: seconds to turn u's output under strategy i into the input v reads under j
(forward and backward). The ILP, after linearising the products s_u[i] * s_v[j] with e_uv:

    minimise    sum_v  c_v . s_v  +  sum_(u,v) sum_ij R_uv[i,j] e_uv[i,j]
    subject to  sum_i s_v[i] = 1                                  (one strategy per node)
                sum_j e_uv[i,j] = s_u[i]     for every i          (edge agrees with its source)
                sum_i e_uv[i,j] = s_v[j]     for every j          (edge agrees with its target)
                sum_v m_v . s_v + sum_(u,v) sum_ij H_uv[i,j] e_uv[i,j] <= M      (memory, given a budget M)
                y_g >= sum_(ij in P_g,uv) e_uv[i,j]   for every member edge (once-paid costs)
                s, e in {0, 1}

plus ``sum_g C_g y_g`` in the objective: a cost paid once however many of its members take a pair
in their sets P_g (``OnceCost``: one all-gather call for a layer's split-stored parameters, the
call's latency ``C_g``, each member edge priced at its bytes alone).

c_v: compute and the op's own communication (s); m_v: bytes the choice keeps on a device at the
peak; H_uv: bytes a pair's reshard keeps alive until backward (``edge_memory``: a gathered weight
or activation that the consumer saves). Nodes tied to a representative (repeated blocks, nodes that must follow their producer)
share its variables, so the ILP has one copy of each repeated block.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import sys
import time
import warnings

import numpy as np
import pulp

from autopar.errors import ConfigError, PlanError
from autopar.solver.units import fmt_bytes

# Costs below this are noise; rounding them keeps CBC's numerics clean.
COST_EPS = 1e-12
# Solvers stop at a relative optimality gap (HiGHS' default is 1e-4); plans must be optimal.
MIP_GAP = 1e-9
# The ILP's objective is in microseconds: in seconds, real differences of 1e-9 s fall inside the
# solvers' absolute tolerances and the "optimum" comes back slightly off.
OBJECTIVE_SCALE = 1e6


@dataclasses.dataclass
class OnceCost:
    """``cost`` seconds paid once when any member takes a pair of its set: members are (u, v, mask)
    with a bool mask of shape (k_u, k_v) over the edge's pairs, or (v, v, mask) with a mask of
    shape (k_v,) over a node's own choices (an edge inside one tied representative)."""

    cost: float
    members: list[tuple[str, str, np.ndarray]]

    def paid(self, pick: dict[str, int]) -> bool:
        return any(bool(m[pick[u]]) if u == v else bool(m[pick[u], pick[v]]) for u, v, m in self.members)

    def nodes(self) -> set[str]:
        return {x for u, v, _ in self.members for x in (u, v)}


@dataclasses.dataclass
class Problem:
    """costs[v]: shape (k_v,) seconds; memory[v]: shape (k_v,) bytes; edges[(u, v)]: (k_u, k_v)
    seconds; tie[v] = u means v uses u's variables (same k); budget: bytes or None;
    edge_memory[(u, v)]: (k_u, k_v) bytes held, for the edges that hold any; once: costs paid
    once for a set of pairs (``OnceCost``)."""

    costs: dict[str, np.ndarray]
    memory: dict[str, np.ndarray]
    edges: dict[tuple[str, str], np.ndarray]
    tie: dict[str, str] = dataclasses.field(default_factory=dict)
    budget: float | None = None
    base_memory: float = 0.0  # bytes that do not depend on any choice
    edge_memory: dict[tuple[str, str], np.ndarray] = dataclasses.field(default_factory=dict)
    once: list[OnceCost] = dataclasses.field(default_factory=list)

    def rep(self, v: str) -> str:
        while v in self.tie:
            v = self.tie[v]
        return v

    def reduced(self) -> "Problem":
        """The same problem over representatives only: tied nodes' costs are added to their
        representative, their edges mapped onto the representatives' edges."""
        costs: dict[str, np.ndarray] = {}
        memory: dict[str, np.ndarray] = {}
        for v in self.costs:
            r = self.rep(v)
            if r not in costs:
                costs[r] = np.zeros_like(self.costs[r], dtype=float)
                memory[r] = np.zeros_like(self.memory[r], dtype=float)
            if len(self.costs[v]) != len(costs[r]):
                raise ValueError(f"node {v} is tied to {r} but has {len(self.costs[v])} strategies, not {len(costs[r])}")
            costs[r] = costs[r] + self.costs[v]
            memory[r] = memory[r] + self.memory[v]
        edges = self._mapped(self.edges, costs)
        edge_memory = self._mapped(self.edge_memory, memory)
        return Problem(costs, memory, edges, {}, self.budget, self.base_memory, edge_memory, self._mapped_once(edges))

    def _mapped_once(self, edges: dict) -> list[OnceCost]:
        """Once-paid costs on the representatives: tied copies choose alike, so the copies of one
        cost (the same layer's call in every repeated block) become one, paid as often."""
        merged: dict = {}
        for oc in self.once:
            members = []
            for u, v, m in oc.members:
                ru, rv = self.rep(u), self.rep(v)
                if u == v or ru == rv:
                    members.append((ru, ru, m if u == v else np.diag(m).copy()))
                elif (ru, rv) in edges or (rv, ru) not in edges:  # keyed as the mapped edge is
                    members.append((ru, rv, m))
                else:
                    members.append((rv, ru, m.T))
            members = _distinct_members(members)
            key = tuple(sorted((u, v, m.tobytes()) for u, v, m in members))
            if key in merged:
                merged[key].cost += oc.cost
            else:
                merged[key] = OnceCost(oc.cost, members)
        return list(merged.values())

    def _mapped(self, matrices: dict, own: dict) -> dict:
        """Edge matrices onto the representatives' edges (an edge inside one representative adds
        its diagonal to ``own``: both ends always pick the same index)."""
        out: dict[tuple[str, str], np.ndarray] = {}
        for (u, v), mat in matrices.items():
            ru, rv = self.rep(u), self.rep(v)
            if ru == rv:
                own[ru] = own[ru] + np.diag(mat)
                continue
            if (rv, ru) in out:
                out[(rv, ru)] = out[(rv, ru)] + mat.T
            else:
                out[(ru, rv)] = out.get((ru, rv), 0) + mat
        return out


@dataclasses.dataclass
class Solution:
    choice: dict[str, int]
    objective: float
    memory: float
    status: str
    solve_seconds: float
    n_variables: int
    n_constraints: int
    pruned: bool = False  # whether simplify.prune cut candidates before solving


def evaluate(problem: Problem, choice: dict[str, int]) -> tuple[float, float]:
    """(objective, memory) of a full assignment (tied nodes read their representative's choice)."""
    pick = {v: choice[problem.rep(v)] for v in problem.costs}
    obj = sum(float(problem.costs[v][pick[v]]) for v in problem.costs)
    obj += sum(float(m[pick[u], pick[v]]) for (u, v), m in problem.edges.items())
    obj += sum(oc.cost for oc in problem.once if oc.paid(pick))
    mem = problem.base_memory + sum(float(problem.memory[v][pick[v]]) for v in problem.memory)
    mem += sum(float(m[pick[u], pick[v]]) for (u, v), m in problem.edge_memory.items())
    return obj, mem


def _oriented(matrices: dict, u: str, v: str):
    """The (u, v) matrix of ``matrices`` whichever way it is keyed, or None."""
    if (u, v) in matrices:
        return matrices[(u, v)]
    return matrices[(v, u)].T if (v, u) in matrices else None


def _prune_infinite(problem: Problem) -> dict[str, list[int]]:
    """Strategies worth a variable: finite own cost."""
    return {v: [i for i, c in enumerate(cs) if math.isfinite(c)] for v, cs in problem.costs.items()}


def solve(problem: Problem, *, time_limit_s: float = 60.0, solver: str | None = None, msg: bool = False,
          cutoff_s: float | None = None) -> Solution:
    """Solve with HiGHS when highspy is installed (or ``solver="highs"``), else CBC (through pulp).
    ``cutoff_s``: the caller needs no assignment costing more (it has a better option elsewhere):
    HiGHS stops as soon as its bound proves none costs less, and a result above it raises
    ``NoCheaperPlan`` (a PlanError)."""
    t0 = time.perf_counter()
    if solver not in SOLVERS:
        raise ConfigError(f"unknown ILP solver {solver!r}; use 'highs' (needs highspy), 'cbc', or None for the best available")
    red = problem.reduced()
    alive = _prune_infinite(red)
    for v, idx in alive.items():
        if not idx:
            raise PlanError(f"node {v} has no strategy with a finite cost")
    if problem.budget is not None and min_memory(problem) > problem.budget:
        raise _budget_error(problem)
    program, s = _formulate(red, alive, problem.budget)
    run = _run_highs if solver in (None, "highs") and _highspy() is not None else _run_cbc
    if solver == "highs" and _highspy() is None:
        raise PlanError("solver 'highs' needs the highspy package: pip install 'autopar[highs]'")
    with _quiet(not msg):
        status_name, x = run(program, time_limit_s, msg, cutoff_s)
    # (CBC hands back its last point even where it proved the program infeasible)
    found = x is not None and status_name != "Infeasible" and _has_solution(s, x)
    if cutoff_s is not None and (not found or evaluate(problem, _picked(problem, s, x))[0] > cutoff_s):
        # (proven where HiGHS' bound dropped every branch, or its optimum lies above: not where it stopped on time)
        raise NoCheaperPlan(f"no assignment costs under the cutoff of {cutoff_s:.3g} s",
                            proven=status_name in ("Infeasible", "Optimal"))
    if not found:
        if status_name == "Infeasible" and problem.budget is not None:
            raise _budget_error(problem)
        raise PlanError(
            f"the ILP solver stopped with status {status_name!r} before it found a plan (time limit "
            f"{time_limit_s:g} s); raise time_limit_s, or plan on a smaller mesh or model"
        )
    full = _picked(problem, s, x)
    obj, mem = evaluate(problem, full)
    if problem.budget is not None and mem > problem.budget * (1 + 1e-9):
        raise _budget_error(problem)
    return Solution(full, obj, mem, status_name, time.perf_counter() - t0, len(program.cost), len(program.rows))


@dataclasses.dataclass
class _Program:
    """The ILP as plain arrays (min cost . x over the rows' bounds), which HiGHS takes whole: a
    modelling layer's objects cost more than the solve itself at GPT-3 scale."""

    cost: list = dataclasses.field(default_factory=list)
    upper: list = dataclasses.field(default_factory=list)
    integer: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)  # (columns, coefficients, lower, upper)

    def column(self, cost: float = 0.0, integer: bool = False) -> int:
        self.cost.append(cost)
        self.upper.append(1.0)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, columns, coefficients, lower: float, upper: float) -> None:
        self.rows.append((list(columns), list(coefficients), lower, upper))


def _formulate(red: Problem, alive: dict, budget) -> tuple[_Program, dict]:
    """The program of ``red`` (see the module docstring) and, per node, strategy -> its column."""
    prog = _Program()
    s = {v: {i: prog.column(_round(red.costs[v][i]), integer=True) for i in idx} for v, idx in alive.items()}
    for vars_ in s.values():
        prog.row(vars_.values(), [1.0] * len(vars_), 1.0, 1.0)  # one strategy
    memory = {x: float(red.memory[v][i]) for v, vars_ in s.items() for i, x in vars_.items()} if budget is not None else {}
    pairs = {}  # (u, v) -> the pair columns e[i, j], or None where one side is fixed (no e)
    for (u, v), mat in red.edges.items():
        su, sv = s[u], s[v]
        hmat = _oriented(red.edge_memory, u, v) if budget is not None else None
        pairs[(u, v)] = None
        if len(su) == 1 or len(sv) == 1:
            # One side is fixed: the edge cost is linear in the other side's choice.
            for i, xi in su.items():
                for j, xj in sv.items():
                    c = _round(mat[i, j])
                    free = xj if len(su) == 1 else xi
                    if math.isinf(c):
                        prog.row((xi, xj), (1.0, 1.0), -math.inf, 1.0)  # the pair is forbidden
                        continue
                    prog.cost[free] += c
                    if hmat is not None and hmat[i, j]:
                        memory[free] = memory.get(free, 0.0) + float(hmat[i, j])
            continue
        e = {}
        for i in su:
            for j in sv:
                c = _round(mat[i, j])
                if math.isinf(c):
                    continue  # no column: the pair cannot be chosen together
                e[i, j] = prog.column(c)
                if hmat is not None and hmat[i, j]:
                    memory[e[i, j]] = float(hmat[i, j])
        for i, xi in su.items():
            cols = [e[i, j] for j in sv if (i, j) in e]
            prog.row(cols + [xi], [1.0] * len(cols) + [-1.0], 0.0, 0.0)  # the edge agrees with its source
        for j, xj in sv.items():
            cols = [e[i, j] for i in su if (i, j) in e]
            prog.row(cols + [xj], [1.0] * len(cols) + [-1.0], 0.0, 0.0)  # and with its target
        pairs[(u, v)] = e
    for oc in red.once:
        y = prog.column(_round(oc.cost))  # 0/1 at the optimum: the s are
        for u, v, m in oc.members:
            cols, always = _member_terms(s, pairs, u, v, m)
            prog.row([y] + cols, [1.0] + [-1.0] * len(cols), 1.0 if always else 0.0, math.inf)
    if budget is not None:
        prog.row(list(memory), list(memory.values()), -math.inf, budget - red.base_memory)
    return prog, s


def _highspy():
    try:
        import highspy

        return highspy
    except ImportError:
        return None


def _run_highs(prog: _Program, time_limit_s: float, msg: bool, cutoff_s: float | None):
    """(status, column values or None) from HiGHS, the program passed whole."""
    highspy = _highspy()
    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", MIP_GAP)
    # Presolve finds almost nothing to remove in these programs (46 of 16,725 columns on GPT-3's
    # stage ILPs) and took 0.5 of their 0.65 s; their root LPs are mostly integral already.
    h.setOptionValue("presolve", "off")
    if cutoff_s is not None:  # HiGHS drops every branch whose bound is above it
        h.setOptionValue("objective_bound", cutoff_s * OBJECTIVE_SCALE)
    lp = highspy.HighsLp()
    n = len(prog.cost)
    lp.num_col_, lp.num_row_ = n, len(prog.rows)
    lp.col_cost_ = np.asarray(prog.cost, dtype=float)
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.asarray(prog.upper, dtype=float)
    lp.row_lower_ = np.array([r[2] for r in prog.rows], dtype=float)
    lp.row_upper_ = np.array([r[3] for r in prog.rows], dtype=float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.cumsum([0] + [len(r[0]) for r in prog.rows]).astype(np.int32)
    lp.a_matrix_.index_ = np.array([c for r in prog.rows for c in r[0]], dtype=np.int32)
    lp.a_matrix_.value_ = np.array([a for r in prog.rows for a in r[1]], dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in prog.integer]
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    name = {highspy.HighsModelStatus.kOptimal: "Optimal", highspy.HighsModelStatus.kInfeasible: "Infeasible"}.get(
        status, h.modelStatusToString(status))
    has = h.getInfo().primal_solution_status == 2  # a feasible point (kSolutionStatusFeasible)
    return name, np.asarray(h.getSolution().col_value) if has else None


def _run_cbc(prog: _Program, time_limit_s: float, msg: bool, cutoff_s: float | None):
    """(status, column values or None) from CBC, through pulp (CBC takes no objective bound)."""
    lp = pulp.LpProblem("autopar_intra_op", pulp.LpMinimize)
    var = _variable_factory(lp)
    x = [var(f"x_{k}", lowBound=0, upBound=up, cat="Binary" if integer else "Continuous")
         for k, (up, integer) in enumerate(zip(prog.upper, prog.integer))]
    for n, (cols, coefs, lo, hi) in enumerate(prog.rows):
        expr = pulp.lpSum(a * x[c] for c, a in zip(cols, coefs))
        if lo == hi:
            lp += expr == lo, f"r{n}"
        elif math.isinf(hi):
            lp += expr >= lo, f"r{n}"
        else:
            lp += expr <= hi, f"r{n}"
    lp += pulp.lpSum(c * x[k] for k, c in enumerate(prog.cost) if c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # pulp 3.3 nudges towards pulp[cbc]
        status = lp.solve(pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit_s, gapRel=MIP_GAP))
    values = [v.value() for v in x]
    return pulp.LpStatus[status], None if any(v is None for v in values) else np.asarray(values, dtype=float)


def _distinct_members(members: list) -> list:
    """``members`` of one once-paid cost without repeats: a node's own masks joined into one (the
    cost is paid when its choice is in any), an edge's identical masks kept once (tied copies of a
    repeated block map onto one representative, a parameter's sync group onto its copies)."""
    own: dict = {}
    pairs: dict = {}
    for u, v, m in members:
        if u == v:
            own[u] = own[u] | m if u in own else m.copy()
        else:
            pairs.setdefault((u, v, m.tobytes()), (u, v, m))
    return [(u, u, m) for u, m in own.items()] + list(pairs.values())


def _member_terms(s, pairs, u, v, mask) -> tuple[list[int], bool]:
    """(the columns that are 1 when a once-paid cost's member takes a pair of ``mask``, whether
    it always does): a node's own choices, an edge's pair columns, or the free side's choices
    of an edge whose other side is fixed."""
    if u == v:
        return [x for i, x in s[u].items() if mask[i]], False
    if (u, v) not in pairs:
        u, v, mask = v, u, mask.T
    e = pairs[(u, v)]
    if e is not None:
        return [x for (i, j), x in e.items() if mask[i, j]], False
    su, sv = s[u], s[v]
    if len(su) == 1 and len(sv) == 1:
        (i,), (j,) = su, sv
        return [], bool(mask[i, j])
    if len(su) == 1:
        (i,) = su
        return [x for j, x in sv.items() if mask[i, j]], False
    (j,) = sv
    return [x for i, x in su.items() if mask[i, j]], False


def _picked(problem: Problem, s, x) -> dict[str, int]:
    """The strategy each node's columns chose (tied nodes: their representative's)."""
    choice = {v: max(cols, key=lambda i: x[cols[i]]) for v, cols in s.items()}
    return {v: choice[problem.rep(v)] for v in problem.costs}


@contextlib.contextmanager
def _quiet(enabled: bool):
    """Silence what native solvers print straight to file descriptor 1 (HiGHS' banner)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _variable_factory(lp):
    """pulp >= 3.3 attaches variables to the problem; older releases construct them directly."""
    if hasattr(lp, "add_variable"):
        return lambda name, **kw: lp.add_variable(name, **kw)
    return lambda name, **kw: pulp.LpVariable(name, **kw)


class NoCheaperPlan(PlanError):
    """Every assignment costs more than the caller's cutoff: ``proven`` where the solver showed it,
    not only ran out of time before it found one under it."""

    def __init__(self, message: str, proven: bool = False):
        super().__init__(message)
        self.proven = proven


class OverBudget(PlanError):
    """No assignment fits the memory budget; ``least``: a lower bound of what one needs."""

    def __init__(self, message: str, least: float):
        super().__init__(message)
        self.least = least


def _budget_error(problem: Problem) -> PlanError:
    least = min_memory(problem)
    # the per-node least is a bound: the choices that reach it may not go together
    needs = (f"the smallest plan needs {fmt_bytes(least)} per device" if least > problem.budget else
             f"no plan needs less than {fmt_bytes(least)} per device, but those that come near it do not go together")
    return OverBudget(f"no plan fits the memory budget of {fmt_bytes(problem.budget)} per device; {needs}. "
                      "Raise the budget, use more devices, or a smaller model/batch.", least)


def min_memory(problem: Problem) -> float:
    """A lower bound of the memory any assignment needs (memory is a sum of per-node terms, and
    infinite cost pairs do not forbid memory), used in the infeasibility message: an edge's
    terms are taken with its producer's choice (the least of its row), which bounds a term that
    depends on the producer's spec more tightly than the least of the whole matrix."""
    red = problem.reduced()
    mem = {v: np.asarray(m, dtype=float).copy() for v, m in red.memory.items()}
    loose = 0.0
    for (u, v), h in red.edge_memory.items():
        if u in mem and h.shape[0] == len(mem[u]):
            mem[u] += np.min(h, axis=1)
        else:
            loose += float(np.min(h))
    return problem.base_memory + sum(float(np.min(m)) for m in mem.values()) + loose


def _has_solution(s, x) -> bool:
    return all(any(x[c] > 0.5 for c in cols.values()) for cols in s.values())


def _round(c: float) -> float:
    """Seconds -> the ILP's unit (microseconds, so MIP tolerances sit far below any real cost
    difference), with noise below COST_EPS seconds dropped."""
    c = float(c)
    return 0.0 if abs(c) < COST_EPS else c * OBJECTIVE_SCALE


SOLVERS = (None, "highs", "cbc")


def brute_force(problem: Problem) -> tuple[dict[str, int], float]:
    """Exhaustive search over representatives (for tests on tiny problems)."""
    red = problem.reduced()
    names = list(red.costs)
    best, best_choice = math.inf, None
    for combo in itertools.product(*(range(len(red.costs[v])) for v in names)):
        choice = dict(zip(names, combo))
        obj, mem = evaluate(red, choice)
        if problem.budget is not None and mem > problem.budget:
            continue
        if obj < best:
            best, best_choice = obj, choice
    if best_choice is None:
        raise PlanError("no assignment has a finite cost within the memory budget")
    return {v: best_choice[problem.rep(v)] for v in problem.costs}, best
