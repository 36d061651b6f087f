"""How long planning takes: published models on simulated clusters of growing size, in Megatron's
recipe and every other option at its default (the pipeline search included), as a launch script or
a what-if loop calls it.

    .venv/bin/python benchmarks/plan_time.py [--cases gpt2-xl@1x8,llama3-8b@8x8,...] [--out FILE]

Each case is ``model@mesh`` (``autopar.models.PUBLISHED`` at its published batch, on the meta device;
the mesh's rows x devices a node, cluster preset per model: ``CLUSTER``), planned once with
``autopar.plan`` (``precision="bf16"``, 80 GB a device) in this process after the model is built (the CLI's start, ~2 s of imports, is not
in it). Printed and written to ``results/plan_time.json``: per case the devices, the plan's time,
where it went (tracing, the intra-op ILPs, the stage DP, as the pipeline search reports it in ``plan.solver``), its
predicted step and the layout. ``results/plan_time.png`` plots planning seconds against devices,
one line per model (needs matplotlib).
"""
from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

import torch

import autopar
from autopar import models
from autopar.errors import PlanError
from autopar.solver.explain import pipeline_words

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTER = {"gpt2-xl": "a100-80g", "gpt3-175b": "a100-80g", "llama3-8b": "h100-80g", "llama3-70b": "h100-80g",
           "llama3-405b": "h100-80g"}
# a fixed list: three sizes of one model for the line against devices, and each headline case
CASES = ["llama3-8b@2x8", "llama3-8b@8x8", "llama3-8b@64x8", "llama3-70b@8x8", "llama3-70b@64x8",
         "gpt3-175b@16x8", "gpt3-175b@128x8"]
PRECISION = "bf16"  # Megatron's recipe, as benchmarks/whatif_grid.py plans them


def plan_case(case: str) -> dict:
    name, mesh_text = case.split("@")
    shape = tuple(int(v) for v in mesh_text.split("x"))
    model, inputs = models.build(name, device="meta")
    mesh = autopar.Mesh(shape, cluster=CLUSTER.get(name, "h100-80g"))
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, mesh, inputs, precision=PRECISION, memory_budget="80GB")
    except PlanError as err:  # (said, and timed: answering "nothing fits" is an answer too)
        return {"case": case, "model": name, "mesh": list(shape), "devices": math.prod(shape),
                "plan_s": time.perf_counter() - t0, "error": str(err).splitlines()[0], "layout": "nothing fits"}
    seconds = time.perf_counter() - t0
    timing = plan.solver  # the pipeline search's (a one-stage plan chosen has its own build and solve times)
    return {"case": case, "model": name, "mesh": list(shape), "devices": math.prod(shape),
            "cluster": CLUSTER.get(name, "h100-80g"), "plan_s": seconds,
            "trace_s": timing.get("trace_s"), "intra_op_s": timing.get("intra_op_s"), "dp_s": timing.get("dp_s"),
            "traces": timing.get("traces"), "step_s": plan.predicted["step_time_s"],
            "memory_gib": plan.predicted["memory_bytes_per_device"] / 2**30,
            "layout": pipeline_words(plan) if plan.pipeline is not None else "one stage"}


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r["devices"], r["plan_s"]) for r in rows if r["model"] == name)
        ax.plot([d for d, _ in mine], [s for _, s in mine], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("planning time (s)")
    ax.set_title("autopar.plan (bf16, 80 GB a device), pipeline search included")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=str(RESULTS / "plan_time.json"))
    a = p.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    print(f"{'case':>20} {'devices':>7} {'plan s':>7} {'trace s':>7} {'ILPs s':>7} {'DP s':>6} {'step s':>8}  layout")
    for case in a.cases.split(","):
        r = plan_case(case)
        rows.append(r)
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{case:>20} {r['devices']:>7} {r['plan_s']:>7.1f} {fmt(r.get('trace_s')):>7} {fmt(r.get('intra_op_s')):>7} "
              f"{fmt(r.get('dp_s')):>6} {fmt(r.get('step_s')):>8}  {r['layout']}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "command": "benchmarks/plan_time.py --cases " + a.cases,
            "date": time.strftime("%Y-%m-%d")}
    out.write_text(json.dumps({"rows": rows, "meta": meta}, indent=1))
    print(f"wrote {out}" + (f" and {out.with_suffix('.png').name}" if plot(rows, out.with_suffix(".png")) else
                            " (no plot: matplotlib is not installed)"))


if __name__ == "__main__":
    main()
