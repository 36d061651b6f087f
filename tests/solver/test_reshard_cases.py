"""Hand-checked resharding plans (the solver's search): the step kinds, groups, bytes and prices one
can work out on paper, each also run in the simulator; and the errors for impossible requests."""
import dataclasses

import pytest
import torch

from autopar.cluster import PRESETS, Link
from autopar.cost_model.comm import collective_time, layout_copy_bytes, layout_copy_time
from autopar.errors import ReshardError, ShardingError
from autopar.sharding_spec import Mesh, ShardingSpec, naive_plan
from autopar.sharding_spec import simulator
from autopar.sharding_spec.reshard import spec_after
from autopar.solver.reshard_search import LOCAL_STEP_TIEBREAK_S, plan_reshard, priced, reshard_cost, reshard_costs_from

GLOO = PRESETS["cpu-gloo"].intra_node
# The ring model's answers: the cpu-gloo preset's links without gloo's per-kind factors (those are
# checked on their own below).
RING = dataclasses.replace(PRESETS["cpu-gloo"], name="cpu-gloo ring model", collective_factors=())


def copies(kind, nbytes, n, src_dim=None, dst_dim=None, cluster=RING) -> float:
    """Seconds of the local copies a step's runtime makes around its collective (``layout_copy_bytes``)."""
    return layout_copy_time(layout_copy_bytes(kind, nbytes, n, src_dim, dst_dim), cluster)


def ring_mesh(shape) -> Mesh:
    return Mesh(shape, cluster=RING)


def spec(text, shape, mesh):
    return ShardingSpec.parse(text, shape, mesh.ndim)


def run(src, dst, mesh, itemsize=4, seed=0):
    """Plan, simulate from randomly split partial sums, and check the target layout exactly."""
    plan = plan_reshard(src, dst, mesh, itemsize)
    t = torch.randint(-20, 21, src.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    out = simulator.apply_plan(simulator.shard(t, src, mesh, partial_split="random"), plan, mesh)
    assert torch.equal(simulator.unshard(out, dst, mesh), t)
    if not dst.partial:
        expect = simulator.shard(t, dst, mesh)
        for r in range(mesh.size):
            assert torch.equal(out[r], expect[r])
    else:
        for r in range(mesh.size):
            assert tuple(out[r].shape) == dst.local_shape(mesh)
    return plan


def only_step(plan):
    assert len(plan.steps) == 1, str(plan)
    return plan.steps[0]


# ---- the cases of the brief ----------------------------------------------------------------------------
def test_partial_to_multi_axis_split_is_one_reduce_scatter():
    mesh = ring_mesh((2, 2))
    src, dst = spec("[S0, R | P1]", (8, 8), mesh), spec("[S01, R]", (8, 8), mesh)
    plan = run(src, dst, mesh)
    step = only_step(plan)
    assert step.kind == "reduce_scatter"
    assert step.axes == (1,) and step.dst_dim == 0
    assert step.before == src and step.after == dst
    # reduce_scatter is priced on the bytes each rank starts with: 4x8 fp32 = 128 B
    assert step.nbytes == 4 * 8 * 4
    assert plan.costs[0] == pytest.approx(collective_time("reduce_scatter", 128, 2, GLOO) + copies("reduce_scatter", 128, 2, None, 0))
    assert plan.cost == plan.costs[0] and plan.comm_bytes == 128
    assert str(step) == "reduce_scatter(axes 1, dim 0): [S0, R | P1] -> [S01, R]"
    # the naive plan (all_reduce, all_gather, slice, slice) costs more
    naive = naive_plan(src, dst, mesh)
    assert [s.kind for s in naive.steps] == ["all_reduce", "all_gather", "slice", "slice"]
    assert plan.cost < priced(naive, mesh).cost


def test_gloo_preset_sums_then_slices_rather_than_reduce_scatter():
    """gloo's reduce_scatter moves a byte several times slower than its all_reduce (the preset's
    collective factors), so on cpu-gloo the same request is an all_reduce and a free slice, priced
    with the factors, and the reduce_scatter would cost more."""
    cluster = PRESETS["cpu-gloo"]
    mesh = Mesh((2, 2))
    assert mesh.resolved_cluster() is cluster and cluster.collective_factor("reduce_scatter") != (1.0, 1.0)
    src, dst = spec("[S0, R | P1]", (64, 64), mesh), spec("[S01, R]", (64, 64), mesh)
    plan = run(src, dst, mesh)
    assert [s.kind for s in plan.steps] == ["all_reduce", "slice"]
    nbytes = 32 * 64 * 4

    def priced_as(kind):
        fa, fb = cluster.collective_factor(kind)
        return collective_time(kind, nbytes, 2, Link(GLOO.alpha * fa, GLOO.beta * fb)) + copies(kind, nbytes, 2, None, 0, cluster)

    assert plan.costs[0] == pytest.approx(priced_as("all_reduce"))
    assert plan.cost < priced_as("reduce_scatter")


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 4)])
def test_partial_to_replicated_is_one_all_reduce(mesh_shape):
    mesh = ring_mesh(mesh_shape)
    src = ShardingSpec((16,), ((),), (0,), mesh.ndim)  # [R | P0]
    dst = ShardingSpec((16,), ((),), (), mesh.ndim)  # [R]
    assert src.notation() == "[R | P0]" and dst.notation() == "[R]"
    plan = run(src, dst, mesh)
    step = only_step(plan)
    assert step.kind == "all_reduce" and step.axes == (0,)
    n = mesh_shape[0]
    assert step.nbytes == 64
    assert plan.costs[0] == pytest.approx(GLOO.alpha * (2 * n - 1) + GLOO.beta * 2 * (n - 1) / n * 64 + copies("all_reduce", 64, n))
    assert str(step) == "all_reduce(axes 0): [R | P0] -> [R]"


