"""The alpha-beta collective prices (relations, not magic numbers) and cluster presets/resolution."""
import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cluster import PRESETS, ClusterSpec, Link, resolve_cluster
from autopar.cost_model import collective_time, mesh_collective_time
from autopar.cost_model.comm import COLLECTIVES, group_link, latency_hops, volume_factor
from autopar.errors import ConfigError
from autopar.sharding_spec import Mesh

SETTINGS = settings(deadline=None, max_examples=150, derandomize=True)

links = st.builds(
    Link,
    alpha=st.floats(1e-7, 1e-3, allow_nan=False, allow_infinity=False),
    beta=st.floats(1e-13, 1e-8, allow_nan=False, allow_infinity=False),
)
kinds = st.sampled_from(COLLECTIVES)
sizes = st.floats(0, 1e10, allow_nan=False, allow_infinity=False)
group_sizes = st.integers(2, 1024)


# ---- formulas ------------------------------------------------------------------------------------
def test_formulas_by_hand():
    link = Link(alpha=1e-5, beta=1e-9)
    B, n = 1e6, 4
    assert collective_time("all_gather", B, n, link) == pytest.approx(1e-5 * 4 + 1e-9 * 0.75 * B)
    assert collective_time("reduce_scatter", B, n, link) == pytest.approx(1e-5 * 4 + 1e-9 * 0.75 * B)
    assert collective_time("all_to_all", B, n, link) == pytest.approx(1e-5 * 4 + 1e-9 * 0.75 * B)
    assert collective_time("all_reduce", B, n, link) == pytest.approx(1e-5 * 7 + 1e-9 * 1.5 * B)
    assert latency_hops("all_reduce", 4) == 7 and latency_hops("all_gather", 4) == 4
    assert volume_factor("all_reduce", 4) == 1.5 and volume_factor("all_to_all", 4) == 0.75


@SETTINGS
@given(kinds, sizes, sizes, group_sizes, links)
def test_cost_grows_with_bytes(kind, b1, b2, n, link):
    lo, hi = sorted((b1, b2))
    assert collective_time(kind, lo, n, link) <= collective_time(kind, hi, n, link)
    if hi > lo * (1 + 1e-9) + 1:
        assert collective_time(kind, lo, n, link) < collective_time(kind, hi, n, link)


@SETTINGS
@given(kinds, sizes, group_sizes, links)
def test_cost_grows_with_group_size(kind, b, n, link):
    assert collective_time(kind, b, n, link) < collective_time(kind, b, n + 1, link)


@SETTINGS
@given(sizes, group_sizes, links)
def test_all_reduce_beats_reduce_scatter_plus_all_gather(b, n, link):
    ar = collective_time("all_reduce", b, n, link)
    rs_ag = collective_time("reduce_scatter", b, n, link) + collective_time("all_gather", b, n, link)
    assert ar < rs_ag
    assert rs_ag - ar == pytest.approx(link.alpha, rel=1e-6, abs=1e-15)  # the one saved set-up


@SETTINGS
@given(kinds, sizes, links)
def test_one_rank_costs_nothing(kind, b, link):
    assert collective_time(kind, b, 1, link) == 0.0


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_one_rank_axis_on_a_mesh_costs_nothing(kind):
    mesh = Mesh((1, 8), cluster="a100-80g")
    assert mesh_collective_time(kind, 1e9, mesh, (0,)) == 0.0
    assert mesh_collective_time(kind, 1e9, mesh, (1,)) > 0.0


def test_zero_bytes_costs_latency_only():
    link = Link(alpha=1e-5, beta=1e-9)
    assert collective_time("all_gather", 0, 8, link) == pytest.approx(8e-5)


def test_bad_arguments():
    link = Link(1e-5, 1e-9)
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcast", 10, 4, link)
    with pytest.raises(ValueError, match=">= 0"):
        collective_time("all_gather", -1, 4, link)
    with pytest.raises(ValueError):
        group_link([])
    with pytest.raises(ConfigError):
        Link(-1.0, 0.0)
    with pytest.raises(ConfigError):
        Link(0.0, math.inf)
    with pytest.raises(ConfigError):
        Link(math.nan, 0.0)
    assert Link(0.0, 0.0).bandwidth == math.inf
    assert Link(0.0, 1e-9).bandwidth == pytest.approx(1e9)


