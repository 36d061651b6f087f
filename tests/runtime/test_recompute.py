"""Recomputation as a stage program runs it (``runtime.stage_program._Checkpointed``): whole, the
layer's forward again in backward; selective, the matmuls' and attention's outputs kept and only the
other ops run again (``record.recompute``), with the gradients of the plain forward. Over whole
pipelines on 4 gloo ranks: ``test_pipeline_runtime``; priced: ``tests/solver/test_recompute_prices``."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.record.recompute import Recompute, saved_by_selective
from autopar.runtime.stage_program import _Checkpointed, _saved_ops


class _Counted(TorchDispatchMode):
    """Counts the ATen ops run inside it (by packet name: "addmm", "gelu")."""

    def __init__(self):
        super().__init__()
        self.ran = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ran[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(2, 6, 3, 4, 4).unbind(2)  # (batch, seq, q/k/v, heads, dim)
        a = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        x = x + a.transpose(1, 2).reshape(2, 6, 16)
        # dropout in training: its recomputed mask is the forward's (the checkpoint replays the RNG)
        return x + torch.nn.functional.dropout(self.down(torch.nn.functional.gelu(self.up(x))), 0.2, training=True)


def _backward_ops(recompute: Recompute):
    block = _Block()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    run = block if not recompute else _Checkpointed(block, None, recompute is Recompute.SELECTIVE)
    torch.manual_seed(2)
    out = run(x)
    with _Counted() as counted:
        out.pow(2).sum().backward()
    return counted.ran, x.grad, [p.grad for p in block.parameters()]


def test_selective_recomputation_runs_again_only_what_it_does_not_keep():
    (plain, plain_x, plain_grads), (full, *_), (selective, *_) = (_backward_ops(r) for r in Recompute)
    attention = next(k for k in full if k.startswith("_scaled_dot_product") and not k.endswith("backward"))
    assert plain[attention] == 0  # (the counts are of the backward alone)
    def matmuls(ran):
        return ran["addmm"] + ran["mm"]

    # whole recomputation runs the forward again (up to its last value backward reads: torch stops
    # there): linears, the attention, gelu, the norm
    assert matmuls(full) >= matmuls(plain) + 2 and full[attention] == 1
    assert full["gelu"] == full["native_layer_norm"] == 1
    # selective keeps the linears' and the attention's outputs: only the norm and gelu run again
    assert matmuls(selective) == matmuls(plain) and selective[attention] == 0
    assert selective["gelu"] == selective["native_layer_norm"] == 1
    for r in (Recompute.FULL, Recompute.SELECTIVE):  # the plain forward's gradients, bit for bit
        _, x_grad, grads = _backward_ops(r)
        assert torch.equal(x_grad, plain_x), r
        assert all(torch.equal(g, h) for g, h in zip(grads, plain_grads)), r


def test_the_traced_ops_priced_as_kept_are_those_the_runtime_keeps():
    """``saved_by_selective`` names traced ops (a linear, attention); the runtime's policy keeps what
    they dispatch to, which the installed torch has."""
    kept = {op._overloadpacket.__name__ for op in _saved_ops()}
    assert {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu", "convolution"} <= kept
    for target in ("aten.linear.default", "aten.mm.default", "aten.scaled_dot_product_attention.default",
                   "aten.conv2d.default", "aten.matmul.default"):
        assert saved_by_selective(target), target
    for target in ("aten.gelu.default", "aten.layer_norm.default", "aten.add.Tensor", "aten.softmax.int",
                   "operator.getitem"):
        assert not saved_by_selective(target), target


@pytest.mark.parametrize("value, kind", [(True, Recompute.FULL), (False, Recompute.NONE), ("selective", Recompute.SELECTIVE),
                                         ("Full", Recompute.FULL), (None, None), (Recompute.NONE, Recompute.NONE)])
def test_recompute_is_read_from_what_users_write(value, kind):
    assert Recompute.of(value) is kind


def test_an_unknown_recompute_says_what_is_taken():
    from autopar.errors import ConfigError

    with pytest.raises(ConfigError, match="use 'none', 'full', 'selective'"):
        Recompute.of("some")
