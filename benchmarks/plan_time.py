"""Planning time (trace + strategies + solve) and ILP size for the built-in GPT, one stage (the intra-op
ILP; benchmarks/gpt3_pipeline.py times the pipeline search).

    .venv/bin/python benchmarks/plan_time.py [--layers 2,4,8,16,24,48] [--meshes 8,2x4,4x4,8x8]

The GPT is the benchmark size (models.build("gpt", size="bench"): width 320, ~10M parameters at 6
layers) with the given layer counts, built on the meta device;
meshes are simulated with the a100-80g cluster preset. Prints one row per (layers, mesh).
"""
from __future__ import annotations

import argparse
import time
import warnings

import autopar
from autopar import ir, models


def run(layers, meshes, repeats: int = 1):
    warnings.simplefilter("ignore")
    print(f"{'layers':>6} {'mesh':>6} {'nodes':>6} {'trace s':>8} {'build s':>8} {'solve s':>8} {'total s':>8} "
          f"{'ilp nodes':>9} {'ilp vars':>9} {'step ms':>8}")
    for n_layers in layers:
        model, inputs = models.build("gpt", size="bench", layers=n_layers, device="meta")
        for shape in meshes:
            best = None
            for _ in range(repeats):
                t0 = time.perf_counter()
                graph = ir.trace(model, inputs)
                t1 = time.perf_counter()
                plan = autopar.plan(model, autopar.Mesh(shape, cluster="a100-80g"), inputs, graph=graph, pipeline=False)
                total = time.perf_counter() - t0
                if best is None or total < best[0]:
                    best = (total, t1 - t0, plan)
            total, trace_s, plan = best
            s = plan.solver
            mesh = "x".join(map(str, shape))
            print(f"{n_layers:>6} {mesh:>6} {s['graph_nodes']:>6} {trace_s:>8.2f} {s['build_s']:>8.2f} {s['solve_s']:>8.2f} "
                  f"{total:>8.2f} {s['ilp_nodes_solved']:>9} {s['ilp_variables']:>9} {plan.predicted['step_time_s'] * 1e3:>8.2f}",
                  flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,4,8,16,24,48")
    p.add_argument("--meshes", default="8,2x4,4x4,8x8")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    run([int(x) for x in a.layers.split(",")], [tuple(int(v) for v in m.split("x")) for m in a.meshes.split(",")], a.repeats)


if __name__ == "__main__":
    main()
