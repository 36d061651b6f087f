"""Ring attention (``autopar.codegen.ring_attention``) on 2 and 4 gloo ranks against one process's
``scaled_dot_product_attention``: output and the gradients of q, k and v within 1e-5, at sequence
length 1024, causal and not, grouped-query heads, a padding mask, bf16 inputs; and the balanced
cut's equal causal work."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.codegen.ring_attention import causal_pairs, ring_attention
from autopar.runtime.launch import spawn
from autopar.runtime.process_groups import MeshGroups
from autopar.sharding_spec.mesh import Mesh

SEQ = 1024
TOL = 1e-5


def _inputs(hq: int, hk: int, dtype=torch.float32, seq: int = SEQ, batch: int = 2, e: int = 16):
    g = torch.Generator().manual_seed(hq * 10 + hk)
    q = torch.randn(batch, hq, seq, e, generator=g).to(dtype)
    k = torch.randn(batch, hk, seq, e, generator=g).to(dtype)
    v = torch.randn(batch, hk, seq, e, generator=g).to(dtype)
    return q, k, v


def _padding_mask(batch: int, seq: int) -> torch.Tensor:
    """transformers' 4-D mask of a left-padded batch: causal and padding, (B, 1, L, S) bool."""
    keep = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, 1, seq, seq).clone()
    keep[1, :, :, :37] = False  # the second sequence starts at position 37
    keep[1, :, :37, :] = torch.eye(seq, dtype=torch.bool)[:37]  # its padding rows see themselves (no NaN)
    return keep


def _relerr(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


CASES = [  # (name, hq, hk, causal, mask, dtype)
    ("causal", 4, 4, True, False, torch.float32),
    ("full", 4, 4, False, False, torch.float32),
    ("causal gqa", 8, 2, True, False, torch.float32),
    ("padding mask gqa", 4, 2, False, True, torch.float32),
    ("causal bf16", 4, 2, True, False, torch.bfloat16),
]


def _rank(rank: int, world: int):
    groups = MeshGroups(Mesh((world,)))
    g = groups.handle((0,))
    out = {}
    for name, hq, hk, causal, masked, dtype in CASES:
        q, k, v = _inputs(hq, hk, dtype)
        mask = _padding_mask(q.shape[0], SEQ) if masked else None
        n = SEQ // world
        rows = slice(rank * n, (rank + 1) * n)
        ql, kl, vl = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
        o = ring_attention(ql, kl, vl, g, causal=causal, mask=None if mask is None else mask[:, :, rows])
        weight = torch.randn(o.shape, generator=torch.Generator().manual_seed(rank)).to(dtype)
        (o.float() * weight.float()).sum().backward()
        # one process: the whole sequence, the same output weights
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf.float(), kf.float(), vf.float(), attn_mask=mask, is_causal=causal,
                                             enable_gqa=hq != hk)
        weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
        (ref * torch.cat(weights, dim=2).float()).sum().backward()
        errs = {"out": _relerr(o.float(), ref[:, :, rows]), "dq": _relerr(ql.grad.float(), qf.grad[:, :, rows]),
                "dk": _relerr(kl.grad.float(), kf.grad[:, :, rows]), "dv": _relerr(vl.grad.float(), vf.grad[:, :, rows])}
        out[name] = errs
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def errors(request):
    return request.param, spawn(_rank, request.param, timeout_s=300)


def test_ring_attention_is_exact_against_one_process(errors):
    world, per_rank = errors
    for rank, out in enumerate(per_rank):
        for name, hq, hk, causal, masked, dtype in CASES:
            # bf16 inputs: the ring computes in fp32 from them and rounds its output and gradients once
            tol = 1e-2 if dtype == torch.bfloat16 else TOL
            for what, err in out[name].items():
                assert err <= tol, (world, rank, name, what, err)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_balanced_cut_gives_every_rank_the_same_causal_work(n):
    work = causal_pairs(n, balanced=True)
    assert max(work) == min(work) == pytest.approx((2 * n) ** 2 / 2 / n)  # half of the (2n)^2 pairs, shared
    contiguous = causal_pairs(n, balanced=False)
    assert max(contiguous) / min(contiguous) > 2  # what the cut avoids: the last rank works most
    assert sum(contiguous) == sum(work)


@pytest.mark.parametrize("diag", [False, True])
def test_a_block_runs_a_fused_kernel_on_every_device_that_has_one(diag):
    """A block's scores are never made where a flash kernel takes it: the CPU's on CPU and on meta
    (what a dry run holds), CUDA's for half types; CUDA's kernel is called as torch declares it
    (checked on meta tensors, which run every kernel's shape function: no GPU here), giving the
    shapes and dtypes the CPU kernel gives."""
    from autopar.codegen import ring_attention as ra

    q = torch.empty(1, 2, 64, 32, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 2, 64, 32, device="meta", dtype=torch.bfloat16)
    cpu = torch.empty(1, 2, 64, 32, dtype=torch.bfloat16)
    assert ra._kernel(q, k, None) == "cpu" and ra._kernel(cpu, cpu, None) == "cpu"
    assert ra._kernel(q, k, torch.ones(64, 64, dtype=torch.bool, device="meta")) is None
    results = {}
    for kernel in ("cpu", "cuda"):
        out, lse = ra._flash(kernel, q, k, k, diag, 0.125)
        grads = ra._flash_backward(kernel, out, q, k, k, out, lse, diag, 0.125)
        results[kernel] = [(t.shape, t.dtype) for t in (out, lse, *grads)]
    assert results["cuda"] == results["cpu"]
    assert results["cpu"][1] == (torch.Size([1, 2, 64]), torch.float32)


def test_a_dry_run_of_ring_attention_holds_no_scores():
    """On meta tensors (a dry run) a block holds what the fused kernel does: a forward and a
    backward of one block keep nothing of (queries x keys) size."""
    from autopar.codegen import ring_attention as ra
    from autopar.runtime.dry_run import Recorder

    q = torch.empty(1, 2, 2048, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 2, 1024, 64, device="meta", dtype=torch.bfloat16)
    with Recorder() as rec:
        rec.start_step()
        out, lse = ra._attend(q, k, k, 0.125, None, False, 1024, 2)
        ra._attend_backward(out, q, k, k, out.to(q.dtype), lse, 0.125, None, False, 1024, 2)
    scores = 2 * 2048 * 1024 * 4  # one block's fp32 scores
    assert rec.peak_bytes < scores, rec.peak_bytes
