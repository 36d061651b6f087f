"""The fused vocabulary-parallel cross entropy on one rank (the class axes of size 1): loss and
gradient equal torch's, ignored targets included. Split over ranks it runs in
tests/runtime/test_parallelize.py (the vocab-parallel lm and every GPT plan with that loss)."""
import pytest
import torch
import torch.nn.functional as F

from autopar.codegen.lowerings import VocabParallelCrossEntropy
from autopar.runtime.process_groups import GroupHandle


def one_rank() -> GroupHandle:
    return GroupHandle(axes=(0,), ranks=(0,), index=0, pg=None, pg_ranks=(0,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_and_gradient_equal_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(12, 40, generator=g, dtype=dtype) * 5).requires_grad_()
    target = torch.randint(0, 40, (12,), generator=g)
    target[[2, 7]] = -100
    upstream = torch.rand(12, generator=g, dtype=dtype)
    loss = VocabParallelCrossEntropy.apply(x, target, -100, one_rank())
    (gx,) = torch.autograd.grad(loss, x, upstream)
    x_ref = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(x_ref, target, ignore_index=-100, reduction="none")
    (gref,) = torch.autograd.grad(ref, x_ref, upstream)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert torch.allclose(loss, ref, rtol=tol, atol=tol)
    assert torch.allclose(gx, gref, rtol=tol, atol=tol)
    assert loss[2] == 0 and gx[7].abs().max() == 0  # ignored targets: no loss, no gradient
