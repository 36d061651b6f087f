"""The resharding planner: the cheapest sequence of collective steps from one spec to another.

States are specs of one tensor on one mesh. A step changes the spec over one group of mesh axes:

    all_gather(G, d)         the axes G, the trailing (least significant) splitters of dim d, stop splitting it
    slice(a, d)              free axis a starts splitting dim d (local, no communication)
    all_reduce(G)            the pending sum over G is resolved, the value replicated
    reduce_scatter(G, d)     the pending sum over G is resolved into a split of dim d
    all_to_all(G, d -> e)    the trailing splitters G of dim d move to the end of dim e's splitters
    to_partial(a)            a replicated axis becomes a pending sum (rank 0 of the group keeps the
                             value, the others hold zeros; local, no communication)

Only the trailing splitters of a dim can be gathered or moved: gathering a more significant axis
would leave each rank a strided, not a contiguous, piece. Dijkstra over these states, each step
priced by cost_model.comm (local steps cost a tie-break constant so shorter plans win ties), finds
the cheapest plan. One search from a source prices every target; searches and plans are cached
per (source, target, mesh, itemsize).
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math

import numpy as np

from autopar.cost_model.comm import mesh_collective_time
from autopar.errors import ReshardError
from autopar.sharding_spec.spec import ShardingSpec

# A local step (slice, to_partial) costs this much, so among equal-cost plans the shorter wins.
LOCAL_STEP_TIEBREAK_S = 1e-12

STEP_KINDS = ("all_gather", "slice", "all_reduce", "reduce_scatter", "all_to_all", "to_partial")
COMM_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a resharding plan. ``axes``: the mesh axes of the group (in shard order).
    ``src_dim``: the dim gathered or sent by all_to_all. ``dst_dim``: the dim sliced, scattered or
    received. ``nbytes``: the bytes the cost formula used. ``before``/``after``: the specs."""

    kind: str
    axes: tuple[int, ...]
    before: ShardingSpec
    after: ShardingSpec
    cost: float
    nbytes: int
    src_dim: int | None = None
    dst_dim: int | None = None

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        axes = "".join(map(str, self.axes))
        if self.kind == "all_gather":
            what = f"all_gather(axes {axes}, dim {self.src_dim})"
        elif self.kind == "slice":
            what = f"slice(axis {axes}, dim {self.dst_dim})"
        elif self.kind == "reduce_scatter":
            what = f"reduce_scatter(axes {axes}, dim {self.dst_dim})"
        elif self.kind == "all_to_all":
            what = f"all_to_all(axes {axes}, dim {self.src_dim}->{self.dst_dim})"
        else:
            what = f"{self.kind}(axes {axes})"
        return f"{what}: {self.before} -> {self.after}"


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    src: ShardingSpec
    dst: ShardingSpec
    steps: tuple[Step, ...]

    @property
    def cost(self) -> float:
        return sum(s.cost for s in self.steps)

    @property
    def comm_bytes(self) -> int:
        return sum(s.nbytes for s in self.steps if s.is_comm)

    def __str__(self) -> str:
        if not self.steps:
            return f"{self.src} -> {self.dst}: nothing to do"
        return " ; ".join(str(s) for s in self.steps)