# ---- mesh groups --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("nbytes", [1e3, 1e6, 1e9])
def test_group_over_slow_and_fast_axis_priced_at_slow_link(kind, nbytes):
    mesh = Mesh((16, 8), cluster="a100-80g")
    a100 = PRESETS["a100-80g"]
    both = mesh_collective_time(kind, nbytes, mesh, (0, 1))
    assert both == pytest.approx(collective_time(kind, nbytes, 128, a100.inter_node))
    assert mesh_collective_time(kind, nbytes, mesh, (1, 0)) == both
    # slower than the same group size priced on the fast link
    assert both > collective_time(kind, nbytes, 128, a100.intra_node)
    # the fast axis alone is cheaper than the slow axis alone, even with a bigger group
    assert mesh_collective_time(kind, nbytes, Mesh((8, 8), cluster="a100-80g"), (1,)) < mesh_collective_time(kind, nbytes, mesh, (0,))


def test_group_link_takes_worst_alpha_and_beta_separately():
    a = Link(alpha=1e-6, beta=1e-9)
    b = Link(alpha=1e-5, beta=1e-11)
    assert group_link([a, b]) == Link(alpha=1e-5, beta=1e-9)
    assert group_link([a]) == a


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("nbytes", [0, 1e3, 1e8])
def test_axis_with_100x_alpha_beta_is_100x_slower(kind, nbytes):
    fast = Link(alpha=2e-6, beta=1e-10)
    slow = Link(alpha=2e-4, beta=1e-8)
    cl = PRESETS["a100-80g"].with_axis_links([slow, fast])
    mesh = Mesh((4, 4), cluster=cl)
    t_fast = mesh_collective_time(kind, nbytes, mesh, (1,))
    t_slow = mesh_collective_time(kind, nbytes, mesh, (0,))
    assert t_fast > 0
    assert t_slow == pytest.approx(100 * t_fast, rel=1e-9)


@SETTINGS
@given(kinds, sizes, st.integers(2, 64), links, st.floats(1.0, 1e4))
def test_cost_scales_linearly_with_the_link(kind, b, n, link, k):
    scaled = Link(alpha=link.alpha * k, beta=link.beta * k)
    assert collective_time(kind, b, n, scaled) == pytest.approx(k * collective_time(kind, b, n, link), rel=1e-9)


def test_mesh_default_cluster_prices_on_cpu_gloo():
    """A mesh without a cluster prices on the cpu-gloo preset: its link, times gloo's factor for the kind."""
    mesh = Mesh((2, 2))
    gloo = PRESETS["cpu-gloo"]
    for kind in COLLECTIVES:
        fa, fb = gloo.collective_factor(kind)
        link = Link(gloo.intra_node.alpha * fa, gloo.intra_node.beta * fb)
        assert mesh_collective_time(kind, 1e6, mesh, (0,)) == pytest.approx(collective_time(kind, 1e6, 2, link))


# ---- presets and resolution ----------------------------------------------------------------------------
def test_presets_load():
    assert {"a100-80g", "h100-80g", "cpu-gloo"} <= set(PRESETS)
    for name, cl in PRESETS.items():
        assert isinstance(cl, ClusterSpec) and cl.name == name
        assert cl.flops("float32") > 0 and cl.memory_bytes > 0 and cl.memory_bandwidth > 0
        assert cl.devices_per_node >= 1 and cl.source
        assert cl.intra_node.bandwidth >= cl.inter_node.bandwidth
        hash(cl)
    a100, h100 = PRESETS["a100-80g"], PRESETS["h100-80g"]
    # the datasheet peaks, sustained at compute_efficiency (large GEMMs reach about 3/4 of peak)
    assert dict(a100.peak_flops)["bfloat16"] == 312e12 and a100.compute_efficiency == 0.75
    assert a100.flops("bfloat16") == 312e12 * 0.75 and a100.flops("float32") == 19.5e12 * 0.75
    assert ClusterSpec.from_dict(a100.to_dict()) == a100
    with pytest.raises(ConfigError, match="compute_efficiency"):
        dataclasses.replace(a100, compute_efficiency=1.5)
    # memory-bound kernels at 89% of HBM, links at NCCL's achieved bus bandwidth (cluster.py cites both)
    assert a100.memory_efficiency == h100.memory_efficiency == 0.89
    assert a100.sustained_memory_bandwidth == pytest.approx(2.039e12 * 0.89)
    assert a100.intra_node.bandwidth == pytest.approx(230e9) and a100.inter_node.bandwidth == pytest.approx(23e9)
    assert a100.optimizer_s_per_element == pytest.approx(28 / (2.039e12 * 0.89))
    for bad in (0.0, 1.2):
        with pytest.raises(ConfigError, match="memory_efficiency"):
            dataclasses.replace(a100, memory_efficiency=bad)
    assert PRESETS["cpu-gloo"].memory_efficiency == 1.0
    assert a100.flops("float8") == a100.flops("float32")  # unknown dtypes fall back to float32
    assert h100.flops("bfloat16") > a100.flops("bfloat16")
    assert h100.intra_node.bandwidth > a100.intra_node.bandwidth
    assert a100.devices_per_node == 8


