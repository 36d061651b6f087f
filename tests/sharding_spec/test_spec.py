"""Placements, ShardingSpec notation (both forms), local shards, and the errors a bad spec raises."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import ShardingError
from autopar.sharding_spec import Mesh, Partial, Replicate, Shard, ShardingSpec

SETTINGS = settings(deadline=None, max_examples=150, derandomize=True)


# ---- strategies ---------------------------------------------------------------------------------
@st.composite
def specs(draw, mesh_ndim=None, ndim=None, shape=None):
    """A valid spec: each mesh axis is unused, a pending sum, or splits one dim (axes on one dim
    in a random order)."""
    if mesh_ndim is None:
        mesh_ndim = draw(st.integers(1, 4))
    if shape is None:
        if ndim is None:
            ndim = draw(st.integers(0, 4))
        shape = tuple(draw(st.lists(st.integers(1, 64), min_size=ndim, max_size=ndim)))
    ndim = len(shape)
    choices = ["R", "P"] + list(range(ndim))
    roles = [draw(st.sampled_from(choices)) for _ in range(mesh_ndim)]
    dim_axes = []
    for d in range(ndim):
        axes = [a for a, r in enumerate(roles) if r == d]
        dim_axes.append(tuple(draw(st.permutations(axes))))
    partial = tuple(a for a, r in enumerate(roles) if r == "P")
    return ShardingSpec(shape, tuple(dim_axes), partial, mesh_ndim)


@st.composite
def mesh_and_even_spec(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    mesh = Mesh(mesh_shape)
    ndim = draw(st.integers(0, 3))
    proto = draw(specs(mesh_ndim=mesh.ndim, shape=(1,) * ndim))
    # sizes that divide evenly: the product of the splitting axes times a small factor
    shape = tuple(mesh.axes_size(ax) * draw(st.integers(1, 3)) for ax in proto.dim_axes)
    return mesh, ShardingSpec(shape, proto.dim_axes, proto.partial, mesh.ndim)


# ---- placements ----------------------------------------------------------------------------------
def test_placements_print():
    assert str(Shard(0)) == "S(0)"
    assert str(Shard(2)) == "S(2)"
    assert str(Replicate()) == "R"
    assert str(Partial()) == "P"


def test_placements_are_values():
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0)
    assert Replicate() == Replicate() and Partial() == Partial()
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial()}) == 3


# ---- notation ----------------------------------------------------------------------------------
def test_parse_per_dim_notation():
    s = ShardingSpec.parse("[S0, R, S12 | P3]", (8, 8, 8), 4)
    assert s.dim_axes == ((0,), (), (1, 2))
    assert s.partial == (3,)
    assert s.mesh_ndim == 4
    assert str(s) == "[S0, R, S12 | P3]"
    assert s.notation() == "[S0, R, S12 | P3]"
    assert s.placements == (Shard(0), Shard(2), Shard(2), Partial())
    assert s.placements_str() == "(S(0), S(2), S(2), P)"


def test_parse_per_mesh_axis_notation():
    s = ShardingSpec.parse("(S(0), R, P)", (8, 8), 3)
    assert s.dim_axes == ((0,), ())
    assert s.partial == (2,)
    assert s.notation() == "[S0, R | P2]"
    assert s.placements_str() == "(S(0), R, P)"
    assert ShardingSpec.parse("(S(0), R, P)", (8, 8), 3) == ShardingSpec.parse("[S0, R | P2]", (8, 8), 3)


def test_parse_placements_negative_dim_and_multi_axis():
    s = ShardingSpec.parse("(S(-1), S(0))", (4, 4), 2)
    assert s.dim_axes == ((1,), (0,))
    # two mesh axes on one dim go in mesh order
    t = ShardingSpec.parse("(S(1), S(1))", (4, 4), 2)
    assert t.dim_axes == ((), (0, 1))


def test_parse_whitespace_and_spacing_variants():
    a = ShardingSpec.parse("  [S0,R|P1]  ", (4, 4), 2)
    b = ShardingSpec.parse("[S0, R | P1]", (4, 4), 2)
    assert a == b
    assert ShardingSpec.parse("( S( 0 ) ,P )", (4,), 2) == ShardingSpec.parse("[S0 | P1]", (4,), 2)


def test_partial_axes_sorted():
    s = ShardingSpec.parse("[R | P10]", (4,), 2)
    assert s.partial == (0, 1)
    assert s.notation() == "[R | P01]"
    assert ShardingSpec((4,), ((),), (1, 0), 2) == s


def test_scalar_specs():
    s = ShardingSpec.parse("[]", (), 2)
    assert s.is_replicated and s.notation() == "[]"
    p = ShardingSpec.parse("[ | P0]", (), 1)
    assert p.partial == (0,)
    assert ShardingSpec.parse(p.notation(), (), 1) == p


def test_replicate_and_views():
    s = ShardingSpec.replicate((3, 5), 2)
    assert s.is_replicated and s.notation() == "[R, R]" and s.placements == (Replicate(), Replicate())
    t = ShardingSpec.parse("[S10, R | P2]", (8, 8), 3)
    assert t.axis_of(0) == 0 and t.axis_of(1) == 0 and t.axis_of(2) is None
    assert t.used_axes == frozenset({0, 1, 2})
    assert not t.is_replicated
    assert t.ndim == 2


def test_spec_dict_round_trip():
    s = ShardingSpec.parse("[S10, R | P2]", (8, 8), 3)
    assert ShardingSpec.from_dict(s.to_dict()) == s


@SETTINGS
@given(specs())
def test_notation_round_trip(spec):
    assert ShardingSpec.parse(spec.notation(), spec.shape, spec.mesh_ndim) == spec
    assert ShardingSpec.parse(str(spec), spec.shape, spec.mesh_ndim) == spec
    assert ShardingSpec.from_dict(spec.to_dict()) == spec


@SETTINGS
@given(specs())
def test_placements_round_trip(spec):
    # the per-mesh-axis view loses the order of axes on one dim: axes come back in mesh order
    canonical = spec.with_dim_axes([tuple(sorted(ax)) for ax in spec.dim_axes])
    back = ShardingSpec.parse(spec.placements_str(), spec.shape, spec.mesh_ndim)
    assert back == canonical
    assert back.placements == spec.placements
    assert ShardingSpec.from_placements(spec.placements, spec.shape) == canonical
    # and a canonical spec round-trips exactly through both notations
    assert ShardingSpec.parse(canonical.placements_str(), spec.shape, spec.mesh_ndim) == canonical
    assert ShardingSpec.parse(canonical.notation(), spec.shape, spec.mesh_ndim) == canonical


@SETTINGS
@given(specs())
def test_placements_view_is_consistent(spec):
    pl = spec.placements
    assert len(pl) == spec.mesh_ndim
    for a, p in enumerate(pl):
        if a in spec.partial:
            assert p == Partial()
        elif spec.axis_of(a) is not None:
            assert p == Shard(spec.axis_of(a))
        else:
            assert p == Replicate()


# ---- local shards ----------------------------------------------------------------------------------
def test_local_shape_and_offset_by_hand():
    mesh = Mesh((2, 4))
    s = ShardingSpec.parse("[S01, R]", (16, 3), 2)
    assert s.local_shape(mesh) == (2, 3)
    # rank = 4*c0 + c1 and index along dim 0 = c0*4 + c1 (axis 0 major)
    assert [s.local_offset(mesh, r) for r in range(8)] == [(2 * r, 0) for r in range(8)]
    t = ShardingSpec.parse("[S10, R]", (16, 3), 2)
    # index = c1*2 + c0
    offs = [t.local_offset(mesh, r)[0] for r in range(8)]
    expect = [2 * ((r % 4) * 2 + r // 4) for r in range(8)]
    assert offs == expect
    u = ShardingSpec.parse("[S1, S0]", (8, 6), 2)
    assert u.local_shape(mesh) == (2, 3)
    assert u.local_offset(mesh, 5) == (2, 3)  # coord (1, 1)
    assert u.local_slices(mesh, 5) == (slice(2, 4), slice(3, 6))


@settings(deadline=None, max_examples=200, derandomize=True)
@given(mesh_and_even_spec())
def test_local_shards_cover_tensor_once_per_replica(mesh_spec):
    mesh, spec = mesh_spec
    split_axes = [a for ax in spec.dim_axes for a in ax]
    other_axes = [a for a in range(mesh.ndim) if a not in split_axes]  # replicas (free or partial)
    local = spec.local_shape(mesh)
    assert tuple(n * mesh.axes_size(ax) for n, ax in zip(local, spec.dim_axes)) == spec.shape
    counts = {}
    for rank in range(mesh.size):
        assert spec.local_shape(mesh, rank) == local
        off = spec.local_offset(mesh, rank)
        for o, n, s in zip(off, local, spec.shape):
            assert 0 <= o and o + n <= s and o % n == 0
        coord = mesh.coordinate(rank)
        replica = tuple(coord[a] for a in other_axes)
        c = counts.setdefault(replica, torch.zeros(spec.shape, dtype=torch.int64))
        c[spec.local_slices(mesh, rank)] += 1
    assert len(counts) == mesh.axes_size(other_axes)
    for c in counts.values():
        assert bool((c == 1).all())


# ---- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, axis",
    [("[S0, S0]", 0), ("[S00, R]", 0), ("[S0, R | P0]", 0), ("[S1, S01]", 1), ("[R, S2 | P2]", 2)],
)
def test_axis_used_twice(text, axis):
    with pytest.raises(ShardingError) as e:
        ShardingSpec.parse(text, (8, 8), 3)
    msg = str(e.value)
    assert f"mesh axis {axis} more than once" in msg
    assert "drop it" in msg  # says what to do


def test_axis_used_twice_in_constructor_and_placements():
    with pytest.raises(ShardingError, match="mesh axis 1 more than once"):
        ShardingSpec((8, 8), ((1,), (1,)), (), 2)
    with pytest.raises(ShardingError, match="mesh axis 0 more than once"):
        ShardingSpec((8,), ((0,),), (0,), 2)


@pytest.mark.parametrize(
    "text, shape, mesh_shape, dim, size, n",
    [
        ("[S0]", (10,), (4,), 0, 10, 4),
        ("[R, S01]", (8, 6), (2, 2), 1, 6, 4),
        ("[S0, S1]", (4, 9), (2, 2), 1, 9, 2),
        ("[S10, R]", (12, 1), (2, 4), 0, 12, 8),
    ],
)
def test_uneven_split(text, shape, mesh_shape, dim, size, n):
    mesh = Mesh(mesh_shape)
    spec = ShardingSpec.parse(text, shape, mesh.ndim)  # parsing does not know the mesh
    assert not spec.is_even(mesh_shape) and spec.uneven_dims(mesh_shape)[0] == dim
    for call in (lambda: spec.local_shape(mesh), lambda: spec.local_offset(mesh, 0), lambda: spec.check_even(mesh)):
        with pytest.raises(ShardingError) as e:
            call()
        msg = str(e.value)
        assert f"dim {dim}" in msg
        assert f"size {size}" in msg
        assert f"over {n} ranks" in msg
        assert f"divisible by {n}" in msg


@pytest.mark.parametrize(
    "text",
    ["S0", "[S0", "S0]", "[X]", "[S]", "[S0 | P]", "[S0 | Q1]", "[S0 | P1 | P1]", "[s0]", "[S-1]", "[S0 R]",
     "(S0)", "(S(0)", "(Q)", "(S(x))", "[S0, R]", "", "{S0}"],
)
def test_bad_notation(text):
    with pytest.raises(ShardingError) as e:
        ShardingSpec.parse(text, (8,), 2)
    assert str(e.value)  # every error says something


def test_wrong_number_of_dims_or_placements():
    with pytest.raises(ShardingError, match="2 dims but the tensor shape"):
        ShardingSpec.parse("[S0, R]", (8,), 1)
    with pytest.raises(ShardingError, match="one per mesh axis"):
        ShardingSpec.parse("(R, R)", (8,), 1)
    with pytest.raises(ShardingError, match="names dim 3"):
        ShardingSpec.parse("(S(3))", (8,), 1)
    with pytest.raises(ShardingError, match="dims but the tensor shape"):
        ShardingSpec((8, 8), ((),), (), 1)


@pytest.mark.parametrize("text, axis", [("[S2]", 2), ("[S5, R]", 5), ("[R | P3]", 3), ("[S01]", 1)])
def test_mesh_axis_out_of_range(text, axis):
    shape = (8,) * (text.count(",") + 1)
    ndim = 1 if text == "[S01]" else 2
    with pytest.raises(ShardingError) as e:
        ShardingSpec.parse(text, shape, ndim)
    assert f"mesh axis {axis}" in str(e.value)
    assert f"0..{ndim - 1}" in str(e.value)


def test_negative_mesh_axis_rejected():
    with pytest.raises(ShardingError, match="mesh axis -1"):
        ShardingSpec((8,), ((-1,),), (), 2)


def test_spec_on_wrong_mesh():
    spec = ShardingSpec.parse("[S0]", (8,), 1)
    with pytest.raises(ShardingError, match="1-axis mesh"):
        spec.local_shape(Mesh((2, 2)))


def test_unknown_placement():
    with pytest.raises(ShardingError, match="unknown placement"):
        ShardingSpec.from_placements(["R"], (4,))


def test_spec_is_immutable_and_hashable():
    s = ShardingSpec.parse("[S0, R]", (4, 4), 2)
    t = ShardingSpec((4, 4), [[0], []], [], 2)  # lists are normalised to tuples
    assert s == t and hash(s) == hash(t)
    with pytest.raises(Exception):
        s.shape = (2, 2)
