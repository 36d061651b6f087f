"""Graph simplification so the ILP scales.

1. Repeated-block reuse: layers the tracer found structurally identical are tied position by
   position to the first layer (period 1) or the first two layers (period 2) of their group, so the
   ILP holds one or two copies of each block (a restriction: tied copies pick the same strategies;
   boundary edges between copies are kept).
2. Exact elimination of chain nodes (variable elimination, min-sum): a node with one neighbour is
   folded into it, c_w[k] += min_j (c_v[j] + R_vw[j, k]); a node between two neighbours becomes an
   edge, R_uw[i, k] = min_j (R_uv[i, j] + c_v[j] + R_vw[j, k]). The optimum is unchanged. Under a
   memory budget only nodes whose memory (their own and their edges') does not depend on their
   choice are eliminated. A node a once-paid cost reads (``ilp.OnceCost``) is kept, but a leaf
   among them folds its choices into one label per pattern of the cost's masks (exact, see
   ``fold_into_labels``), after which the neighbour it read through may fold away.
Eliminated choices are recovered after solving from the stored argmin tables.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.solver.ilp import OnceCost, Problem


def block_ties(graph, choices, period: int = 1) -> dict[str, str]:
    """tie[v] = u for every node of a repeated block's later copies: copy i is tied to copy
    i mod ``period`` of its group."""
    by_layer: dict[str, list] = {}
    for node in graph.nodes.values():
        if node.layer is not None and node.op != "output":
            by_layer.setdefault(node.layer, []).append(node)
    tie = {}
    for group in graph.blocks:
        if len(group) < 2:
            continue
        for i, layer in enumerate(group[period:], start=period):
            first = by_layer.get(group[i % period], [])
            other = by_layer.get(layer, [])
            if len(other) != len(first) or not all(_same_shape(a, b, choices) for a, b in zip(first, other)):
                continue  # not positionally identical after all: leave this copy free
            for a, b in zip(first, other):
                tie[b.name] = a.name
    return tie


def _same_shape(a, b, choices) -> bool:
    ca, cb = choices[a.name], choices[b.name]
    return (
        a.op == b.op
        and (a.op == "placeholder" or a.target == b.target)  # placeholders are named after their parameter
        and a.meta == b.meta
        and len(ca.strategies) == len(cb.strategies)
        and (ca.strategies is cb.strategies  # node_choices gives equal signatures one list
             or all(x.inputs == y.inputs and x.output == y.output for x, y in zip(ca.strategies, cb.strategies)))
    )


@dataclasses.dataclass
class Elimination:
    node: str
    neighbours: tuple[str, ...]  # 0, 1 or 2 neighbours
    argmin: np.ndarray  # index table over the neighbours' choices


def eliminate(problem: Problem) -> tuple[Problem, list[Elimination]]:
    """Fold away nodes with at most two neighbours (see the module docstring). ``problem`` must
    have no ties (use ``problem.reduced()``)."""
    costs = {v: c.astype(float).copy() for v, c in problem.costs.items()}
    memory = {v: m.astype(float).copy() for v, m in problem.memory.items()}
    edges = {k: m.astype(float).copy() for k, m in problem.edges.items()}
    held = {k: m.astype(float) for k, m in problem.edge_memory.items()}
    base_memory = problem.base_memory
    adj: dict[str, set[str]] = {v: set() for v in costs}
    for u, v in edges:
        adj[u].add(v)
        adj[v].add(u)
    records: list[Elimination] = []
    once = [OnceCost(oc.cost, list(oc.members)) for oc in problem.once]  # members change as leaves fold
    reads_of: dict[str, set[tuple[int, int]]] = {}  # node -> (cost, member) positions that read it
    for g, oc in enumerate(once):
        for t, (a, b, _) in enumerate(oc.members):
            for x in {a, b}:
                reads_of.setdefault(x, set()).add((g, t))

    def kept() -> set[str]:
        return {x for x, reads in reads_of.items() if reads}

    def mat(u, v):  # R oriented u -> v
        return edges[(u, v)] if (u, v) in edges else edges[(v, u)].T

    def drop_edge(u, v):
        nonlocal base_memory
        edges.pop((u, v), None)
        edges.pop((v, u), None)
        for key in ((u, v), (v, u)):  # a constant under a budget (``removable``): kept in the base
            m = held.pop(key, None)
            if m is not None and problem.budget is not None:
                base_memory += float(m.flat[0]) if m.size else 0.0
        adj[u].discard(v)
        adj[v].discard(u)

    def add_edge(u, w, m):
        if (u, w) in edges:
            edges[(u, w)] = edges[(u, w)] + m
        elif (w, u) in edges:
            edges[(w, u)] = edges[(w, u)] + m.T
        else:
            edges[(u, w)] = m
            adj[u].add(w)
            adj[w].add(u)

    def memory_fixed(v) -> bool:  # v's choice moves no memory (or there is no budget to hold)
        return problem.budget is None or (np.ptp(memory[v]) == 0 and all(
            np.ptp(m) == 0 for (a, b), m in held.items() if v in (a, b) and m.size))

    def removable(v) -> bool:
        return len(adj[v]) <= 2 and len(costs) > 2 and v not in protected and memory_fixed(v)

    def fold_into_labels(v) -> bool:
        """A leaf ``v`` that once-paid costs read (a parameter and the op reading it): its choices
        become labels, one per pattern of the costs' masks it can take with its neighbour's
        choice, each at the cheapest choice of that pattern. Exact: given the labels (which decide
        the once-paid costs) and the neighbour's choice, the rest of v's price is a minimum. The
        costs then read v's labels alone, and the neighbour is free to fold."""
        if len(adj[v]) != 1 or not memory_fixed(v):
            return False
        (w,) = adj[v]
        reads = sorted(reads_of.get(v, ()))
        if any(once[g].members[t][:2] not in ((v, w), (w, v), (v, v)) for g, t in reads):
            return False
        r = costs[v][:, None] + mat(v, w)  # (j, k)
        masks = []
        for g, t in reads:
            a, b, m = once[g].members[t]
            masks.append(np.broadcast_to(m[:, None], r.shape) if a == b else (m if a == v else m.T))
        pattern = np.stack(masks, axis=-1) if masks else np.zeros(r.shape + (0,), dtype=bool)
        labels = sorted({tuple(x) for x in pattern[np.isfinite(r)].reshape(-1, len(masks))})
        if len(labels) >= len(costs[v]):
            return False
        folded = np.full((len(labels), r.shape[1]), np.inf)
        table = np.zeros((len(labels), r.shape[1]), dtype=int)
        for lab, bits in enumerate(labels):
            inside = np.all(pattern == np.array(bits, dtype=bool), axis=-1) & np.isfinite(r)
            cand = np.where(inside, r, np.inf)
            table[lab] = np.argmin(cand, axis=0)
            folded[lab] = np.min(cand, axis=0)
        for n, (g, t) in enumerate(reads):
            for x in once[g].members[t][:2]:
                if x != v:
                    reads_of[x].discard((g, t))
            once[g].members[t] = (v, v, np.array([bits[n] for bits in labels], dtype=bool))
        records.append(Elimination(v, (v, w), table))
        edges.pop((w, v), None)
        edges[(v, w)] = folded
        for key in ((v, w), (w, v)):  # constant under a budget (``memory_fixed``)
            if key in held:
                m = held.pop(key)
                held[(v, w)] = np.full(folded.shape, float(m.flat[0]) if m.size else 0.0)
        costs[v] = np.zeros(len(labels))
        memory[v] = np.full(len(labels), float(memory[v][0]))
        return True

    changed = True
    while changed:
        changed = False
        protected = kept()
        for v in list(costs):
            if v in protected and v in costs and len(adj[v]) == 1 and fold_into_labels(v):
                protected = {x for x in protected if reads_of[x]}
                changed = True
        for v in list(costs):
            if v not in costs or not removable(v):
                continue
            nbrs = tuple(sorted(adj[v]))
            cv = costs[v]
            if len(nbrs) == 0:
                table = np.array(int(np.argmin(cv)))
            elif len(nbrs) == 1:
                (w,) = nbrs
                total = cv[:, None] + mat(v, w)  # (j, k)
                table = np.argmin(total, axis=0)
                costs[w] = costs[w] + np.min(total, axis=0)
                drop_edge(v, w)
            else:
                u, w = nbrs
                total = mat(u, v)[:, :, None] + cv[None, :, None] + mat(v, w)[None, :, :]  # (i, j, k)
                table = np.argmin(total, axis=1)
                new = np.min(total, axis=1)
                drop_edge(u, v)
                drop_edge(v, w)
                add_edge(u, w, new)
            base_memory += float(memory[v][0]) if problem.budget is not None else 0.0
            records.append(Elimination(v, nbrs, table))
            del costs[v], memory[v], adj[v]
            changed = True
    return Problem(costs, memory, edges, {}, problem.budget, base_memory, held, once), records