def test_resolve_by_name_and_none_and_spec():
    for name in PRESETS:
        assert resolve_cluster(name) is PRESETS[name]
    assert resolve_cluster(None) is PRESETS["cpu-gloo"]
    cl = PRESETS["h100-80g"]
    assert resolve_cluster(cl) is cl


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_resolve_by_dict(name):
    d = PRESETS[name].to_dict()
    assert resolve_cluster(d) == PRESETS[name]
    assert hash(resolve_cluster(d)) == hash(PRESETS[name])
    d2 = dict(d, name="custom", devices_per_node=4)
    cl = resolve_cluster(d2)
    assert cl.name == "custom" and cl.devices_per_node == 4
    assert cl.links_for((2, 4)) == (cl.inter_node, cl.intra_node)


def test_resolve_by_json_file(tmp_path):
    d = PRESETS["a100-80g"].to_dict()
    d["name"] = "mycluster"
    d["intra_node"] = {"alpha": 1e-6, "beta": 1e-12}
    f = tmp_path / "cluster.json"
    f.write_text(json.dumps(d))
    for arg in (f, str(f)):
        cl = resolve_cluster(arg)
        assert cl.name == "mycluster"
        assert cl.intra_node == Link(1e-6, 1e-12)
        assert cl.inter_node == PRESETS["a100-80g"].inter_node
    # a file without a name is named after its path
    del d["name"]
    g = tmp_path / "noname.json"
    g.write_text(json.dumps(d))
    assert resolve_cluster(g).name == str(g)
    # a mesh takes the file too
    assert Mesh((2, 8), cluster=str(f)).links() == (PRESETS["a100-80g"].inter_node, Link(1e-6, 1e-12))


def test_resolve_json_with_axis_links(tmp_path):
    d = PRESETS["cpu-gloo"].to_dict()
    d["axis_links"] = [{"alpha": 1e-3, "beta": 1e-6}, {"alpha": 1e-6, "beta": 1e-9}]
    f = tmp_path / "c.json"
    f.write_text(json.dumps(d))
    cl = resolve_cluster(f)
    assert cl.links_for((4, 4)) == (Link(1e-3, 1e-6), Link(1e-6, 1e-9))
    assert ClusterSpec.from_dict(cl.to_dict()) == cl


def test_bad_name_lists_presets():
    with pytest.raises(ConfigError) as e:
        resolve_cluster("tpu-v9")
    msg = str(e.value)
    assert "tpu-v9" in msg
    for name in PRESETS:
        assert name in msg
    with pytest.raises(ConfigError) as e:
        Mesh((2, 2), cluster="nope")
    assert "a100-80g" in str(e.value)


