"""Resharding steps: what each collective (or local) step does to a spec.

States are specs of one tensor on one mesh. A step changes the spec over one group of mesh axes:

    all_gather(G, d)         the axes G, the trailing (least significant) splitters of dim d, stop splitting it
    slice(a, d)              free axis a starts splitting dim d (local, no communication)
    all_reduce(G)            the pending sum over G is resolved, the value replicated
    reduce_scatter(G, d)     the pending sum over G is resolved into a split of dim d
    all_to_all(G, d -> e)    the trailing splitters G of dim d move to the end of dim e's splitters
    to_partial(a)            a replicated axis becomes a pending sum (rank 0 of the group keeps the
                             value, the others hold zeros; local, no communication)

Only the trailing splitters of a dim can be gathered or moved: gathering a more significant axis
would leave each rank a strided, not a contiguous, piece. ``neighbours`` lists every step from a
spec; ``spec_after`` replays one; ``naive_plan`` is the baseline route (resolve, gather all, slice).
Nothing here is priced: the cheapest route is the solver's search
(``autopar.solver.reshard_search.plan_reshard``), which prices each step with ``cost_model.comm``.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from autopar.errors import ReshardError
from autopar.sharding_spec.spec import ShardingSpec

STEP_KINDS = ("all_gather", "slice", "all_reduce", "reduce_scatter", "all_to_all", "to_partial")
COMM_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Step:
    """One resharding step. ``axes``: the mesh axes of the group (in shard order). ``src_dim``:
    the dim gathered or sent by all_to_all. ``dst_dim``: the dim sliced, scattered or received.
    ``nbytes``: the local bytes a collective moves (as the alpha-beta formulas count them), a
    slice's input (it copies out its chunk, and its backward pads the gradient back to this size);
    0 for to_partial. ``before``/``after``: the specs."""

    kind: str
    axes: tuple[int, ...]
    before: ShardingSpec
    after: ShardingSpec
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
    """A route of steps from ``src`` to ``dst`` (``solver.reshard_search.PricedReshard`` adds
    each step's price)."""

    src: ShardingSpec
    dst: ShardingSpec
    steps: tuple[Step, ...]

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
        nbytes = local_bytes(nbytes_spec(after), shape, itemsize) if kind in COMM_KINDS or kind == "slice" else 0
        return Step(kind, tuple(axes), spec, after, nbytes, src_dim, dst_dim)

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
            out.append(make("slice", (a,), new, spec.partial, lambda after: spec, dst_dim=d))
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


def naive_plan(src: ShardingSpec, dst: ShardingSpec, mesh, itemsize: int = 4) -> ReshardPlan:
    """Resolve every pending sum, gather everything, then slice (and mark pending sums): the
    baseline any priced route must not exceed, and a route that needs no search (``codegen.ops
    .gather_full`` gathers a shard whole along it)."""
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
