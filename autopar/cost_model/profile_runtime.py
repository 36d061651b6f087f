"""Framework overheads of one process, measured: what an eager training step pays beyond its ops'
arithmetic. ``autopar.parallelize`` runs this on every rank at once (so ranks sharing cores see
each other) and puts the medians into the cluster it prices with.

    op_overhead_s            forward time per op of a long chain of one-element ops (dispatch,
                             autograd recording): what a view or a tiny op costs inside a model
    backward_op_overhead_s   the same chain's backward, per op
    optimizer_s_per_element  AdamW (torch's default foreach implementation), per fp32 element,
    optimizer_s_per_tensor   and per tensor: fitted to one step over many small tensors and one
                             over a few large ones
"""
from __future__ import annotations

import statistics
import time

import torch

CHAIN = 200
SMALL = (64, 1 << 10)  # (tensors, elements each)
LARGE = (4, 1 << 19)


def measure_overheads(device="cpu", repeats: int = 5) -> dict[str, float]:
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd, bwd = [], []
    for it in range(repeats + 2):
        x = torch.ones(8, device=device, requires_grad=True)
        s = torch.full((8,), 1.0001, device=device)
        sync()
        t0 = time.perf_counter()
        y = x
        for _ in range(CHAIN):
            y = torch.ops.aten.mul.Tensor(y, s)
        sync()
        t1 = time.perf_counter()
        y.sum().backward()
        sync()
        if it >= 2:
            fwd.append((t1 - t0) / CHAIN)
            bwd.append((time.perf_counter() - t1) / CHAIN)
    small = _adamw_time(*SMALL, device, sync, repeats)
    large = _adamw_time(*LARGE, device, sync, repeats)
    # time = tensors * per_tensor + elements * per_element, through the two points
    n1, e1 = SMALL[0], SMALL[0] * SMALL[1]
    n2, e2 = LARGE[0], LARGE[0] * LARGE[1]
    det = n1 * e2 - n2 * e1
    per_tensor = max((small * e2 - large * e1) / det, 0.0)
    per_element = max((n1 * large - n2 * small) / det, 0.0)
    return {
        "op_overhead_s": statistics.median(fwd),
        "backward_op_overhead_s": statistics.median(bwd),
        "optimizer_s_per_element": per_element,
        "optimizer_s_per_tensor": per_tensor,
    }


def _adamw_time(n: int, size: int, device, sync, repeats: int) -> float:
    params = [torch.zeros(size, device=device, requires_grad=True) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    times = []
    for it in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if it >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
