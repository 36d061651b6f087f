"""Framework overheads, measured: what an eager training step pays beyond its ops' arithmetic.
``autopar.compose.live_profile`` runs these in the ranks (the per-process figures on rank 0 alone,
scaled by the measured contention of ranks sharing cores) and puts them into the cluster it prices
with.

    op_overhead_s            forward time per op of a long chain of one-element ops (dispatch,
                             autograd recording): what a view or a tiny op costs inside a model
    backward_op_overhead_s   the same chain's backward, per op (both: ``measure_overheads``)
    optimizer_s_per_element  AdamW (torch's default foreach implementation), per fp32 element,
    optimizer_s_per_tensor   and per tensor: fitted to one step over many small tensors and one
                             over a few large ones past the caches
    memory_bandwidth         bytes/s of an in-place add over tensors past the caches (what adding
                             gradients up costs, and the roofline of ops the op table lacks); not
                             on GPUs, whose presets carry HBM's measured rate
    fresh_memory_bandwidth   bytes/s of writing zeros into a tensor just allocated, as large as
                             those (the pages the OS maps on first touch); not on GPUs (these four:
                             ``measure_memory_work``, on every rank at once)
"""
from __future__ import annotations

import statistics
import time

import torch

from autopar.cost_model.cache import synchronizer

CHAIN = 200
COMPUTE_BETWEEN = 60  # 256x256 matmuls before each loaded collective
SMALL = (64, 1 << 10)  # (tensors, elements each)
LARGE = (2, 1 << 22)  # 32 MiB a state tensor: past a CPU's caches, as a model's states are
STREAM = 1 << 23  # fp32 elements of each tensor the bandwidth's add reads (32 MiB: past a CPU's caches)


def measure_overheads(device="cpu", repeats: int = 5) -> dict[str, float]:
    """The per-op overheads (``op_overhead_s``, ``backward_op_overhead_s``): compute-bound, so
    timed on one rank alone and scaled by the ranks' contention (``live_profile``)."""
    device = torch.device(device)
    sync = synchronizer(device)
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
    return {"op_overhead_s": statistics.median(fwd), "backward_op_overhead_s": statistics.median(bwd)}


def measure_memory_work(device="cpu", repeats: int = 3) -> dict[str, float]:
    """The memory-bound work of a step, as fast as it runs on this rank now: AdamW per element
    and per tensor, fitted to one step over many small tensors and one over large ones past the
    caches (a model's states are), and (not on GPUs) the bandwidth of an in-place add and of a
    fresh tensor's first write. Ranks
    sharing a host share its memory bandwidth, more than a core (an AdamW step ran 1.8x slower
    with 4 ranks on 2 cores, compute 1.2x): ``live_profile`` runs this on every rank at once."""
    device = torch.device(device)
    sync = synchronizer(device)
    small = _adamw_time(*SMALL, device, sync, repeats)
    large = _adamw_time(*LARGE, device, sync, repeats)
    # time = tensors * per_tensor + elements * per_element, through the two points
    n1, e1 = SMALL[0], SMALL[0] * SMALL[1]
    n2, e2 = LARGE[0], LARGE[0] * LARGE[1]
    det = n1 * e2 - n2 * e1
    out = {"optimizer_s_per_element": max((n1 * large - n2 * small) / det, 0.0),
           "optimizer_s_per_tensor": max((small * e2 - large * e1) / det, 0.0)}
    if device.type != "cuda":
        out["memory_bandwidth"] = _add_bandwidth(device, sync, repeats)
        out["fresh_memory_bandwidth"] = _fresh_bandwidth(device, sync, repeats)
    return out


def _fresh_bandwidth(device, sync, repeats: int) -> float:
    """Bytes/s of ``torch.zeros(STREAM)``: a new tensor each time, written once."""
    times = []
    for it in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        x = torch.zeros(STREAM, device=device)
        sync()
        if it >= 2:
            times.append(time.perf_counter() - t0)
        del x
    return 4 * STREAM / statistics.median(times)


def _add_bandwidth(device, sync, repeats: int) -> float:
    """Bytes/s of ``a.add_(b)``: three passes (read both, write one) over ``STREAM`` elements."""
    a, b = torch.zeros(STREAM, device=device), torch.ones(STREAM, device=device)
    times = []
    for it in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        a.add_(b)
        sync()
        if it >= 2:
            times.append(time.perf_counter() - t0)
    return 3 * a.element_size() * STREAM / statistics.median(times)


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


def measure_collective_overhead(pgs, device="cpu", world=None, repeats: int = 16, rounds: int = 2) -> float:
    """Extra wall seconds a small all-reduce costs when its ranks come to it from compute, as they
    do in a training step, over the same call made right after a barrier (how ``profile_comm``
    times collectives): the peers' skew, and on shared cores the wake-up of a descheduled peer.
    Timed as the world's wall time, not a rank's wait: ``repeats`` stretches of compute with an
    all-reduce after each, over ``pgs`` in turn (process groups this rank belongs to, one per
    mesh axis; every rank calls this, same order; ``world``: the group of them all, default the
    first), as a step's collectives alternate between the axes and so chain every rank to every
    other; less the same compute with none, per call (the
    median of ``rounds`` alternations), less the mean call after a barrier. A rank that waits
    where ranks share cores frees its core for a peer still computing, so its wait is mostly not
    lost: on 4 ranks of 2 cores the mean wait (the measure this replaced) read 5-10 ms a call, the
    wall time 1.5-5 ms over the idle call. A collective."""
    import torch.distributed as dist

    if not pgs:
        return 0.0
    device = torch.device(device)
    sync = synchronizer(device)
    x = torch.zeros(256, device=device)
    a0 = torch.randn(256, 256, device=device) / 16
    world = pgs[0] if world is None else world

    def wall(with_calls: bool) -> float:
        a = a0
        dist.barrier(group=world)
        sync()
        t0 = time.perf_counter()
        for i in range(repeats):
            for _ in range(COMPUTE_BETWEEN):  # a layer's worth of compute (~10 ms on one CPU core)
                a = torch.tanh(a @ a)
            if with_calls:
                dist.all_reduce(x, group=pgs[i % len(pgs)])
        dist.all_reduce(x, group=world)  # both end when the last rank does
        sync()
        return time.perf_counter() - t0

    idle = []
    for pg in pgs:
        for it in range(repeats + 1):
            dist.barrier(group=pg)
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(x, group=pg)
            sync()
            if it:
                idle.append(time.perf_counter() - t0)
    per_call = [(wall(True) - wall(False)) / repeats for _ in range(rounds)]
    return max(statistics.median(per_call) - statistics.fmean(idle), 0.0)


def contention_workload(device="cpu", seconds: float = 0.15) -> float:
    """Seconds of a fixed mix of a matmul and memory-bound elementwise work (about ``seconds`` on
    an idle core): timed once with every rank on the host running it, once on one rank alone, the
    ratio is how much slower each op runs in a step where every rank computes."""
    device = torch.device(device)
    # shapes of a small transformer's layer: activations of a few MB, beyond a core's own cache
    x = torch.randn(512, 256, device=device)
    w = torch.randn(256, 768, device=device) / 16
    v = torch.randn(1 << 20, device=device)

    def once():
        y = torch.tanh(x @ w)
        return y.sum() + torch.sin(v).mul_(1.0001).sum()

    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds / 4:  # calibrate the iteration count, warm up
        once()
        n += 1
    t0 = time.perf_counter()
    for _ in range(4 * n):
        once()
    return (time.perf_counter() - t0) / (4 * n)
