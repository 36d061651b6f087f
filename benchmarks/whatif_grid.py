"""GPT-3 175B on 1024 simulated A100s: autopar's plan against a grid of hand-written configurations,
every one priced by the same cost model (``autopar.compare``).

    .venv/bin/python benchmarks/whatif_grid.py [--tp 2,4,8] [--pp 8,16,32] [--mb 96,192] [--zero 0,1]

Prints the plan, then each configuration's predicted step time against the plan's (those that do
not fit 80 GB say so), and lists the ones predicted faster than the plan: the planner's search
should leave none. Writes ``results/whatif_grid.json``. About 6 s per configuration on 2 cores.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
import warnings

import torch

from autopar import models
from autopar.solver.compare import compare
from gpt3_pipeline import GPT3, PRECISION, plan_gpt3
from hybrid import RESULTS


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="2,4,8")
    p.add_argument("--pp", default="8,16,32")
    p.add_argument("--mb", default="96,192")
    p.add_argument("--zero", default="0,1")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    plan, seconds, mfu = plan_gpt3()
    s = plan.summary()
    best = plan.predicted["step_time_s"]
    print(f"autopar: tp {s['tp']} sp {s['sp']} pp {s['pp']} dp {s['dp']}, {s['pipeline']['schedule']}, "
          f"{s['pipeline']['microbatches']} microbatches: {best:.3f} s, {s['memory_bytes_per_device'] / 2**30:.1f} GiB "
          f"(planned in {seconds:.1f} s)", flush=True)
    model, inputs = models.build("gpt", device="meta", dtype=torch.bfloat16, **GPT3)
    configs = [f"tp={tp},pp={pp},dp={1024 // (tp * pp)},mb={mb},zero={z}"
               for tp, pp, mb, z in itertools.product(ints(a.tp), ints(a.pp), ints(a.mb), ints(a.zero))
               if 1024 % (tp * pp) == 0 and (z == 0 or 1024 // (tp * pp) > 1)
               and GPT3["batch"] % mb == 0 and (GPT3["batch"] // mb) % (1024 // (tp * pp)) == 0]
    rows, t0 = [], time.perf_counter()
    for config in configs:
        r = compare(model, plan.mesh_obj, inputs, [config], memory_budget="80GB", precision=PRECISION)[0]
        ratio = None if r.step_time_s is None else r.step_time_s / best
        rows.append(dict(config=config, step_time_s=r.step_time_s, memory_bytes=r.memory_bytes, fits=r.fits,
                         vs_plan=ratio, note=r.note))
        print(f"  {config:<32} {'-' if ratio is None else f'{r.step_time_s:.3f} s {ratio:.3f}x'}  {r.note}", flush=True)
    faster = [r for r in rows if r["fits"] and r["vs_plan"] is not None and r["vs_plan"] < 1 - 1e-9]
    print(f"{len(rows)} configurations in {time.perf_counter() - t0:.0f} s; predicted faster than the plan and "
          f"fitting: {[(r['config'], round(r['vs_plan'], 4)) for r in faster] or 'none'}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "whatif_grid.json").write_text(json.dumps(dict(
        plan=dict(step_time_s=best, summary={k: s[k] for k in ("tp", "sp", "pp", "dp")}, schedule=s["pipeline"]["schedule"],
                  microbatches=s["pipeline"]["microbatches"], planned_s=seconds, mfu=mfu),
        configs=rows, faster=[r["config"] for r in faster], torch=torch.__version__), indent=1))


if __name__ == "__main__":
    main()