def recover(choice: dict[str, int], records: list[Elimination]) -> dict[str, int]:
    """Choices of eliminated nodes, from the survivors' choices (last eliminated first)."""
    choice = dict(choice)
    for rec in reversed(records):
        idx = tuple(choice[n] for n in rec.neighbours)
        choice[rec.node] = int(rec.argmin[idx]) if idx else int(rec.argmin)
    return choice


# Above this many edge pairs (sum of k_u * k_v) the ILP gets too big for a quick solve.
MAX_EDGE_PAIRS = 40_000


def prune(problem: Problem, max_edge_pairs: int = MAX_EDGE_PAIRS) -> tuple[Problem, dict[str, np.ndarray]]:
    """Shrink the candidate lists of the widest nodes until the edge matrices hold at most
    ``max_edge_pairs`` pairs. This is a heuristic (the only one in the solver, and used only when
    the exact problem is too big): a candidate is scored by its own cost plus, on every edge, the
    cheapest way to reach or leave it, and the best-scored ones are kept, together with the
    smallest-memory candidate when a budget is set. Returns the smaller problem and, per node, the
    original indices it kept (identity where nothing was pruned)."""
    keep = {v: np.arange(len(c)) for v, c in problem.costs.items()}

    def pairs():
        return sum(len(keep[u]) * len(keep[v]) for u, v in problem.edges)

    while pairs() > max_edge_pairs:
        widest = max(keep, key=lambda v: len(keep[v]))
        k = len(keep[widest])
        if k <= 4:
            break
        score = problem.costs[widest][keep[widest]].astype(float)
        for (u, v), m in problem.edges.items():
            if v == widest:
                score = score + np.min(m[np.ix_(keep[u], keep[v])], axis=0)
            elif u == widest:
                score = score + np.min(m[np.ix_(keep[u], keep[v])], axis=1)
        order = np.argsort(score, kind="stable")[: max(4, k // 2)]
        chosen = set(keep[widest][order].tolist())
        if problem.budget is not None:
            chosen.add(int(keep[widest][np.argmin(problem.memory[widest][keep[widest]])]))
        keep[widest] = np.array(sorted(chosen))
    sub = Problem(
        {v: c[keep[v]] for v, c in problem.costs.items()},
        {v: m[keep[v]] for v, m in problem.memory.items()},
        {(u, v): m[np.ix_(keep[u], keep[v])] for (u, v), m in problem.edges.items()},
        {}, problem.budget, problem.base_memory,
        {(u, v): m[np.ix_(keep[u], keep[v])] for (u, v), m in problem.edge_memory.items()},
        [OnceCost(oc.cost, [(u, v, m[keep[u]] if u == v else m[np.ix_(keep[u], keep[v])]) for u, v, m in oc.members])
         for oc in problem.once],
    )
    return sub, keep
