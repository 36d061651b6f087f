"""Outputs returned split (``autopar.runtime.outputs``): a SplitOutput reads as the whole tensor
it stands for, gathers once and only when read, and carries its block's gradient. The gather here
is a local function (one process); test_outputs_ranks.py runs the real one on gloo ranks."""
from __future__ import annotations

import io
import pickle

import pytest
import torch

from autopar.errors import ConfigError
from autopar.runtime.outputs import SplitOutput, block_of, output_names, returned_split


def _split(whole: torch.Tensor, rows: slice, counter: list | None = None, requires_grad: bool = False):
    """``whole``'s rows ``rows`` as the piece of a SplitOutput whose gather returns ``whole``."""
    piece = whole[rows].clone().requires_grad_(requires_grad)

    def gather(p):
        if counter is not None:
            counter.append(1)
        assert torch.equal(p, whole[rows])  # it is handed this rank's piece
        return whole.clone()

    block = (rows,) + (slice(None),) * (whole.dim() - 1)
    return piece, returned_split(piece, whole.shape, gather, block)


def test_metadata_needs_no_gather():
    calls = []
    whole = torch.randn(4, 3, 5)
    _, out = _split(whole, slice(0, 2), calls)
    assert isinstance(out, SplitOutput) and isinstance(out, torch.Tensor)
    assert out.shape == (4, 3, 5) and out.dtype == whole.dtype and out.device == whole.device
    assert out.dim() == 3 and out.size(-1) == 5 and out.numel() == 60 and len(out) == 4
    assert not out.gathered and calls == []


def test_read_gathers_once_and_equals_the_whole():
    calls = []
    whole = torch.randn(4, 3, 5)
    _, out = _split(whole, slice(2, 4), calls)
    assert torch.equal(out.argmax(-1), whole.argmax(-1))
    assert torch.equal(out + 1, whole + 1)
    assert torch.equal(out.view(12, 5), whole.view(12, 5))
    assert torch.equal(out[1:3], whole[1:3])
    assert out.sum().item() == pytest.approx(whole.sum().item())
    assert calls == [1] and out.gathered
    plain = out.whole()
    assert type(plain) is torch.Tensor and torch.equal(plain, whole)


def test_results_are_plain_tensors():
    whole = torch.randn(2, 6)
    _, out = _split(whole, slice(0, 1))
    for r in (out * 2, out.view(-1), out.double(), torch.softmax(out, -1), out.detach(), out.clone()):
        assert type(r) is torch.Tensor
    assert out.float() is out  # a cast to its own dtype returns the tensor itself, as torch's does


def test_in_place_op_writes_the_output_itself():
    whole = torch.randn(2, 4)
    _, out = _split(whole, slice(1, 2))
    back = out.mul_(2)
    assert back is out
    assert torch.equal(out + 0, whole * 2)


def test_numpy_list_repr_pickle_and_save():
    whole = torch.arange(12.0).view(3, 4)
    _, out = _split(whole, slice(0, 1))
    assert (out.numpy() == whole.numpy()).all()
    assert out.tolist() == whole.tolist()
    import numpy as np

    assert (np.asarray(out) == whole.numpy()).all()
    assert repr(out) == repr(whole)
    assert torch.equal(pickle.loads(pickle.dumps(out)), whole)
    buf = io.BytesIO()
    torch.save({"logits": out}, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf)["logits"], whole)


def test_integer_output():
    whole = torch.randint(0, 9, (4, 2))
    _, out = _split(whole, slice(0, 2))
    assert out.dtype == torch.int64 and torch.equal(out == whole, torch.ones_like(whole, dtype=torch.bool))


def test_gradient_reaches_the_piece_as_its_block():
    whole = torch.randn(4, 3)
    piece, out = _split(whole, slice(2, 4), requires_grad=True)
    assert out.requires_grad and out.grad_fn is not None
    weights = torch.randn(4, 3)
    (out * weights).sum().backward()  # a loss made of the whole output, as every rank makes it
    assert torch.equal(piece.grad, weights[2:4])


def test_unread_output_gets_no_gradient_and_no_gather():
    calls = []
    whole = torch.randn(4, 3)
    piece, out = _split(whole, slice(0, 2), calls, requires_grad=True)
    other = (piece * 3).sum()  # the loss, made without the output
    other.backward()
    assert calls == [] and torch.equal(piece.grad, torch.full_like(piece, 3.0))


def test_gather_of_a_wrong_shape_is_an_error():
    out = SplitOutput((4, 3), torch.float32, torch.device("cpu"), lambda: torch.zeros(2, 3))
    with pytest.raises(ConfigError, match=r"gathered as torch.float32 \(2, 3\), not torch.float32 \(4, 3\)"):
        out + 1


def test_take_gather_hands_the_gather_on_once():
    out = SplitOutput((2,), torch.float32, torch.device("cpu"), lambda: torch.ones(2))
    gather = out.take_gather()
    assert torch.equal(gather(), torch.ones(2))
    with pytest.raises(ConfigError, match="read or handed on already"):
        out.take_gather()


def test_block_of():
    g = torch.arange(24.0).view(4, 6)
    assert torch.equal(block_of(g, (slice(None), slice(3, 6))), g[:, 3:])
    assert block_of(None, (slice(0, 1),)) is None


def test_output_names():
    import torch.utils._pytree as pytree

    _, spec = pytree.tree_flatten({"loss": 1, "logits": 2})
    assert output_names(spec, 2) == ["['loss']", "['logits']"]
    _, spec = pytree.tree_flatten((1, 2, 3))
    assert output_names(spec, 3) == ["[0]", "[1]", "[2]"]
    assert output_names(spec, 2) == ["output 0", "output 1"]  # a count that does not fit: plain names
