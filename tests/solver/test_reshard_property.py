"""Property tests of the resharding search, checked step by step in the single-process simulator.

For random integer tensors and random source/target specs (partial sums, multi-axis splits in
either order) on small meshes: the plan's steps turn the source shards into exactly the target
shards, the plan never costs more than the naive gather-everything plan, steps chain, plans are
cached, and Dijkstra's plan is as cheap as the best of all short step sequences.
"""
import math
import random

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from autopar.cluster import PRESETS, Link
from autopar.sharding_spec import Mesh, ShardingSpec, naive_plan
from autopar.sharding_spec import simulator
from autopar.sharding_spec.reshard import STEP_KINDS, neighbours
from autopar.solver.reshard_search import plan_reshard, priced, step_cost

MESH_SHAPES = [(2,), (4,), (2, 2), (2, 4), (2, 2, 2)]
# Links of different speed per axis, so that plans must pick which axes to talk over.
_SKEWED = {
    1: (Link(5e-6, 1e-10),),
    2: (Link(2e-5, 1e-9), Link(5e-6, 1e-10)),
    3: (Link(2e-5, 4e-9), Link(1e-5, 1e-9), Link(5e-6, 1e-10)),
}
CLUSTERS = ["cpu-gloo", "a100-80g", "skewed"]


def make_mesh(shape, cluster):
    if cluster == "skewed":
        cluster = PRESETS["a100-80g"].with_axis_links(_SKEWED[len(shape)])
    return Mesh(shape, cluster=cluster)


def spec_for(rnd, mesh, shape):
    """A random valid spec of ``shape`` on ``mesh``: each mesh axis unused, partial, or on a dim,
    the axes on one dim in a random order. Drawn with a Random seeded by hypothesis, so the
    draws are spread evenly (hypothesis' own draws lean heavily to the simplest choice)."""
    choices = ["R", "P"] + list(range(len(shape)))
    weights = [1.0, 1.5] + [3.0 / len(shape)] * len(shape)
    roles = rnd.choices(choices, weights, k=mesh.ndim)
    if rnd.random() < 0.3 and len(shape) > 0:  # pile the axes onto one dim: multi-axis splits
        d = rnd.randrange(len(shape))
        roles = [d if r != "P" or rnd.random() < 0.5 else r for r in roles]
    dim_axes = []
    for d in range(len(shape)):
        axes = [a for a, r in enumerate(roles) if r == d]
        rnd.shuffle(axes)
        dim_axes.append(tuple(axes))
    partial = tuple(a for a, r in enumerate(roles) if r == "P")
    return ShardingSpec(shape, tuple(dim_axes), partial, mesh.ndim)


@st.composite
def cases(draw):
    mesh = make_mesh(draw(st.sampled_from(MESH_SHAPES)), draw(st.sampled_from(CLUSTERS)))
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    ndim = rnd.randint(1, 4)
    # every dim a multiple of 8 (the largest group on these meshes), so every spec is even
    shape = (8,) * 4 if ndim == 4 else tuple(rnd.choice([8, 16]) for _ in range(ndim))
    src = spec_for(rnd, mesh, shape)
    dst = spec_for(rnd, mesh, shape)
    if dst == src and rnd.random() < 0.9:
        dst = spec_for(rnd, mesh, shape)
    itemsize = rnd.choice([2, 4])
    seed = rnd.randrange(2**31)
    return mesh, src, dst, itemsize, seed


def random_tensor(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 51, shape, generator=g, dtype=torch.int64)


def check_holds(locals_, tensor, spec, mesh):
    """``locals_`` hold ``tensor`` under ``spec``: right local shapes, and for each replica (each
    coordinate of the axes that neither split nor sum) the shards, summed over the partial axes,
    put back the whole tensor."""
    local = spec.local_shape(mesh)
    for r in range(mesh.size):
        assert tuple(locals_[r].shape) == local, (r, tuple(locals_[r].shape), local)
    free = [a for a in range(mesh.ndim) if a not in spec.used_axes]
    fulls = {}
    for r in range(mesh.size):
        coord = mesh.coordinate(r)
        key = tuple(coord[a] for a in free)
        full = fulls.setdefault(key, torch.zeros(spec.shape, dtype=tensor.dtype))
        full[spec.local_slices(mesh, r)] += locals_[r]
    assert len(fulls) == mesh.axes_size(free)
    for full in fulls.values():
        assert torch.equal(full, tensor)
    assert torch.equal(simulator.unshard(locals_, spec, mesh), tensor)


