"""The resharding search: the cheapest route of steps from one spec to another, priced.

The steps and what they do are ``autopar.sharding_spec.reshard``'s; here each is priced by
``cost_model.comm`` (a local step costs its copies and a tie-break constant, so among equal-cost
routes the shorter wins) and Dijkstra over the specs finds the cheapest route. One search from a source prices every
target; small state spaces get every pair at once (Floyd-Warshall). A value that gradients flow
back through runs its route's backward too: ``with_backward`` routes minimise forward and backward
together (a step's backward as ``cost_model.gradients.backward_route_s`` prices it under the plan's
gradient convention: ``identical`` axes; a slice's is not its forward), and under the identical
convention never take a step over identical and other axes together (``record.gradients.identical_ok``).
Searches and routes are cached per (source, target, mesh, itemsize, with_backward, identical).
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math

import numpy as np

from autopar.cost_model.comm import layout_copy_bytes, layout_copy_time, mesh_collective_time
from autopar.cost_model.gradients import backward_route_s
from autopar.record.gradients import partly_whole
from autopar.errors import ReshardError
from autopar.sharding_spec.reshard import ReshardPlan, Step, neighbours
from autopar.sharding_spec.spec import ShardingSpec

# A local step (slice, to_partial) costs this much besides its copies, so among equal-cost plans the shorter wins.
LOCAL_STEP_TIEBREAK_S = 1e-12


@dataclasses.dataclass(frozen=True)
class PricedReshard(ReshardPlan):
    """A route with each step's price in seconds (``costs[i]`` is ``steps[i]``'s)."""

    costs: tuple[float, ...]

    @property
    def cost(self) -> float:
        return sum(self.costs)


def step_cost(step: Step, mesh) -> float:
    """Seconds ``step`` takes on ``mesh``: its collective's alpha-beta time and the local copies
    around it (``cost_model.comm.layout_copy_bytes``), or the tie-break."""
    n = math.prod(mesh.shape[a] for a in step.axes)
    copies = layout_copy_time(layout_copy_bytes(step.kind, step.nbytes, n, step.src_dim, step.dst_dim), mesh.resolved_cluster())
    if step.is_comm:
        return mesh_collective_time(step.kind, step.nbytes, mesh, step.axes) + copies
    return copies + LOCAL_STEP_TIEBREAK_S


def priced(route: ReshardPlan, mesh) -> PricedReshard:
    """``route`` (``naive_plan``'s, say) with each step priced on ``mesh``."""
    return PricedReshard(route.src, route.dst, route.steps, tuple(step_cost(s, mesh) for s in route.steps))


def plan_reshard(src: ShardingSpec, dst: ShardingSpec, mesh, itemsize: int = 4, *, with_backward: bool = False,
                 identical: tuple = ()) -> PricedReshard:
    """The cheapest plan from ``src`` to ``dst`` on ``mesh`` for elements of ``itemsize`` bytes
    (``with_backward``: forward and backward together, gradients whole on ``identical`` axes); each
    step priced forward."""
    for name, spec in (("source", src), ("target", dst)):
        spec.check_even(mesh)
    if src.shape != dst.shape:
        raise ReshardError(f"cannot reshard between shapes {src.shape} and {dst.shape}; resharding keeps the global shape")
    return _plan_cached(src, dst, mesh, int(itemsize), *_backward_key(with_backward, identical))


def _backward_key(with_backward, identical) -> tuple[bool, tuple]:
    """The cache key of a route's backward: whether it runs, and under which identical axes."""
    return bool(with_backward), tuple(sorted(identical)) if with_backward else ()


@functools.lru_cache(maxsize=65536)
def _plan_cached(src: ShardingSpec, dst: ShardingSpec, mesh, itemsize: int, with_backward: bool = False,
                 identical: tuple = ()) -> PricedReshard:
    if src == dst:
        return PricedReshard(src, dst, (), ())
    dist, prev = _search_from(src, mesh, itemsize, with_backward, identical)
    if dst not in dist:
        raise ReshardError(f"no sequence of collectives turns {src} into {dst} on {mesh}")
    steps, costs = [], []
    spec = dst
    while spec != src:
        step, cost = prev[spec]
        steps.append(step)
        costs.append(cost)
        spec = step.before
    return PricedReshard(src, dst, tuple(reversed(steps)), tuple(reversed(costs)))


def reshard_cost(src: ShardingSpec, dst: ShardingSpec, mesh, itemsize: int = 4) -> float:
    """The cost of the cheapest plan (inf when the target is uneven, of another shape, or
    unreachable): the same table ``reshard_costs_from`` reads, so every price agrees."""
    if src == dst:
        return 0.0
    return reshard_costs_from(src, [dst], mesh, itemsize)[0]


def reshard_costs_from(src: ShardingSpec, dsts, mesh, itemsize: int = 4, *, with_backward: bool = False,
                       identical: tuple = ()) -> list[float]:
    """``reshard_cost`` from one source to many targets (one search, no per-target overhead);
    ``with_backward``: the cheapest route's forward and backward together (gradients whole on
    ``identical`` axes)."""
    if not src.is_even(mesh.shape):
        return [math.inf] * len(dsts)
    key = _backward_key(with_backward, identical)
    table = _all_pairs(ShardingSpec.replicate(src.shape, src.mesh_ndim), mesh, int(itemsize), *key)
    if table is not None:
        index, dist = table
        row = dist[index[src]]
        return [float(row[index[d]]) if d in index else math.inf for d in dsts]
    dist = _search_from(src, mesh, int(itemsize), *key)[0]
    return [dist.get(d, math.inf) for d in dsts]


# Above this many states per tensor shape, Floyd-Warshall (n^3) loses to one Dijkstra per source.
ALL_PAIRS_MAX_STATES = 600


@functools.lru_cache(maxsize=1024)
def _all_pairs(replicated: ShardingSpec, mesh, itemsize: int, with_backward: bool = False, identical: tuple = ()):
    """Every even spec of one shape (all reachable from replicated) and the cost between every
    pair, by Floyd-Warshall in numpy; None when there are too many states."""
    index = {replicated: 0}
    frontier = [replicated]
    while frontier:
        nxt = []
        for spec in frontier:
            for step, _ in _priced_neighbours(spec, mesh, itemsize):
                if step.after not in index:
                    if len(index) >= ALL_PAIRS_MAX_STATES:
                        return None
                    index[step.after] = len(index)
                    nxt.append(step.after)
        frontier = nxt
    n = len(index)
    dist = np.full((n, n), math.inf)
    np.fill_diagonal(dist, 0.0)
    for spec, i in index.items():
        for step, _, cost in _weighted_neighbours(spec, mesh, itemsize, with_backward, identical):
            j = index[step.after]
            dist[i, j] = min(dist[i, j], cost)
    for k in range(n):
        np.minimum(dist, dist[:, k, None] + dist[None, k, :], out=dist)
    return index, dist


@functools.lru_cache(maxsize=8192)
def _search_from(src: ShardingSpec, mesh, itemsize: int, with_backward: bool = False, identical: tuple = ()):
    """Dijkstra from ``src`` over every reachable spec: (cost per spec, (last step, its forward
    cost) per spec)."""
    best = {src: 0.0}
    prev: dict[ShardingSpec, tuple[Step, float]] = {}
    done = set()
    counter = itertools.count()
    heap = [(0.0, next(counter), src)]
    while heap:
        cost, _, spec = heapq.heappop(heap)
        if spec in done:
            continue
        done.add(spec)
        for step, step_s, weight in _weighted_neighbours(spec, mesh, itemsize, with_backward, identical):
            c = cost + weight
            if c < best.get(step.after, math.inf):
                best[step.after] = c
                prev[step.after] = (step, step_s)
                heapq.heappush(heap, (c, next(counter), step.after))
    return best, prev


@functools.lru_cache(maxsize=1 << 18)
def _priced_neighbours(spec: ShardingSpec, mesh, itemsize: int) -> tuple[tuple[Step, float], ...]:
    # Searches from different sources expand the same states: build and price each state's steps once.
    return tuple((step, step_cost(step, mesh)) for step in neighbours(spec, mesh, itemsize))


@functools.lru_cache(maxsize=1 << 18)
def _weighted_neighbours(spec: ShardingSpec, mesh, itemsize: int, with_backward: bool, identical: tuple = ()
                         ) -> tuple[tuple[Step, float, float], ...]:
    """(step, its forward seconds, the seconds the search weighs it by: with its backward); with a
    backward, no step over identical and other axes together."""
    if not with_backward:
        return tuple((step, cost, cost) for step, cost in _priced_neighbours(spec, mesh, itemsize))
    return tuple((step, cost, cost + backward_route_s((step,), (cost,), mesh, identical))
                 for step, cost in _priced_neighbours(spec, mesh, itemsize) if not partly_whole(step.axes, identical))
