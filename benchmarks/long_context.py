"""Long sequences: ring attention against the all-to-all form and a plan without a sequence split.

    .venv/bin/python benchmarks/long_context.py [--seq 4096] [--rounds 5] [--round-steps 2] [--skip-plan]

1. Planning, no ranks: Llama 3 8B at 1,048,576 tokens, batch 1, on ``Mesh((8, 8),
   cluster="h100-80g")`` within 80 GB (``autopar explain llama3-8b:seq=1048576,batch=1 --mesh 8x8
   --cluster h100-80g --memory-budget 80GB``): the layout, predicted step and memory, the time to
   plan, and the model-FLOPs utilization counting attention (6 x parameters x tokens + 12 x layers
   x width x seq^2 / 2 for causal attention, forward and backward, over step x devices x peak).
2. Timing on 4 gloo ranks (one thread each): the built-in LLaMA at ``--seq`` tokens (batch 1,
   width 128, 8 heads, 2 layers): ring attention (``Layout(cp=4)``), the all-to-all form (every
   attention op forced to its heads split, the rest planned), tensor parallel 4 (Megatron: no
   sequence split; at batch 1 nothing else splits the work) and ``parallelize``'s own plan
   (``pipeline=False``). Each is checked exact first against one process (the loss and every
   gradient within 1e-5), then timed in alternating rounds; the figure is the median of the
   slowest rank's steps. Prints which form the planner picked ("heads": by heads, the all-to-all form where the
   rest splits the sequence) and each one's ratio to the fastest.
   Writes ``results/long_context.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hand_tuned as ht  # noqa: E402
from hybrid import alternate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LLAMA3_8B = "llama3-8b:seq=1048576,batch=1"


def plan_long(budget="80GB"):
    """The 1M-token plan: (plan, seconds to plan, model-FLOPs utilization with attention)."""
    import autopar
    from autopar.cli.model_spec import load_model

    model, inputs, _ = load_model(LLAMA3_8B)
    mesh = autopar.Mesh((8, 8), cluster="h100-80g")
    t0 = time.perf_counter()
    plan = autopar.plan(model, mesh, inputs, memory_budget=budget)
    seconds = time.perf_counter() - t0
    layers, width, seq = model.config.layers, model.config.width, inputs[0].shape[1]
    params = sum(t.numel() for t in model.parameters())
    flops = 6 * params * seq + 3 * 4 * layers * width * seq * seq / 2  # dense, and causal attention (fwd + 2x bwd)
    peak = dict(mesh.resolved_cluster().peak_flops)["bfloat16"]
    return plan, seconds, flops / (plan.predicted["step_time_s"] * mesh.size * peak)


def attention_form(plan) -> str:
    fams = {n.family for st in plan.stage_plans() for n in st.nodes.values() if "scaled_dot_product" in n.target}
    if any(f.ring for f in fams):
        return "ring"
    return "heads" if any(f.has("heads") for f in fams) else "none"  # all-to-all where the sequence is split


def rank_main(rank, world, opts):
    import autopar
    from autopar import models
    from autopar.ir import trace
    from autopar_variant import AutoparVariant

    warnings.simplefilter("ignore")
    kw = opts["model"]
    ref = ht.reference("llama", kw) if rank == 0 else None
    model, inputs = models.build("llama", **kw)
    sdpa = [n.name for n in trace(model, inputs).nodes.values() if n.target == "aten.scaled_dot_product_attention.default"]
    heads_only = {name: (lambda s: s.family.has("heads") and not s.family.ring)
                  for name in sdpa}
    mesh = autopar.Mesh((world,))
    choices = {"ring (cp4)": autopar.Layout(cp=world), "all-to-all": heads_only, "tensor parallel 4": autopar.Layout(tp=world),
               "autopar's plan": None}
    variants, info = {}, {}
    for name, force in choices.items():
        v = AutoparVariant.builtin("llama", kw, mesh, layout=force, pipeline=False)
        verdict = ht.check_exact(v, ref)
        info[name] = dict(verdict, predicted_s=v.predicted_s, form=attention_form(v.plan), plan=v.describe())
        if verdict["exact"]:
            variants[name] = v
        else:
            v.close()
    alternate(variants, info, opts)
    return info if rank == 0 else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--round-steps", type=int, default=2)
    p.add_argument("--skip-plan", action="store_true", help="only the timing on 4 ranks")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    out = {"torch": torch.__version__}
    if not a.skip_plan:
        plan, seconds, mfu = plan_long()
        words = plan.explain().split("\n")
        layout = next((w for w in words if w.startswith("layout:")), "")
        out["plan"] = dict(spec=LLAMA3_8B, seconds=seconds, step_time_s=plan.predicted["step_time_s"],
                           memory_bytes=plan.predicted["memory_bytes_per_device"], layout=layout, mfu=mfu)
        print(f"{LLAMA3_8B} on 8x8 h100-80g, 80GB: planned in {seconds:.1f} s; {layout}; predicted step "
              f"{plan.predicted['step_time_s']:.2f} s, {plan.predicted['memory_bytes_per_device'] / 2**30:.1f} GiB per "
              f"device; model-FLOPs utilization with attention {mfu:.1%}", flush=True)
    from autopar.runtime.launch import spawn

    kw = dict(layers=2, width=128, heads=8, kv_heads=8, hidden=256, seq=a.seq, batch=1, vocab=512)
    opts = dict(model=kw, rounds=a.rounds, round_steps=a.round_steps)
    t0 = time.perf_counter()
    info = spawn(rank_main, 4, args=(opts,), timeout_s=3600)[0]
    timed = {n: i for n, i in info.items() if i.get("s_per_step") is not None}
    fastest = min(i["s_per_step"] for i in timed.values()) if timed else math.nan
    print(f"\nbuilt-in LLaMA {kw}, 4 gloo ranks, {a.rounds} rounds x {a.round_steps} steps "
          f"({time.perf_counter() - t0:.0f} s):")
    print(f"{'variant':<20}{'s/step':>8}{'vs fastest':>11}{'predicted':>11}  attention, exact, plan")
    for name, i in info.items():
        s = i.get("s_per_step")
        print(f"{name:<20}" + (f"{s:>8.3f}{s / fastest:>11.2f}" if s else f"{'-':>8}{'-':>11}")
              + f"{i['predicted_s']:>11.3f}  {i['form']}, {'exact' if i['exact'] else 'NOT EXACT: ' + str(i['error'])}, "
              f"{i['plan']}")
    mine = info.get("autopar's plan", {})
    print(f"the planner picked: {mine.get('form')} ({mine.get('plan')})"
          + (f", {mine['s_per_step'] / fastest:.2f}x the fastest" if mine.get("s_per_step") else ""))
    out["timing"] = dict(model=kw, rounds=a.rounds, round_steps=a.round_steps,
                         variants={n: {k: v for k, v in i.items() if k != "step_times"} for n, i in info.items()})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_context.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
