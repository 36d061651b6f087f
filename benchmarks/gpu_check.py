"""A short check on one GPU (``make gpu-check``; a few minutes, no second device needed).

    .venv/bin/python benchmarks/gpu_check.py [--device cuda|cpu] [--cluster h100-80g|a100-80g]

1. **bf16 exactness**: ``autopar.parallelize`` with a world of one, ``precision="bf16"``, trains the
   built-in GPT 5 AdamW steps; its fp32 masters against one process running the same recipe (an
   fp32 master model, a bf16 copy refreshed from it for every step), with the recipe's own
   run-to-run change of summation order (each batch as two accumulated halves) as the scale.
2. **The compute model**: the preset's roofline (GEMM efficiency, memory bandwidth) against measured
   forward and forward+backward times of the ops of one GPT-3 175B layer as a tensor-parallel-4
   stage runs them (microbatch 1, seq 2048, bf16), printed as predicted / measured per op.

3. **Ring attention's blocks**: a block (bf16, grouped queries, off the diagonal and on it) through
   the fused kernel the device takes (``codegen.ring_attention._kernel``: CUDA's flash kernel on a
   GPU) against the math path, output, log-sum-exp and the three gradients.

On ``--device cpu`` (no GPU here) it runs part 1 on gloo, part 2 against the cpu-gloo preset at
a fraction of the shapes and part 3 through the CPU's kernel: a dry run of the script, not a
measurement of a GPU. Nothing asserts; the figures go to ``benchmarks/results/gpu_check.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "runtime"))

RESULTS = Path(__file__).resolve().parent / "results"


def bf16_exactness(device: torch.device) -> dict:
    import autopar
    from autopar import models
    from test_precision import batches, distance, recipe_run

    torch.manual_seed(0)
    model, inputs = models.build("gpt", layers=2)
    start = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    steps = batches(inputs, 5)
    pm = autopar.parallelize(copy.deepcopy(model).to(device), autopar.Mesh((1,)),
                             tuple(t.to(device) for t in inputs), precision="bf16", pipeline=False, device=device)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for x in steps:
        pm(*(t.to(device) for t in x)).backward()
        opt.step()
        opt.zero_grad()
    masters = {k: v.float().cpu() for k, v in pm.full_state_dict().items()}
    on_device = copy.deepcopy(model).to(device)
    _, ref = recipe_run(on_device, [tuple(t.to(device) for t in x) for x in steps])
    _, ref_split = recipe_run(on_device, [tuple(t.to(device) for t in x) for x in steps], split=True)
    ref = {k: v.cpu() for k, v in ref.items()}
    ref_split = {k: v.cpu() for k, v in ref_split.items()}
    out = {"to_recipe": distance(masters, ref, start), "recipe_noise": distance(ref_split, ref, start),
           "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()})}
    print(f"bf16 on one {device.type} rank: masters vs the recipe {out['to_recipe']:.3g} of what training moved; "
          f"the recipe against itself in another summation order {out['recipe_noise']:.3g}; "
          f"parameters {out['param_dtypes']}")
    return out


def layer_ops(scale: int) -> list[tuple[str, callable, list, float, float]]:
    """(name, fn, input shapes, FLOPs, bytes moved) of one GPT-3 layer's ops on a tensor-parallel-4
    shard (width 12288 / ``scale``, 24 heads of 128 / ``scale``... per rank, seq 2048 / ``scale``)."""
    w, seq, heads, hd = 12288 // scale, 2048 // scale, 24, 128 // scale
    shard = w // 4
    bf = 2

    def mm(m, k, n):
        return (f"mm {m}x{k} @ {k}x{n}", lambda a, b: a @ b, [(m, k), (k, n)], 2.0 * m * k * n,
                bf * (m * k + k * n + m * n))

    sdpa_flops = 4.0 * heads * seq * seq * hd / 2  # causal: half the score matrix
    ops = [
        mm(seq, w, 3 * shard),  # fused q, k, v of this rank's heads
        ("sdpa causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         [(1, heads, seq, hd)] * 3, sdpa_flops, bf * 4 * heads * seq * hd),
        mm(seq, shard, w),  # attention output projection (row parallel)
        mm(seq, w, 4 * shard),  # MLP up (column parallel)
        ("gelu", F.gelu, [(seq, 4 * shard)], 8.0 * seq * 4 * shard, bf * 2 * seq * 4 * shard),
        mm(seq, 4 * shard, w),  # MLP down (row parallel)
        ("layer_norm", lambda x: F.layer_norm(x, (w,)), [(seq, w)], 5.0 * seq * w, bf * 2 * seq * w),
    ]
    return ops


def timed(fn, shapes, device, backward: bool, repeats: int = 10) -> float:
    xs = [torch.randn(s, device=device, dtype=torch.bfloat16, requires_grad=backward) for s in shapes]

    def once():
        out = fn(*xs)
        if backward:
            out.float().sum().backward()

    for _ in range(3):
        once()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def compute_model(device: torch.device, cluster: str) -> list[dict]:
    from autopar.cost_model.compute import BACKWARD_FLOP_FACTOR, forward_time

    scale = 1 if device.type == "cuda" else 8
    rows = []
    print(f"\none GPT-3 layer's ops on a tp-4 shard{'' if scale == 1 else f' (shapes / {scale}: a dry run)'}, bf16, "
          f"on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, priced by {cluster}:")
    print(f"{'op':<34} {'fwd pred':>10} {'fwd meas':>10} {'ratio':>6} {'f+b pred':>10} {'f+b meas':>10} {'ratio':>6}")
    for name, fn, shapes, flops, nbytes in layer_ops(scale):
        fwd_p = forward_time(flops, nbytes, "bfloat16", cluster)
        both_p = fwd_p * (1 + BACKWARD_FLOP_FACTOR)
        fwd_m = timed(fn, shapes, device, backward=False)
        both_m = timed(fn, shapes, device, backward=True)
        rows.append(dict(op=name, forward_predicted_s=fwd_p, forward_measured_s=fwd_m,
                         fwd_bwd_predicted_s=both_p, fwd_bwd_measured_s=both_m))
        print(f"{name:<34} {fwd_p * 1e3:>8.3f}ms {fwd_m * 1e3:>8.3f}ms {fwd_p / fwd_m:>6.2f} "
              f"{both_p * 1e3:>8.3f}ms {both_m * 1e3:>8.3f}ms {both_p / both_m:>6.2f}")
    return rows


def ring_blocks(device: torch.device, rows: int = 256, head_dim: int = 64) -> list[dict]:
    """Each ring attention block kind through the device's fused kernel against the math path (an
    all-True mask takes it): the largest difference over the output, log-sum-exp and the three
    gradients, relative to each one's largest magnitude."""
    from autopar.codegen import ring_attention as ra

    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    out = []

    def draw(n):
        return torch.randn(1, 2, n, head_dim, generator=gen).to(device, torch.bfloat16)

    for groups in (1, 4):
        for diag in (False, True):
            q, k, v = draw(groups * rows), draw(rows), draw(rows)
            grad = torch.randn(1, 2, groups * rows, head_dim, generator=gen).to(device)
            whole = torch.ones(groups * rows, rows, dtype=torch.bool, device=device)
            fused = ra._attend(q, k, v, scale, None, diag, rows, groups)
            math_path = ra._attend(q, k, v, scale, whole, diag, rows, groups)
            o = fused[0].to(q.dtype)
            fused += ra._attend_backward(grad, q, k, v, o, fused[1], scale, None, diag, rows, groups)
            math_path += ra._attend_backward(grad, q, k, v, o, fused[1], scale, whole, diag, rows, groups)
            error = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                        for a, b in zip(fused, math_path))
            out.append({"groups": groups, "diagonal": diag, "kernel": ra._kernel(q, k, None), "max_rel_diff": error})
            print(f"ring block, {groups} query heads a key head, {'diagonal' if diag else 'off the diagonal'}: "
                  f"{out[-1]['kernel']} kernel against the math path, largest difference {error:.2g}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cluster", default=None, help="preset to price with (default: h100-80g or a100-80g by the "
                                                    "GPU's name; cpu-gloo on cpu)")
    p.add_argument("--out", default=str(RESULTS / "gpu_check.json"))
    a = p.parse_args()
    warnings.simplefilter("ignore")
    device = torch.device(a.device)
    cluster = a.cluster
    if cluster is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        cluster = "a100-80g" if "A100" in name else "h100-80g" if device.type == "cuda" else "cpu-gloo"
    import torch.distributed as dist

    from autopar.runtime.launch import free_port

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    t0 = time.perf_counter()
    exact = bf16_exactness(device)
    rows = compute_model(device, cluster)
    ring = ring_blocks(device)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "cluster": cluster,
           "torch": torch.__version__, "bf16": exact, "ops": rows, "ring_blocks": ring,
           "seconds": time.perf_counter() - t0}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {a.out} ({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
