"""Convolution rules: every strategy checked per rank on local shards (float64, exact) against the
op on whole values; which families each kind of convolution offers."""
import pytest
from rules_harness import MESH_3D, Mesh, check_op, rand

from autopar.ir import NodeRef as R

V = {
    "x1": rand(4, 4, 10),
    "w1": rand(6, 4, 3, seed=1),
    "x2": rand(4, 4, 6, 6),
    "w2": rand(8, 4, 3, 3, seed=1),
    "b8": rand(8, seed=2),
    "x2u": rand(4, 6, 6),  # unbatched (c_in, h, w)
    "x3": rand(2, 4, 4, 4, 4),
    "w3": rand(4, 4, 2, 2, 2, seed=1),
    "wg": rand(8, 2, 3, 3, seed=3),  # groups=2: (c_out, c_in / 2, kh, kw)
    "wt": rand(4, 6, 3, 3, seed=4),  # transposed: (c_in, c_out, kh, kw)
}
MESHES = [Mesh((2,)), Mesh((2, 2)), MESH_3D]


def _families(seen):
    return {s.family for s in seen}


def test_conv2d_splits_batch_and_both_channel_dims():
    seen = check_op("aten.conv2d.default", (R("x2"), R("w2"), R("b8"), [1, 1], [1, 1]), values=V, meshes=MESHES)
    fams = _families(seen)
    # batch x output channels is "2d", batch x input channels "2d-mk", as the matmul family names them
    assert {"dp", "1d-col", "1d-row", "2d", "2d-mk", "2d-nk", "replicate"} <= fams, fams
    row = next(s for s in seen if s.family == "1d-row")
    assert row.output.partial and row.inputs[2].partial == row.output.partial  # the bias is added once


def test_conv2d_without_bias_strided_and_padded():
    check_op("aten.conv2d.default", (R("x2"), R("w2"), None, [2, 2], [0, 0], [1, 1], 1), values=V, meshes=MESHES)
    check_op("aten.conv2d.padding", (R("x2"), R("w2")), {"padding": "same"}, values=V, meshes=MESHES)


def test_conv1d_and_conv3d():
    assert "1d-row" in _families(check_op("aten.conv1d.default", (R("x1"), R("w1")), values=V, meshes=MESHES))
    assert "dp" in _families(check_op("aten.conv3d.default", (R("x3"), R("w3")), values=V, meshes=MESHES))


def test_unbatched_conv2d_splits_channels_only():
    fams = _families(check_op("aten.conv2d.default", (R("x2u"), R("w2"), R("b8"), [1, 1], [1, 1]), values=V, meshes=MESHES))
    assert "1d-col" in fams and "dp" not in fams, fams


@pytest.mark.parametrize("target, args", [
    ("aten.conv2d.default", (R("x2"), R("wg"), R("b8"), [1, 1], [1, 1], [1, 1], 2)),
    ("aten.convolution.default", (R("x2"), R("wt"), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1)),
])
def test_grouped_and_transposed_convolutions_split_only_the_batch(target, args):
    fams = _families(check_op(target, args, values=V, meshes=MESHES))
    assert fams <= {"dp", "replicate"} and "dp" in fams, fams


def test_convolution_op_matches_conv2d():
    fams = _families(check_op("aten.convolution.default", (R("x2"), R("w2"), R("b8"), [1, 1], [1, 1], [1, 1], False,
                                                            [0, 0], 1), values=V, meshes=MESHES))
    assert {"dp", "1d-col", "1d-row"} <= fams, fams