def check_plan_chain(plan, src, dst):
    assert plan.src == src and plan.dst == dst
    prev = src
    for step, cost in zip(plan.steps, plan.costs, strict=True):
        assert step.kind in STEP_KINDS
        assert step.before == prev
        assert cost >= 0
        prev = step.after
    assert prev == dst


PROPERTY_SETTINGS = settings(deadline=None, derandomize=True, max_examples=250)


@PROPERTY_SETTINGS
@given(cases())
def test_plan_reshards_exactly(case):
    mesh, src, dst, itemsize, seed = case
    tensor = random_tensor(src.shape, seed)
    plan = plan_reshard(src, dst, mesh, itemsize)
    check_plan_chain(plan, src, dst)
    event(f"mesh {mesh.shape}")
    event(f"{len(plan.steps)} steps")
    for step in plan.steps:
        event(f"step {step.kind} over {len(step.axes)} axes")
    if any(len(ax) > 1 for ax in src.dim_axes + dst.dim_axes):
        event("multi-axis split")
    if src.partial and dst.partial:
        event("partial -> partial")

    before = simulator.shard(tensor, src, mesh, partial_split="random")
    check_holds(before, tensor, src, mesh)
    after = simulator.apply_plan(before, plan, mesh)
    if dst.partial:
        check_holds(after, tensor, dst, mesh)
    else:
        expect = simulator.shard(tensor, dst, mesh)
        for r in range(mesh.size):
            assert torch.equal(after[r], expect[r]), (str(plan), r)

    # the steps are real steps: each is one of the planner's moves from its ``before``
    for step in plan.steps:
        assert step in neighbours(step.before, mesh, itemsize)

    # never worse than resolving, gathering and re-slicing everything
    naive = priced(naive_plan(src, dst, mesh, itemsize), mesh)
    check_plan_chain(naive, src, dst)
    assert plan.cost <= naive.cost + 1e-15, (str(plan), plan.cost, str(naive), naive.cost)
    assert plan.comm_bytes >= 0
    # the naive plan is correct too
    after_naive = simulator.apply_plan(before, naive, mesh)
    check_holds(after_naive, tensor, dst, mesh)

    # cached: the very same object
    assert plan_reshard(src, dst, mesh, itemsize) is plan
    # the reverse plan also exists and brings the data back
    back = plan_reshard(dst, src, mesh, itemsize)
    check_holds(simulator.apply_plan(after, back, mesh), tensor, src, mesh)


@settings(deadline=None, derandomize=True, max_examples=60)
@given(cases())
def test_plan_from_first_rank_partial_layout(case):
    # the same plan must also work when partial sums sit on the first rank only
    mesh, src, dst, itemsize, seed = case
    tensor = random_tensor(src.shape, seed)
    plan = plan_reshard(src, dst, mesh, itemsize)
    after = simulator.apply_plan(simulator.shard(tensor, src, mesh, partial_split="first"), plan, mesh)
    check_holds(after, tensor, dst, mesh)


# ---- Dijkstra is optimal: compare with the best of all step sequences up to length 4 --------------
def _all_specs(mesh, shape):
    """Every valid spec of ``shape`` on ``mesh`` (roles per axis, every order on a dim)."""
    import itertools

    out = set()
    for roles in itertools.product(["R", "P"] + list(range(len(shape))), repeat=mesh.ndim):
        per_dim = [[a for a, r in enumerate(roles) if r == d] for d in range(len(shape))]
        partial = tuple(a for a, r in enumerate(roles) if r == "P")
        for orders in itertools.product(*(itertools.permutations(ax) for ax in per_dim)):
            spec = ShardingSpec(shape, tuple(orders), partial, mesh.ndim)
            if spec.is_even(mesh.shape):
                out.add(spec)
    return sorted(out, key=str)


def _best_within(src, mesh, itemsize, depth):
    """The cheapest cost to every spec over all step sequences of at most ``depth`` steps
    (exhaustive: every sequence is expanded, step by step, from ``src``)."""
    best = {src: 0.0}
    frontier = {src: 0.0}  # cheapest way to reach each spec with exactly k steps
    for _ in range(depth):
        nxt = {}
        for spec, cost in frontier.items():
            for step in neighbours(spec, mesh, itemsize):
                c = cost + step_cost(step, mesh)
                if c < nxt.get(step.after, math.inf):
                    nxt[step.after] = c
        for spec, c in nxt.items():
            if c < best.get(spec, math.inf):
                best[spec] = c
        frontier = nxt
    return best