def test_bad_files_and_dicts(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as e:
        resolve_cluster(tmp_path / "missing.json")
    assert "a100-80g" in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve_cluster(bad)
    incomplete = tmp_path / "incomplete.json"
    incomplete.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError, match="needs name, peak_flops"):
        resolve_cluster(incomplete)
    with pytest.raises(ConfigError):
        resolve_cluster({"name": "x", "peak_flops": {"float32": 1e12}})
    d = PRESETS["a100-80g"].to_dict()
    with pytest.raises(ConfigError, match="devices_per_node"):
        resolve_cluster(dict(d, devices_per_node=0))
    with pytest.raises(ConfigError, match="peak_flops"):
        resolve_cluster(dict(d, peak_flops={"float32": -1.0}))
    with pytest.raises(ConfigError, match="alpha"):
        resolve_cluster(dict(d, intra_node={"alpha": -1, "beta": 0}))
    with pytest.raises(ConfigError, match="preset name"):
        resolve_cluster(42)


def test_cluster_round_trip_is_equal_and_hash_equal():
    # the dict form orders peak_flops canonically; equality must not depend on that order
    for cl in PRESETS.values():
        back = ClusterSpec.from_dict(json.loads(json.dumps(cl.to_dict())))
        assert back == cl and hash(back) == hash(cl)
    a = ClusterSpec("x", (("float32", 1.0), ("bfloat16", 2.0)), 1.0, 1, 1, Link(0, 0), Link(0, 0))
    b = ClusterSpec("x", (("bfloat16", 2.0), ("float32", 1.0)), 1.0, 1, 1, Link(0, 0), Link(0, 0))
    assert a == b and hash(a) == hash(b)


def test_an_all_reduce_of_one_value_pays_the_clusters_scalar_alphas():
    # gloo runs no ring for one value (a loss, a count): a cluster that measured it prices such an
    # all_reduce at its own alphas; anything bigger, or a share of a bucket, pays the ring's 2n - 1
    link = Link(alpha=1e-3, beta=1e-9)
    ring = dataclasses.replace(PRESETS["cpu-gloo"], collective_factors=(), collective_overhead_s=0.0,
                               scalar_all_reduce_alphas=None).with_axis_links([link])
    gloo = dataclasses.replace(ring, scalar_all_reduce_alphas=1.5)
    r, g = Mesh((4,), cluster=ring), Mesh((4,), cluster=gloo)
    assert mesh_collective_time("all_reduce", 4, r, (0,)) == pytest.approx(7 * 1e-3 + 1.5 * 4 * 1e-9)
    assert mesh_collective_time("all_reduce", 4, g, (0,)) == pytest.approx(1.5 * 1e-3 + 1.5 * 4 * 1e-9)
    assert mesh_collective_time("all_reduce", 8, g, (0,)) < mesh_collective_time("all_reduce", 8, r, (0,))
    for nbytes in (16, 1 << 20):  # more values than one
        assert mesh_collective_time("all_reduce", nbytes, g, (0,)) == mesh_collective_time("all_reduce", nbytes, r, (0,))
    assert mesh_collective_time("all_reduce", 4, g, (0,), alone=False) == mesh_collective_time("all_reduce", 4, r, (0,))
    assert mesh_collective_time("all_gather", 4, g, (0,)) == mesh_collective_time("all_gather", 4, r, (0,))
    # never above the ring's price: 2 ranks pay min(3, alphas)
    two = Mesh((2,), cluster=dataclasses.replace(gloo, scalar_all_reduce_alphas=5.0))
    assert mesh_collective_time("all_reduce", 4, two, (0,)) == pytest.approx(3 * 1e-3 + 4 * 1e-9)
    assert ClusterSpec.from_dict(json.loads(json.dumps(gloo.to_dict()))) == gloo
    assert PRESETS["cpu-gloo"].scalar_all_reduce_alphas is not None
    assert all(PRESETS[k].scalar_all_reduce_alphas is None for k in PRESETS if k != "cpu-gloo")  # NCCL: its ring
    with pytest.raises(ConfigError, match="scalar_all_reduce_alphas"):
        dataclasses.replace(gloo, scalar_all_reduce_alphas=0.0)