def local_bytes(spec: ShardingSpec, mesh_shape, itemsize: int) -> int:
    numel = math.prod(s // math.prod(mesh_shape[a] for a in ax) for s, ax in zip(spec.shape, spec.dim_axes))
    return numel * itemsize


def _ordered_subsets(axes):
    axes = tuple(axes)
    for k in range(1, len(axes) + 1):
        for combo in itertools.permutations(axes, k):
            yield combo


def neighbours(spec: ShardingSpec, mesh, itemsize: int):
    """Every step that can be taken from ``spec``, each to an even, valid spec."""
    shape = mesh.shape
    free = [a for a in range(mesh.ndim) if a not in spec.used_axes]
    dims = spec.dim_axes

    def make(kind, axes, after_dims, after_partial, nbytes_spec, src_dim=None, dst_dim=None):
        after = ShardingSpec(spec.shape, tuple(after_dims), tuple(after_partial), spec.mesh_ndim)
        if not after.is_even(shape):
            return None
        nbytes = local_bytes(nbytes_spec(after), shape, itemsize)
        if kind in COMM_KINDS:
            cost = mesh_collective_time(kind, nbytes, mesh, axes)
        else:
            cost = LOCAL_STEP_TIEBREAK_S
        return Step(kind, tuple(axes), spec, after, cost, nbytes if kind in COMM_KINDS else 0, src_dim, dst_dim)

    out = []
    for d, ax in enumerate(dims):
        # all_gather and all_to_all of the k trailing splitters of dim d
        for k in range(1, len(ax) + 1):
            group, rest = ax[len(ax) - k:], ax[: len(ax) - k]
            new = list(dims)
            new[d] = rest
            out.append(make("all_gather", group, new, spec.partial, lambda after: after, src_dim=d))
            for e in range(spec.ndim):
                if e == d:
                    continue
                new2 = list(new)
                new2[e] = dims[e] + group
                out.append(make("all_to_all", group, new2, spec.partial, lambda after: spec, src_dim=d, dst_dim=e))
    for a in free:
        for d in range(spec.ndim):
            new = list(dims)
            new[d] = dims[d] + (a,)
            out.append(make("slice", (a,), new, spec.partial, lambda after: after, dst_dim=d))
        out.append(make("to_partial", (a,), dims, spec.partial + (a,), lambda after: after))
    for group in _ordered_subsets(spec.partial):
        remaining = tuple(a for a in spec.partial if a not in group)
        if list(group) == sorted(group):  # order does not matter for a reduction
            out.append(make("all_reduce", group, dims, remaining, lambda after: after))
        for d in range(spec.ndim):
            new = list(dims)
            new[d] = dims[d] + group
            out.append(make("reduce_scatter", group, new, remaining, lambda after: spec, dst_dim=d))
    return [s for s in out if s is not None]


def plan_reshard(src: ShardingSpec, dst: ShardingSpec, mesh, itemsize: int = 4) -> ReshardPlan:
    """The cheapest plan from ``src`` to ``dst`` on ``mesh`` for elements of ``itemsize`` bytes."""
    for name, spec in (("source", src), ("target", dst)):
        spec.check_even(mesh)
    if src.shape != dst.shape:
        raise ReshardError(f"cannot reshard between shapes {src.shape} and {dst.shape}; resharding keeps the global shape")
    return _plan_cached(src, dst, mesh, int(itemsize))


@functools.lru_cache(maxsize=65536)
def _plan_cached(src: ShardingSpec, dst: ShardingSpec, mesh, itemsize: int) -> ReshardPlan:
    if src == dst:
        return ReshardPlan(src, dst, ())
    dist, prev = _search_from(src, mesh, itemsize)
    if dst not in dist:
        raise ReshardError(f"no sequence of collectives turns {src} into {dst} on {mesh}")
    steps = []
    spec = dst
    while spec != src:
        step = prev[spec]
        steps.append(step)
        spec = step.before
    return ReshardPlan(src, dst, tuple(reversed(steps)))


def reshard_cost(src: ShardingSpec, dst: ShardingSpec, mesh, itemsize: int = 4) -> float:
    """The cost of the cheapest plan (inf when the target is uneven, of another shape, or
    unreachable): the same table ``reshard_costs_from`` reads, so every price agrees."""
    if src == dst:
        return 0.0
    return reshard_costs_from(src, [dst], mesh, itemsize)[0]


def reshard_costs_from(src: ShardingSpec, dsts, mesh, itemsize: int = 4) -> list[float]:
    """``reshard_cost`` from one source to many targets (one search, no per-target overhead)."""
    if not src.is_even(mesh.shape):
        return [math.inf] * len(dsts)
    table = _all_pairs(ShardingSpec.replicate(src.shape, src.mesh_ndim), mesh, int(itemsize))
    if table is not None:
        index, dist = table
        row = dist[index[src]]
        return [float(row[index[d]]) if d in index else math.inf for d in dsts]
    dist = _search_from(src, mesh, int(itemsize))[0]
    return [dist.get(d, math.inf) for d in dsts]


# Above this many states per tensor shape, Floyd-Warshall (n^3) loses to one Dijkstra per source.
ALL_PAIRS_MAX_STATES = 600


@functools.lru_cache(maxsize=1024)
def _all_pairs(replicated: ShardingSpec, mesh, itemsize: int):
    """Every even spec of one shape (all reachable from replicated) and the cost between every
    pair, by Floyd-Warshall in numpy; None when there are too many states."""
    index = {replicated: 0}
    frontier = [replicated]
    while frontier:
        nxt = []
        for spec in frontier:
            for step in _neighbours_cached(spec, mesh, itemsize):
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
        for step in _neighbours_cached(spec, mesh, itemsize):
            j = index[step.after]
            dist[i, j] = min(dist[i, j], step.cost)
    for k in range(n):
        np.minimum(dist, dist[:, k, None] + dist[None, k, :], out=dist)
    return index, dist


@functools.lru_cache(maxsize=8192)
def _search_from(src: ShardingSpec, mesh, itemsize: int):
    """Dijkstra from ``src`` over every reachable spec: (cost per spec, last step per spec)."""
    best = {src: 0.0}
    prev: dict[ShardingSpec, Step] = {}
    done = set()
    counter = itertools.count()
    heap = [(0.0, next(counter), src)]
    while heap:
        cost, _, spec = heapq.heappop(heap)
        if spec in done:
            continue
        done.add(spec)
        for step in _neighbours_cached(spec, mesh, itemsize):
            c = cost + step.cost
            if c < best.get(step.after, math.inf):
                best[step.after] = c
                prev[step.after] = step
                heapq.heappush(heap, (c, next(counter), step.after))
    return best, prev


@functools.lru_cache(maxsize=1 << 18)
def _neighbours_cached(spec: ShardingSpec, mesh, itemsize: int) -> tuple[Step, ...]:
    # Searches from different sources expand the same states: build each state's steps once.
    return tuple(neighbours(spec, mesh, itemsize))


def naive_plan(src: ShardingSpec, dst: ShardingSpec, mesh, itemsize: int = 4) -> ReshardPlan:
    """Resolve every pending sum, gather everything, then slice (and mark pending sums): the
    baseline any real plan must not exceed."""
    steps = []
    spec = src

    def take(kind, pred):
        nonlocal spec
        for s in neighbours(spec, mesh, itemsize):
            if s.kind == kind and pred(s):
                steps.append(s)
                spec = s.after
                return True
        return False

    if spec.partial:
        take("all_reduce", lambda s: s.axes == spec.partial)
    for d in range(spec.ndim):
        while spec.dim_axes[d]:
            take("all_gather", lambda s: s.src_dim == d and len(s.axes) == 1)
    for d, axes in enumerate(dst.dim_axes):
        for a in axes:
            take("slice", lambda s: s.axes == (a,) and s.dst_dim == d)
    for a in dst.partial:
        take("to_partial", lambda s: s.axes == (a,))
    if spec != dst:
        raise ReshardError(f"naive plan from {src} ended at {spec}, not {dst}")
    return ReshardPlan(src, dst, tuple(steps))


def spec_after(spec: ShardingSpec, step) -> ShardingSpec:
    """The spec after ``step`` (a Step or a saved plan's step: kind, axes, src_dim, dst_dim) from
    ``spec``: the planner's own transition, recomputed from the step alone."""
    dims = [tuple(ax) for ax in spec.dim_axes]
    partial = list(spec.partial)
    axes = tuple(step.axes)
    if step.kind == "all_gather":
        dims[step.src_dim] = dims[step.src_dim][: len(dims[step.src_dim]) - len(axes)]
    elif step.kind == "slice":
        dims[step.dst_dim] = dims[step.dst_dim] + axes
    elif step.kind == "all_reduce":
        partial = [a for a in partial if a not in axes]
    elif step.kind == "reduce_scatter":
        partial = [a for a in partial if a not in axes]
        dims[step.dst_dim] = dims[step.dst_dim] + axes
    elif step.kind == "all_to_all":
        dims[step.src_dim] = dims[step.src_dim][: len(dims[step.src_dim]) - len(axes)]
        dims[step.dst_dim] = dims[step.dst_dim] + axes
    elif step.kind == "to_partial":
        partial = partial + list(axes)
    return ShardingSpec(spec.shape, tuple(dims), tuple(partial), spec.mesh_ndim)