def test_shard_dim_change_is_one_all_to_all():
    mesh = ring_mesh((4,))
    src, dst = spec("[S0, R]", (8, 8), mesh), spec("[R, S0]", (8, 8), mesh)
    plan = run(src, dst, mesh)
    step = only_step(plan)
    assert step.kind == "all_to_all"
    assert step.axes == (0,) and step.src_dim == 0 and step.dst_dim == 1
    assert step.nbytes == 2 * 8 * 4  # the bytes each rank holds
    assert plan.costs[0] == pytest.approx(collective_time("all_to_all", 64, 4, GLOO) + copies("all_to_all", 64, 4, 0, 1))
    # cheaper than gathering (4x the bytes) and slicing
    assert plan.cost < priced(naive_plan(src, dst, mesh), mesh).cost
    assert str(step) == "all_to_all(axes 0, dim 0->1): [S0, R] -> [R, S0]"


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_replicated_to_shard_is_a_local_slice(mesh_shape):
    """No collective: the chunk is copied out (its bytes read and written), nothing more."""
    mesh = ring_mesh(mesh_shape)
    src = ShardingSpec.replicate((8, 4), mesh.ndim)
    dst = ShardingSpec((8, 4), ((0,), ()), (), mesh.ndim)
    plan = run(src, dst, mesh)
    step = only_step(plan)
    assert step.kind == "slice" and step.axes == (0,) and step.dst_dim == 0
    assert not step.is_comm and step.nbytes == 8 * 4 * 4  # its input
    n = mesh_shape[0]
    assert plan.costs[0] == pytest.approx(2 * (8 * 4 * 4 / n) / RING.sustained_memory_bandwidth + LOCAL_STEP_TIEBREAK_S)
    assert plan.costs[0] == pytest.approx(copies("slice", 8 * 4 * 4, n, dst_dim=0) + LOCAL_STEP_TIEBREAK_S)
    assert plan.comm_bytes == 0
    assert str(step).startswith("slice(axis 0, dim 0)")