def test_layout_copies_follow_what_the_collectives_copy():
    """Copies around the wire (codegen.collectives): a gather of the leading dim lands in place; of
    another dim it moves its input in front and the result back; a reduce-scatter packs its input
    (gloo may reduce into it); an all-to-all moves whichever side is not the leading dim; an
    all-reduce sums a copy. Priced at the cluster's sustained bandwidth, read and write."""
    from autopar.cost_model.comm import layout_copy_bytes, layout_copy_time

    b, n = 4096.0, 4
    assert layout_copy_bytes("all_gather", b, n, src_dim=0) == 0
    assert layout_copy_bytes("all_gather", b, n, src_dim=2) == b / n + b
    assert layout_copy_bytes("reduce_scatter", b, n, dst_dim=0) == b
    assert layout_copy_bytes("reduce_scatter", b, n, dst_dim=1) == b + b / n
    assert layout_copy_bytes("all_to_all", b, n, src_dim=0, dst_dim=0) == 0
    assert layout_copy_bytes("all_to_all", b, n, src_dim=0, dst_dim=1) == b
    assert layout_copy_bytes("all_to_all", b, n, src_dim=1, dst_dim=2) == 2 * b
    assert layout_copy_bytes("all_reduce", b, n) == b
    assert layout_copy_bytes("all_gather", b, 1, src_dim=2) == 0  # a group of one runs nothing
    cluster = PRESETS["cpu-gloo"]
    assert layout_copy_time(b, cluster) == pytest.approx(2 * b / cluster.sustained_memory_bandwidth)
    assert layout_copy_time(0, cluster) == 0


def test_a_slice_copies_its_chunk_and_its_backward_pads_a_new_gradient():
    """codegen.collectives.Slice: forward makes its chunk contiguous; backward writes zeros of the
    input's size into a new tensor (at the fresh-page rate where measured) and copies the chunk in."""
    from autopar.cost_model.comm import layout_copy_bytes, layout_copy_time, slice_backward_time

    b, n = 4096.0, 4
    assert layout_copy_bytes("slice", b, n, dst_dim=1) == b / n
    assert layout_copy_bytes("slice", b, 1, dst_dim=1) == 0
    warm = PRESETS["cpu-gloo"]
    assert warm.fresh_write_bandwidth == warm.sustained_memory_bandwidth  # not measured: a warm write
    assert slice_backward_time(b, n, warm) == pytest.approx((b + 2 * b / n) / warm.sustained_memory_bandwidth)
    fresh = dataclasses.replace(warm, fresh_memory_bandwidth=warm.sustained_memory_bandwidth / 3)
    assert slice_backward_time(b, n, fresh) == pytest.approx(
        3 * b / warm.sustained_memory_bandwidth + layout_copy_time(b / n, warm))
    assert slice_backward_time(b, 1, fresh) == 0
    with pytest.raises(ConfigError, match="overheads must be finite"):
        dataclasses.replace(warm, fresh_memory_bandwidth=-1.0)


def test_a_sliced_read_pays_its_padded_gradient_in_backward():
    """The step model's backward of an edge that slices a replicated value (a parameter read split,
    as a tied embedding's lookup may read it): the gradient padded back to the whole tensor, not the
    forward's copy again; under whole gradients on the axis, an all-gather of the whole tensor."""
    from autopar.cost_model.comm import slice_backward_time
    from autopar.cost_model.gradients import backward_reshard_s
    from autopar.sharding_spec import ShardingSpec
    from autopar.solver.plan import EdgePlan, StepPlan
    from autopar.solver.reshard_search import plan_reshard

    cluster = dataclasses.replace(PRESETS["cpu-gloo"], fresh_memory_bandwidth=3e9)
    mesh = Mesh((4,), cluster=cluster)
    src = ShardingSpec.replicate((1024, 256), 1)
    dst = ShardingSpec((1024, 256), ((), (0,)), (), 1)
    route = plan_reshard(src, dst, mesh)
    (step,) = route.steps
    assert step.kind == "slice" and step.nbytes == 1024 * 256 * 4
    steps = [StepPlan(step.kind, step.axes, step.nbytes, route.costs[0], step.src_dim, step.dst_dim)]
    edge = EdgePlan("w", "lookup", 0, src, dst, steps, backward=True)
    assert backward_reshard_s(edge, mesh, identical=()) == pytest.approx(slice_backward_time(step.nbytes, 4, cluster))
    assert backward_reshard_s(edge, mesh, identical=(0,)) == pytest.approx(
        mesh_collective_time("all_gather", step.nbytes, mesh, (0,)))
    assert backward_reshard_s(dataclasses.replace(edge, backward=False), mesh, identical=()) == 0
