"""Training step time and peak memory per rank on local CPU gloo ranks: autopar's plan, plain DDP,
and PyTorch's own tensor-parallel plan, on the built-in GPT at the benchmark size (~10M parameters).

    .venv/bin/python benchmarks/step_time.py [--seq 64] [--batch 8] [--rounds 3] [--steps 3]

All variants live in the same 4 ranks, start from the same weights and train on the same global
batch (AdamW, lr 1e-4); they run in alternating rounds (the order rotates each round), ``--steps``
timed steps per variant per round after one warm-up step each, and the median step is reported,
also as a ratio to DDP's. The first step's losses are printed too: the same function, so they agree.

    autopar 2x2 / autopar 4   ``autopar.parallelize`` on the mesh (no cluster: priced with the short
                              live profile); full batch in, each rank keeps its slice
    ddp                       ``DistributedDataParallel`` over 4 ranks, a quarter of the batch each
    torch tp dp2 x tp2        ``torch.distributed.tensor.parallel.parallelize_module`` on a 2x2
                              (dp, tp) DeviceMesh: ColwiseParallel on attn.c_attn and mlp.c_fc,
                              RowwiseParallel on attn.c_proj and mlp.c_proj, embeddings and lm_head
                              replicated; data parallel over dp by one flat all-reduce of the
                              gradients after backward (DDP does not take DTensor parameters)

The GPT's attention splits its fused q/k/v projection by the full width and views it with every
head, which a column-sharded ``c_attn`` cannot feed: the TP variant permutes ``c_attn``'s output
rows so that each rank's column block holds [q, k, v] of its own heads, and runs attention with
``heads / tp`` local heads (``_tp_attention``). That computes the same function; ``heads`` is set to
4 (the bench preset's 5 does not divide over 2 or 4 ranks) for every variant.

Peak memory per rank is tensor memory from the torch CPU allocator: the tensors alive at the start
of a step (parameters, buffers, optimizer states counted per unique storage; for DDP also the
gradient buckets its constructor allocates, measured by the profiler's memory events around the
constructor) plus the peak of allocations minus frees during one step (``torch.profiler`` with
``profile_memory=True``, one extra untimed step). Memory that is not a torch tensor (the Python
heap, gloo's buffers) is not counted; the max over ranks is printed.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import types
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

LR = 1e-4


# ---- the variants (inside each rank) ------------------------------------------------------------
class Variant:
    """A model, its optimizer, and how it runs one step on the global batch."""

    def __init__(self, module, opt, batch, after_backward=None, extra_resident=0):
        self.module, self.opt, self.batch = module, opt, batch
        self.after_backward = after_backward or (lambda: None)
        self.extra_resident = extra_resident

    def step(self) -> torch.Tensor:
        loss = self.module(*self.batch)
        loss.backward()
        self.after_backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def resident_bytes(v: Variant) -> int:
    """Bytes of the unique storages of parameters, buffers, gradients and optimizer states."""
    tensors = [_local(t) for t in list(v.module.parameters()) + list(v.module.buffers())]
    tensors += [_local(p.grad) for p in v.module.parameters() if p.grad is not None]
    tensors += [_local(t) for s in v.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values()) + v.extra_resident


def allocation_peak(fn) -> tuple[object, int, int]:
    """``fn()``'s result, the peak of (allocated - freed) CPU tensor bytes while it ran, and that
    sum at its end (torch.profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return out, peak, cur


def build(cfg):
    from autopar import models

    return models.build("gpt", size="bench", heads=cfg["heads"], seq=cfg["seq"], batch=cfg["batch"], layers=cfg["layers"])


def make_autopar(cfg, shape):
    import autopar

    model, inputs = build(cfg)
    pm = autopar.parallelize(model, autopar.Mesh(shape), inputs)
    return Variant(pm, torch.optim.AdamW(pm.parameters(), lr=LR), inputs)


def make_ddp(cfg, rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, (idx, targets) = build(cfg)
    per = idx.shape[0] // world
    rows = slice(rank * per, (rank + 1) * per)
    ddp, _, net = allocation_peak(lambda: DDP(model))
    return Variant(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR), (idx[rows], targets[rows]), extra_resident=max(net, 0))


def _tp_attention(self, x):
    """CausalSelfAttention.forward on this rank's heads: c_attn gives (B, T, 3C/tp) = [q, k, v] of
    heads_local heads (see _permute_qkv), c_proj (row-parallel) sums the heads' outputs."""
    B, T, _ = x.shape
    q, k, v = self.c_attn(x).chunk(3, dim=2)  # each (B, T, C/tp)
    h = self.heads // self.tp
    q, k, v = (t.view(B, T, h, -1).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


@torch.no_grad()
def _permute_qkv(linear, tp: int) -> None:
    """Reorder c_attn's output rows [q; k; v] to [q_0; k_0; v_0; q_1; ...], block r = rank r's heads."""
    C = linear.weight.shape[1]
    order = torch.cat([torch.arange(part * C + r * C // tp, part * C + (r + 1) * C // tp)
                       for r in range(tp) for part in range(3)])
    linear.weight.copy_(linear.weight[order])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[order])


def make_torch_tp(cfg, rank, world, dp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = world // dp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model, (idx, targets) = build(cfg)
    plan = {}
    for i, block in enumerate(model.transformer.h):
        _permute_qkv(block.attn.c_attn, tp)
        block.attn.tp = tp
        block.attn.forward = types.MethodType(_tp_attention, block.attn)
        plan.update({f"transformer.h.{i}.attn.c_attn": ColwiseParallel(), f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                     f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(), f"transformer.h.{i}.mlp.c_proj": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    per = idx.shape[0] // dp
    d = mesh.get_local_rank("dp")
    rows = slice(d * per, (d + 1) * per)
    params = list(model.parameters())
    dp_group = mesh["dp"].get_group() if dp > 1 else None

    def sync_grads():  # data parallel over dp: one flat all-reduce, averaged
        if dp_group is None:
            return
        grads = [_local(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    return Variant(model, torch.optim.AdamW(params, lr=LR), (idx[rows], targets[rows]), after_backward=sync_grads)


def rank_main(rank, world, cfg):
    warnings.simplefilter("ignore")
    variants, setup_s = {}, {}
    for name, make in [
        ("ddp", lambda: make_ddp(cfg, rank, world)),
        (f"torch tp dp{cfg['tp_dp']} x tp{world // cfg['tp_dp']}", lambda: make_torch_tp(cfg, rank, world, cfg["tp_dp"])),
        *[(f"autopar {'x'.join(map(str, s))}", lambda s=s: make_autopar(cfg, s)) for s in cfg["autopar_meshes"]],
    ]:
        dist.barrier()
        t0 = time.perf_counter()
        variants[name] = make()
        setup_s[name] = time.perf_counter() - t0
    names = list(variants)
    loss0, times = {}, {n: [] for n in names}
    for n in names:  # warm-up step; its loss is the same function's on the same batch
        loss = variants[n].step()
        if n == "ddp" or n.startswith("torch tp"):  # rank-local mean: average over the data-parallel ranks
            loss = loss.clone()
            dist.all_reduce(loss)
            loss /= world
        loss0[n] = loss.item()
    for r in range(cfg["rounds"]):
        for n in names[r % len(names):] + names[: r % len(names)]:
            for _ in range(cfg["steps"]):
                dist.barrier()
                t0 = time.perf_counter()
                variants[n].step()
                dist.barrier()
                times[n].append(time.perf_counter() - t0)
    memory = {}
    for n in names:
        dist.barrier()
        resident = resident_bytes(variants[n])
        _, peak, _ = allocation_peak(variants[n].step)
        memory[n] = resident + peak
    return {"times": times, "memory": memory, "loss0": loss0, "setup_s": setup_s,
            "plans": {n: variants[n].module.plan.summary()["families"] for n in names if n.startswith("autopar")}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tp-dp", type=int, default=2, help="data-parallel size of the torch TP mesh (1: a 1-D TP mesh)")
    p.add_argument("--autopar-meshes", default="2x2,4")
    a = p.parse_args()
    from autopar.runtime.launch import spawn

    cfg = dict(layers=a.layers, heads=a.heads, seq=a.seq, batch=a.batch, rounds=a.rounds, steps=a.steps, tp_dp=a.tp_dp,
               autopar_meshes=[tuple(int(x) for x in m.split("x")) for m in a.autopar_meshes.split(",")])
    for shape in cfg["autopar_meshes"]:
        if math.prod(shape) != a.ranks:
            sys.exit(f"autopar mesh {shape} does not have {a.ranks} ranks")
    model, _ = build(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT layers={a.layers} width=320 heads={a.heads} vocab=8192 seq={a.seq} batch={a.batch}: {n_params / 1e6:.1f}M "
          f"parameters; {a.ranks} gloo ranks, 1 thread each, on {platform.processor() or platform.machine()} "
          f"with {os.cpu_count()} cores; torch {torch.__version__}")
    print(f"{a.rounds} rounds x {a.steps} timed steps per variant, alternating; median step (a step ends with its slowest rank)",
          flush=True)
    t0 = time.perf_counter()
    results = spawn(rank_main, a.ranks, args=(cfg,), timeout_s=3600)
    names = list(results[0]["times"])
    med = {n: statistics.median(max(r["times"][n][i] for r in results) for i in range(len(results[0]["times"][n])))
           for n in names}
    mem = {n: max(r["memory"][n] for r in results) for n in names}
    print(f"\n{'variant':<22}{'step ms':>9}{'vs ddp':>8}{'peak MiB/rank':>15}{'vs ddp':>8}{'first loss':>12}")
    for n in names:
        print(f"{n:<22}{med[n] * 1e3:>9.0f}{med[n] / med['ddp']:>8.2f}{mem[n] / 2**20:>15.1f}{mem[n] / mem['ddp']:>8.2f}"
              f"{results[0]['loss0'][n]:>12.6f}")
    for n, fams in results[0]["plans"].items():
        top = ", ".join(f"{k} x{v}" for k, v in sorted(fams.items(), key=lambda kv: -kv[1])[:6])
        print(f"{n}: parallelize {max(r['setup_s'][n] for r in results):.1f} s; plan {top}")
    print(f"({time.perf_counter() - t0:.0f} s for the ranks)")


if __name__ == "__main__":
    main()