@pytest.mark.parametrize(
    "cluster",
    ["cpu-gloo", "skewed", "inverted"],
)
@pytest.mark.parametrize("shape", [(8, 8), (8, 16)])
def test_dijkstra_is_optimal_on_2x2(cluster, shape):
    if cluster == "inverted":
        cl = PRESETS["a100-80g"].with_axis_links([Link(1e-6, 1e-11), Link(3e-5, 2e-9)])
        mesh = Mesh((2, 2), cluster=cl)
    else:
        mesh = make_mesh((2, 2), cluster)
    specs = _all_specs(mesh, shape)
    assert len(specs) == 18  # 4 roles per axis, squared, plus S10 on either dim
    depth = 4
    for src in specs:
        best = _best_within(src, mesh, 4, depth)
        for dst in specs:
            plan = plan_reshard(src, dst, mesh, 4)
            # Dijkstra's plan is at least as cheap as every sequence of <= 4 steps ...
            if dst in best:
                assert plan.cost <= best[dst] * (1 + 1e-12) + 1e-18, (str(plan), plan.cost, best[dst])
            # ... and when it is itself that short, exactly as cheap as the best of them
            if len(plan.steps) <= depth:
                assert dst in best
                assert plan.cost == pytest.approx(best[dst], rel=1e-12, abs=1e-18), (str(plan), plan.cost, best[dst])


# ---- exhaustive: every pair of specs on small meshes, simulated -----------------------------------
@pytest.mark.parametrize(
    "mesh_shape, shape, n_specs",
    [((2, 2), (8, 16), 18), ((2, 2, 2), (8,), 38), ((2, 4), (8, 8), 18)],
)
def test_every_pair_reshards_exactly(mesh_shape, shape, n_specs):
    mesh = make_mesh(mesh_shape, "skewed")
    specs = _all_specs(mesh, shape)
    assert len(specs) == n_specs
    tensor = random_tensor(shape, 1234)
    kinds = set()
    for src in specs:
        before = simulator.shard(tensor, src, mesh, partial_split="random")
        for dst in specs:
            plan = plan_reshard(src, dst, mesh, 4)
            check_plan_chain(plan, src, dst)
            kinds.update((s.kind, len(s.axes)) for s in plan.steps)
            after = simulator.apply_plan(before, plan, mesh)
            check_holds(after, tensor, dst, mesh)
            assert plan.cost <= priced(naive_plan(src, dst, mesh, 4), mesh).cost + 1e-15
    # every kind of step is exercised (a 1-d tensor has no second dim to all_to_all into)
    assert {k for k, _ in kinds} == set(STEP_KINDS) - ({"all_to_all"} if len(shape) == 1 else set())


@pytest.mark.parametrize("mesh_shape, shape", [((2, 2), (8, 16)), ((2, 2, 2), (8,)), ((2, 2, 2), (8, 8)), ((2, 4), (8, 8))])
def test_every_step_is_exact(mesh_shape, shape):
    """Each move the planner may take, from every spec (multi-axis groups in either order
    included), does in the simulator what its ``after`` spec says."""
    mesh = make_mesh(mesh_shape, "cpu-gloo")
    tensor = random_tensor(shape, 99)
    seen = set()
    for src in _all_specs(mesh, shape):
        before = simulator.shard(tensor, src, mesh, partial_split="random")
        for step in neighbours(src, mesh, 4):
            assert step.before == src and step.after != src and step.after.is_even(mesh.shape)
            seen.add((step.kind, step.axes))
            check_holds(simulator.apply_step(before, step, mesh), tensor, step.after, mesh)
    assert {k for k, _ in seen} == set(STEP_KINDS) - ({"all_to_all"} if len(shape) == 1 else set())
    if len(mesh_shape) > 1:
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all" if len(shape) > 1 else "all_gather"):
            assert (kind, (0, 1)) in seen
        for kind in ("all_gather", "reduce_scatter", "all_to_all" if len(shape) > 1 else "all_gather"):
            assert (kind, (1, 0)) in seen