@pytest.mark.parametrize(
    "text, shape, mesh_shape",
    [("[R]", (8,), (4,)), ("[S0, R | P1]", (8, 8), (2, 2)), ("[S10, R]", (8, 8), (2, 4)), ("[ | P012]", (), (2, 2, 2))],
)
def test_same_spec_is_an_empty_plan(text, shape, mesh_shape):
    mesh = ring_mesh(mesh_shape)
    s = spec(text, shape, mesh)
    plan = plan_reshard(s, s, mesh)
    assert plan.steps == () and plan.cost == 0 and plan.comm_bytes == 0
    assert plan.src == plan.dst == s
    assert "nothing to do" in str(plan)
    # the baseline route may leave and come back (a pending sum is resolved, then marked again);
    # replayed step by step it ends where it started
    back = s
    for step in naive_plan(s, s, mesh).steps:
        back = spec_after(back, step)
    assert back == s


def test_shape_mismatch_is_a_reshard_error():
    mesh = ring_mesh((2,))
    with pytest.raises(ReshardError) as e:
        plan_reshard(spec("[S0]", (8,), mesh), spec("[S0]", (16,), mesh), mesh)
    assert "(8,)" in str(e.value) and "(16,)" in str(e.value)
    with pytest.raises(ReshardError):
        plan_reshard(spec("[R, R]", (4, 4), mesh), spec("[R]", (16,), mesh), mesh)


@pytest.mark.parametrize("which", ["source", "target"])
def test_uneven_spec_is_a_sharding_error(which):
    mesh = ring_mesh((4,))
    even, uneven = spec("[R, R]", (6, 8), mesh), spec("[S0, R]", (6, 8), mesh)
    src, dst = (uneven, even) if which == "source" else (even, uneven)
    with pytest.raises(ShardingError) as e:
        plan_reshard(src, dst, mesh)
    assert "dim 0 of size 6 over 4 ranks" in str(e.value)


def test_spec_for_another_mesh_is_a_sharding_error():
    mesh = ring_mesh((2, 2))
    one_axis = ShardingSpec.parse("[S0]", (8,), 1)
    with pytest.raises(ShardingError, match="1-axis mesh"):
        plan_reshard(one_axis, ShardingSpec.replicate((8,), 2), mesh)


# ---- more hand-checked plans -------------------------------------------------------------------------
def test_gather_only_the_trailing_axis():
    mesh = ring_mesh((2, 2))
    plan = run(spec("[S01, R]", (8, 8), mesh), spec("[S0, R]", (8, 8), mesh), mesh)
    step = only_step(plan)
    assert step.kind == "all_gather" and step.axes == (1,) and step.src_dim == 0
    assert step.nbytes == 4 * 8 * 4  # the bytes each rank ends with


def test_multi_axis_all_to_all():
    mesh = ring_mesh((2, 2))
    plan = run(spec("[S01, R]", (8, 8), mesh), spec("[R, S01]", (8, 8), mesh), mesh)
    step = only_step(plan)
    assert step.kind == "all_to_all" and step.axes == (0, 1) and (step.src_dim, step.dst_dim) == (0, 1)


def test_partial_over_two_axes_scatter_in_either_order():
    mesh = ring_mesh((2, 2))
    for target, axes in (("[S01, R]", (0, 1)), ("[S10, R]", (1, 0))):
        plan = run(spec("[R, R | P01]", (8, 8), mesh), spec(target, (8, 8), mesh), mesh)
        step = only_step(plan)
        assert step.kind == "reduce_scatter" and step.axes == axes and step.dst_dim == 0


def test_partial_to_partial_reduces_only_the_dropped_axis():
    mesh = ring_mesh((2, 2))
    plan = run(spec("[R, R | P01]", (8, 8), mesh), spec("[R, R | P0]", (8, 8), mesh), mesh)
    step = only_step(plan)
    assert step.kind == "all_reduce" and step.axes == (1,)


def test_replicated_to_partial_is_free():
    mesh = ring_mesh((2, 2))
    plan = run(spec("[R, R]", (8, 8), mesh), spec("[R, R | P1]", (8, 8), mesh), mesh)
    step = only_step(plan)
    assert step.kind == "to_partial" and step.axes == (1,) and plan.costs == (LOCAL_STEP_TIEBREAK_S,)


