"""Published models on clusters: autopar's plan against a grid of hand-written configurations,
every one priced by the same cost model (``autopar.compare``).

    .venv/bin/python benchmarks/whatif_grid.py [--cases gpt3-175b,llama3-8b] [--zero 0,1,3] [--recompute none,full,selective] [--out FILE]

Cases (``CASES``): GPT-3 175B on 1024 simulated A100s (128 x 8) and Llama 3 8B on 64 simulated H100s
(8 x 8), each at its published batch, in Megatron's recipe (``precision="bf16"``: bf16 compute over
fp32 masters), 80 GB a device. The grid is ``compare.config_grid`` over the mesh's divisors: tp (at
most a node's 8) x pp (at most the layers) x dp, each ZeRO stage of ``--zero`` where dp > 1, the
vocabulary-parallel loss on and off where tp > 1, the case's microbatch counts that split the batch
over dp (without a pipeline: gradient accumulation), and recomputation none / full / selective. Prints the
plan, each configuration's predicted step time against the plan's (those that do not fit say by
how much), and lists those predicted faster than the plan that fit: the planner's search should
leave none. Writes ``results/whatif_grid.json``. 2-6 s per configuration on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

import autopar
from autopar import models
from autopar.solver.compare import compare, config_grid
from autopar.solver.explain import layout_words
from hybrid import RESULTS

PRECISION = "bf16"  # Megatron's recipe
BUDGET = "80GB"
# name -> (mesh shape, cluster preset, microbatch counts the grid tries)
CASES = {
    "gpt3-175b": ((128, 8), "a100-80g", (1, 16, 64, 192)),
    "llama3-8b": ((8, 8), "h100-80g", (1, 8, 32)),
}


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def run_case(name: str, zero, recompute) -> dict:
    shape, cluster, microbatches = CASES[name]
    model, inputs = models.build(name)
    cfg = models.config(name)
    mesh = autopar.Mesh(shape, cluster=cluster)
    t0 = time.perf_counter()
    plan = autopar.plan(model, mesh, inputs, memory_budget=BUDGET, precision=PRECISION)
    planned_s = time.perf_counter() - t0
    best = plan.predicted["step_time_s"]
    s = plan.summary()
    pipe = s.get("pipeline") or {}
    words = layout_words(plan)
    print(f"{name} on {'x'.join(map(str, shape))} {cluster}: autopar {words}: {best:.3f} s, "
          f"{s['memory_bytes_per_device'] / 2**30:.1f} GiB (planned in {planned_s:.1f} s)", flush=True)
    configs = config_grid(mesh.size, layers=cfg.layers, batch=cfg.batch, tp_max=shape[-1], microbatches=microbatches,
                          zero=zero, recompute=recompute)
    rows, t0 = [], time.perf_counter()
    for config in configs:
        r = compare(model, mesh, inputs, [config], memory_budget=BUDGET, precision=PRECISION)[0]
        ratio = None if r.step_time_s is None else r.step_time_s / best
        rows.append(dict(config=config, step_time_s=r.step_time_s, memory_bytes=r.memory_bytes, fits=r.fits,
                         vs_plan=ratio, note=r.note))
        print(f"  {config:<52} {'-' if ratio is None else f'{r.step_time_s:.3f} s {ratio:.3f}x'}  {r.note}", flush=True)
    faster = [r for r in rows if r["fits"] and r["vs_plan"] is not None and r["vs_plan"] < 1 - 1e-9]
    fitting = sum(1 for r in rows if r["fits"] and r["step_time_s"] is not None)
    print(f"{name}: {len(rows)} configurations in {time.perf_counter() - t0:.0f} s, {fitting} fit; predicted faster "
          f"than the plan and fitting: {[(r['config'], round(r['vs_plan'], 4)) for r in faster] or 'none'}", flush=True)
    return dict(mesh=list(shape), cluster=cluster,
                plan=dict(step_time_s=best, layout=words, schedule=pipe.get("schedule"),
                          microbatches=pipe.get("microbatches"), planned_s=planned_s,
                          memory_bytes=s["memory_bytes_per_device"]),
                configs=rows, fitting=fitting, faster=[r["config"] for r in faster])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--zero", default="0,1,3", help="ZeRO stages the grid tries")
    p.add_argument("--recompute", default="none,full,selective", help="recomputation kinds the grid tries")
    p.add_argument("--out", default=str(RESULTS / "whatif_grid.json"), help="the JSON written")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    out = {name: run_case(name, ints(a.zero), a.recompute.split(",")) for name in a.cases.split(",") if name}
    RESULTS.mkdir(exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(cases=out, torch=torch.__version__), indent=1))


if __name__ == "__main__":
    main()
