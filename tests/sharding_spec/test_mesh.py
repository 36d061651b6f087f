"""The device mesh: coordinates, groups, identity, errors, links per axis, serialisation."""
import dataclasses
import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cluster import PRESETS, Link
from autopar.errors import ConfigError, MeshError
from autopar.sharding_spec import Mesh

SETTINGS = settings(deadline=None, max_examples=100, derandomize=True)
mesh_shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


# ---- coordinates ----------------------------------------------------------------------------------
@SETTINGS
@given(mesh_shapes)
def test_rank_coordinate_round_trip(shape):
    mesh = Mesh(shape)
    assert mesh.size == math.prod(shape) == len(mesh)
    seen = []
    for r in range(mesh.size):
        c = mesh.coordinate(r)
        assert len(c) == mesh.ndim and all(0 <= x < s for x, s in zip(c, shape))
        assert mesh.rank(c) == r
        seen.append(c)
    # row-major: ranks enumerate coordinates in lexicographic order (last axis fastest)
    assert seen == list(itertools.product(*(range(s) for s in shape)))


def test_row_major_last_axis_fastest():
    mesh = Mesh((2, 3))
    assert [mesh.coordinate(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert mesh.rank((1, 2)) == 5
    assert Mesh(4).shape == (4,)


@pytest.mark.parametrize("bad", [-1, 6, 100])
def test_coordinate_out_of_range(bad):
    with pytest.raises(MeshError, match=f"rank {bad}"):
        Mesh((2, 3)).coordinate(bad)


@pytest.mark.parametrize("coord", [(2, 0), (0, 3), (0,), (0, 0, 0), (-1, 0)])
def test_rank_of_bad_coordinate(coord):
    with pytest.raises(MeshError, match="outside mesh shape"):
        Mesh((2, 3)).rank(coord)


# ---- groups ---------------------------------------------------------------------------------------
def test_groups_per_axis():
    mesh = Mesh((2, 4))
    assert mesh.groups(1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.groups(0) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups((0,)) == mesh.groups(0)
    assert mesh.group_of(6, 0) == [2, 6]
    assert mesh.group_of(6, 1) == [4, 5, 6, 7]


def test_multi_axis_groups_first_axis_most_significant():
    mesh = Mesh((2, 3))
    assert mesh.groups((0, 1)) == [[0, 1, 2, 3, 4, 5]]
    assert mesh.groups((1, 0)) == [[0, 3, 1, 4, 2, 5]]
    m3 = Mesh((2, 2, 2))
    assert m3.groups((0, 2)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert m3.groups((2, 0)) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert m3.groups(()) == [[r] for r in range(8)]


@SETTINGS
@given(mesh_shapes.filter(lambda s: len(s) >= 1), st.data())
def test_groups_partition_and_index_in(shape, data):
    mesh = Mesh(shape)
    k = data.draw(st.integers(1, mesh.ndim))
    axes = tuple(data.draw(st.permutations(range(mesh.ndim)))[:k])
    groups = mesh.groups(axes)
    n = mesh.axes_size(axes)
    assert len(groups) == mesh.size // n
    assert sorted(r for g in groups for r in g) == list(range(mesh.size))
    for g in groups:
        assert len(g) == n
        coords = [mesh.coordinate(r) for r in g]
        others = [a for a in range(mesh.ndim) if a not in axes]
        # members differ only in ``axes``
        assert len({tuple(c[a] for a in others) for c in coords}) == 1
        # position in the group = index_in, first axis most significant
        for i, r in enumerate(g):
            assert mesh.index_in(r, axes) == i
            assert mesh.group_of(r, axes) == g
            idx = 0
            for a in axes:
                idx = idx * shape[a] + mesh.coordinate(r)[a]
            assert idx == i


def test_groups_bad_axes():
    mesh = Mesh((2, 2))
    with pytest.raises(MeshError, match="repeat"):
        mesh.groups((0, 0))
    with pytest.raises(MeshError, match="axis 2"):
        mesh.groups(2)
    with pytest.raises(MeshError, match="no axis named"):
        mesh.groups("zz")


# ---- identity -----------------------------------------------------------------------------------------
def test_hashable_and_immutable():
    a = Mesh((2, 4), axis_names=("dp", "tp"))
    b = Mesh([2, 4], axis_names=["dp", "tp"])
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert Mesh((2, 4)) != a  # other names
    assert Mesh((4, 2), axis_names=("dp", "tp")) != a
    assert Mesh((2, 4), ("dp", "tp"), cluster="a100-80g") != a
    c = Mesh((2, 4), ("dp", "tp"), cluster="a100-80g")
    assert c == Mesh((2, 4), ("dp", "tp"), cluster="a100-80g") and hash(c) == hash(Mesh((2, 4), ("dp", "tp"), cluster="a100-80g"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.shape = (8,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.axis_names = ("x", "y")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.cluster = None


def test_axis_names():
    m = Mesh((2, 4), axis_names=("dp", "tp"))
    assert m.axis_names == ("dp", "tp")
    assert m.axis("dp") == 0 and m.axis("tp") == 1 and m.axis(1) == 1
    assert Mesh((2, 2, 2)).axis_names == ("a0", "a1", "a2")
    assert str(m) == "Mesh(dp=2, tp=4)"
    assert m.ndim == 2 and m.size == 8
    with pytest.raises(MeshError, match="no axis named 'pp'"):
        m.axis("pp")
    with pytest.raises(MeshError, match="axes 0..1"):
        m.axis(2)
    with pytest.raises(MeshError):
        m.axis(-1)
    # groups accept axis names as well as indices
    assert m.groups("tp") == m.groups(1)
    assert m.groups(("tp", "dp")) == m.groups((1, 0))
    assert m.group_of(5, "dp") == [1, 5]


# ---- bad meshes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0,), (2, 0), (-1, 2), 0])
def test_bad_sizes(shape):
    with pytest.raises(MeshError, match="size >= 1"):
        Mesh(shape)


@pytest.mark.parametrize("shape", [(), (1, 1, 1, 1, 1), (2, 2, 2, 2, 2)])
def test_bad_number_of_axes(shape):
    with pytest.raises(MeshError, match="1 to 4 axes"):
        Mesh(shape)


@pytest.mark.parametrize("shape", ["ab", None, (1.5, "x"), object()])
def test_bad_shape_type(shape):
    with pytest.raises(MeshError):
        Mesh(shape)


def test_names_mismatch_and_duplicates():
    with pytest.raises(MeshError, match="2 axes but 1 axis names"):
        Mesh((2, 2), axis_names=("dp",))
    with pytest.raises(MeshError, match="2 axes but 3 axis names"):
        Mesh((2, 2), axis_names=("a", "b", "c"))
    with pytest.raises(MeshError, match="distinct"):
        Mesh((2, 2), axis_names=("dp", "dp"))


def test_four_axes_allowed():
    assert Mesh((1, 2, 1, 2)).size == 4


def test_check_world_size():
    m = Mesh((2, 4))
    m.check_world_size(8)
    with pytest.raises(MeshError) as e:
        m.check_world_size(6)
    msg = str(e.value)
    assert "8 ranks" in msg and "has 6" in msg
    assert "2 x 4" in msg


# ---- links --------------------------------------------------------------------------------------------
def test_links_a100_16x8():
    m = Mesh((16, 8), cluster="a100-80g")
    links = m.links()
    a100 = PRESETS["a100-80g"]
    assert links == (a100.inter_node, a100.intra_node)  # axis 1 inside a node, axis 0 across
    assert links[1].bandwidth > links[0].bandwidth


def test_links_node_rule():
    a100 = PRESETS["a100-80g"]
    intra, inter = a100.intra_node, a100.inter_node
    assert Mesh((2, 4), cluster="a100-80g").links() == (intra, intra)
    assert Mesh((2, 2, 2), cluster="a100-80g").links() == (intra, intra, intra)
    assert Mesh((4, 4), cluster="a100-80g").links() == (inter, intra)
    assert Mesh((2, 2, 4), cluster="a100-80g").links() == (inter, intra, intra)
    assert Mesh((16,), cluster="a100-80g").links() == (inter,)
    assert Mesh((8,), cluster="a100-80g").links() == (intra,)
    # the last axis is the fastest: moving along the axes never gets slower
    for shape in [(16, 8), (2, 2, 4), (4, 4), (128, 8)]:
        bws = [l.bandwidth for l in Mesh(shape, cluster="a100-80g").links()]
        assert bws == sorted(bws)


def test_links_default_cluster_is_cpu_gloo():
    m = Mesh((2, 2))
    assert m.cluster is None
    assert m.resolved_cluster() == PRESETS["cpu-gloo"]
    assert m.links() == (PRESETS["cpu-gloo"].intra_node,) * 2


def test_explicit_axis_links_override():
    slow, fast = Link(alpha=1e-3, beta=1e-6), Link(alpha=1e-6, beta=1e-12)
    cl = PRESETS["a100-80g"].with_axis_links([fast, slow])  # reversed from the node rule
    m = Mesh((16, 8), cluster=cl)
    assert m.links() == (fast, slow)
    assert Mesh((2, 2), cluster=cl).links() == (fast, slow)


def test_axis_links_length_mismatch():
    cl = PRESETS["a100-80g"].with_axis_links([Link(1e-6, 1e-9)] * 3)
    with pytest.raises(ConfigError) as e:
        Mesh((2, 4), cluster=cl)
    assert "3 axis_links" in str(e.value) and "2 axes" in str(e.value)
    with pytest.raises(ConfigError):
        cl.links_for((2, 4))


def test_with_cluster():
    m = Mesh((2, 4), ("dp", "tp"))
    h = m.with_cluster("h100-80g")
    assert h.cluster == PRESETS["h100-80g"] and h.shape == m.shape and h.axis_names == m.axis_names
    assert m.cluster is None  # unchanged


# ---- serialisation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mesh",
    [
        Mesh((2, 4), ("dp", "tp")),
        Mesh((3,)),
        Mesh((16, 8), cluster="a100-80g"),
        Mesh((2, 2, 2), ("pp", "dp", "tp"), cluster="h100-80g"),
        Mesh((2, 2), cluster="cpu-gloo"),
        Mesh((2, 2), cluster=PRESETS["a100-80g"].with_axis_links([Link(1e-5, 1e-9), Link(2e-6, 1e-11)])),
    ],
    ids=str,
)
def test_dict_round_trip(mesh):
    d = mesh.to_dict()
    back = Mesh.from_dict(d)
    assert back == mesh and hash(back) == hash(mesh)
    # and through JSON text
    back2 = Mesh.from_dict(json.loads(json.dumps(d)))
    assert back2 == mesh and hash(back2) == hash(mesh)
    assert back2.links() == mesh.links()