def test_swapping_split_order_goes_through_a_gather():
    # no step permutes shards between ranks, so [S01] -> [S10] gathers and re-slices
    mesh = ring_mesh((2, 2))
    plan = run(spec("[S01, R]", (8, 8), mesh), spec("[S10, R]", (8, 8), mesh), mesh)
    assert [s.kind for s in plan.steps][-2:] == ["slice", "slice"]
    assert plan.cost <= priced(naive_plan(plan.src, plan.dst, mesh), mesh).cost


def test_plan_prefers_the_fast_axis():
    # [R | P01] on a100 (16, 8): reduce-scattering over the fast intra-node axis 1 first leaves the
    # slow inter-node axis 0 8x fewer bytes, so [S10] is cheaper to reach than [S01].
    mesh = Mesh((16, 8), cluster="a100-80g")
    shape = (1 << 16,)
    src = ShardingSpec(shape, ((),), (0, 1), 2)
    plan = plan_reshard(src, ShardingSpec(shape, ((1, 0),), (), 2), mesh)
    other = plan_reshard(src, ShardingSpec(shape, ((0, 1),), (), 2), mesh)
    assert [(s.kind, s.axes) for s in plan.steps] == [("reduce_scatter", (1,)), ("reduce_scatter", (0,))]
    assert [(s.kind, s.axes) for s in other.steps] == [("reduce_scatter", (0,)), ("reduce_scatter", (1,))]
    assert plan.cost < other.cost


def test_hierarchical_all_reduce():
    # [R | P01] -> [R] on a100 (16, 8): reduce-scatter inside the node, all-reduce across nodes on
    # 1/8 of the bytes, all-gather inside the node; cheaper than one flat all_reduce over 128 ranks.
    mesh = Mesh((16, 8), cluster="a100-80g")
    shape = (1 << 16,)
    src = ShardingSpec(shape, ((),), (0, 1), 2)
    dst = ShardingSpec.replicate(shape, 2)
    plan = plan_reshard(src, dst, mesh)
    assert [(s.kind, s.axes) for s in plan.steps] == [("reduce_scatter", (1,)), ("all_reduce", (0,)), ("all_gather", (1,))]
    flat = (collective_time("all_reduce", 4 * (1 << 16), 128, PRESETS["a100-80g"].inter_node)
            + copies("all_reduce", 4 * (1 << 16), 128, cluster=PRESETS["a100-80g"]))
    assert plan.cost < flat
    assert priced(naive_plan(src, dst, mesh), mesh).cost == pytest.approx(flat)


def test_itemsize_scales_bytes_and_is_part_of_the_cache_key():
    mesh = ring_mesh((4,))
    src, dst = spec("[S0]", (64,), mesh), spec("[R]", (64,), mesh)
    p4 = plan_reshard(src, dst, mesh, 4)
    p2 = plan_reshard(src, dst, mesh, 2)
    assert p4 is plan_reshard(src, dst, mesh, 4)
    assert p2 is not p4
    assert p4.comm_bytes == 2 * p2.comm_bytes == 256
    assert p4.cost > p2.cost


def test_cluster_is_part_of_the_cache_key():
    src_mesh, fast_mesh = ring_mesh((4,)), Mesh((4,), cluster=PRESETS["cpu-gloo"].with_axis_links([Link(0.0, 0.0)]))
    src, dst = spec("[S0]", (64,), src_mesh), spec("[R]", (64,), src_mesh)
    assert plan_reshard(src, dst, fast_mesh).cost == 0
    assert plan_reshard(src, dst, src_mesh).cost > 0


def test_infeasible_transitions_cost_inf():
    import math

    mesh = ring_mesh((4,))
    src = ShardingSpec.parse("[S0, R]", (8, 6), 1)
    uneven = ShardingSpec.parse("[R, S0]", (8, 6), 1)  # 6 does not split over 4
    other_shape = ShardingSpec.parse("[S0, R]", (8, 8), 1)
    assert reshard_cost(src, uneven, mesh) == math.inf
    assert reshard_cost(src, other_shape, mesh) == math.inf
    assert reshard_costs_from(uneven, [src], mesh) == [math.inf]
    assert math.isfinite(reshard_cost(src, ShardingSpec.parse("[R, R]", (8, 6), 1), mesh))
