"""Planning GPT-3 175B with pipeline stages, as Megatron-LM trains it (Narayanan et al., SC'21).

    .venv/bin/python benchmarks/gpt3_pipeline.py [--mesh 128x8] [--budget 80GB] [--schedule 1f1b] [--precision bf16]

The built-in GPT at GPT-3's shape (96 layers, width 12288, 96 heads, seq 2048, vocab 51200, batch
1536, on the meta device) in Megatron's recipe (``precision="bf16"``: bf16 compute on fp32 masters,
gradients and Adam states; ``--precision none`` plans a bf16 model as torch's optimizer keeps it,
with bf16 states and no master) on a simulated ``a100-80g`` mesh, ``pipeline="auto"``: prints the
time to plan (and its parts), the stages, the tp / pp / dp degrees, the schedule and microbatches,
the predicted step time, and the model-FLOPs utilization ``6 x parameters x tokens / (step x
devices x peak)`` (attention's own FLOPs not counted). Megatron-LM measured 44-52% of peak on A100s
for its 175B-1T runs, with (interleaved) 1F1B; ``--schedule`` fixes the schedule (the default
searches it, zero bubble included) to compare with that.
"""
from __future__ import annotations

import argparse
import math
import time
import warnings

import torch

import autopar
from autopar import models
from autopar.record.schedules import SCHEDULES

GPT3 = dict(layers=96, width=12288, heads=96, seq=2048, vocab=51200, batch=1536)
PRECISION = "bf16"  # Megatron's recipe


def plan_gpt3(mesh_shape=(128, 8), budget="80GB", pipeline="auto", precision=PRECISION):
    """(plan, seconds to plan, model FLOPs utilization)."""
    model, inputs = models.build("gpt", device="meta", dtype=torch.bfloat16, **GPT3)
    mesh = autopar.Mesh(mesh_shape, cluster="a100-80g")
    t0 = time.perf_counter()
    plan = autopar.plan(model, mesh, inputs, pipeline=pipeline, memory_budget=budget, precision=precision)
    seconds = time.perf_counter() - t0
    params = sum(t.numel() for t in model.parameters())
    peak = dict(mesh.resolved_cluster().peak_flops)["bfloat16"]
    mfu = 6 * params * GPT3["batch"] * GPT3["seq"] / (plan.predicted["step_time_s"] * mesh.size * peak)
    return plan, seconds, mfu


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="128x8")
    p.add_argument("--budget", default="80GB")
    p.add_argument("--schedule", default=None, choices=list(SCHEDULES), help="fix the schedule (default: searched)")
    p.add_argument("--precision", default=PRECISION, choices=("bf16", "none"),
                   help="bf16: bf16 compute on fp32 masters (default); none: the bf16 model as it is")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    shape = tuple(int(x) for x in a.mesh.split("x"))
    plan, seconds, mfu = plan_gpt3(shape, a.budget, autopar.Pipeline(schedule=a.schedule) if a.schedule else "auto",
                                   None if a.precision == "none" else a.precision)
    s = plan.summary()
    pipe = s["pipeline"]
    print(f"GPT-3 175B on {a.mesh} a100-80g, {a.budget} per device, precision {a.precision}: planned in {seconds:.1f} s "
          f"({plan.solver.get('traces', 0)} traces and {plan.solver.get('scaled_graphs', 0)} graphs scaled from them "
          f"{plan.solver.get('trace_s', 0):.1f} s, intra-op ILPs {plan.solver.get('intra_op_s', 0):.1f} s, "
          f"stage DP {plan.solver.get('dp_s', 0):.1f} s)")
    print(f"  {len(pipe['stages'])} stages of {[st['layers'][1] - st['layers'][0] + 1 for st in pipe['stages']]} layers, "
          f"{pipe['schedule']}, {pipe['microbatches']} microbatches; tp {s['tp']}, sp {s['sp']}, pp {s['pp']}, dp {s['dp']}")
    print(f"  predicted step {s['step_time_s']:.2f} s, {s['memory_bytes_per_device'] / 2**30:.1f} GiB per device, "
          f"bubble {pipe['bubble_fraction']:.0%}, model-FLOPs utilization {mfu:.1%}")
    print(f"  (stage sub-mesh {pipe['stages'][0]['mesh_shape']}; {math.prod(shape)} devices)")


if __name__ == "__main__":
    main()
