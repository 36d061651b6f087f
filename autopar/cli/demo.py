"""`make demo`: the main job. A built-in model on 4 local gloo ranks (a 2x2 mesh):

1. a short graph summary and a few resharding plans (what the planner works with);
2. ``autopar.parallelize`` with every option at its default (rank 0 plans, priced with a short
   profile of the live groups): what it picked, why (what it weighed its pick against), and the
   same cost model's price for hand-written layouts beside it;
3. two layouts that split the work for certain: data parallel 2 x tensor parallel 2
   (``force=Layout(dp=2, tp=2)``) and a 2-stage pipeline, each stage data parallel on 2 ranks
   (``pipeline=Pipeline(stages=2, microbatches=2)`` on the ranks as a line);
4. each trained for ``steps`` AdamW steps in the plain loop (``loss = pmodel(x, y);
   loss.backward(); opt.step()``), every loss checked against the single-process model's (same
   init, same batches, computed here), with the measured step beside the predicted one.

``run`` returns 0 when every loss matches, else 1 (the command's exit code): within 1e-5 relative of
the single-process model's, or within ``NOISE_FACTOR`` times that model's own distance from the
same steps in float64 (after many Adam steps, rounding in another order is amplified as much in
one process as across ranks; the test suite's checks of trained state use the same rule).
"""
from __future__ import annotations

import copy
import math
import statistics
import time
import warnings

import torch

from autopar import ir, models
from autopar.errors import ShardingError
from autopar.sharding_spec import Mesh, ShardingSpec
from autopar.solver.reshard_search import plan_reshard

TOL = 1e-5
NOISE_FACTOR = 10.0
LR = 1e-2


# ---- the foundation sections (short) -----------------------------------------------------------------
def graph_report(graph) -> str:
    s = graph.summary()
    blocks = ", ".join(f"{n} x {first}" for first, n in s["repeated_blocks"]) or "none"
    return (f"model {graph.model_name}: {s['ops']} ops, {s['parameters']:,} parameters, "
            f"{s['flops'] / 1e6:,.1f} MFLOP forward, {s['layers']} layers; repeated blocks: {blocks}")


DEMO_PAIRS = [("[S0, R | P1]", "[S0, R]"), ("[S0, S1]", "[R, R]"), ("[S01, R]", "[R, S01]")]


def reshard_report(mesh: Mesh, shape=(1024, 1024), itemsize=4) -> str:
    lines = [f"resharding a {shape[0]}x{shape[1]} fp32 tensor on {mesh.shape} ({mesh.resolved_cluster().name} links):"]
    for a, b in DEMO_PAIRS:
        try:
            src, dst = ShardingSpec.parse(a, shape, mesh.ndim), ShardingSpec.parse(b, shape, mesh.ndim)
        except ShardingError:
            continue  # the pair needs more mesh axes than this mesh has
        plan = plan_reshard(src, dst, mesh, itemsize)
        steps = "; ".join(str(s).split(":")[0] for s in plan.steps) or "-"
        lines.append(f"  {a:<14} -> {b:<10} {plan.cost * 1e6:>8.1f} us  {steps}")
    return "\n".join(lines)


# ---- training ------------------------------------------------------------------------------------------
def batches(inputs, steps: int) -> list[tuple[torch.Tensor, ...]]:
    """The example batch, then ``steps - 1`` seeded batches shaped like it (integers in range)."""
    out = [tuple(inputs)]
    for step in range(1, steps):
        g = torch.Generator().manual_seed(100 + step)
        out.append(tuple(
            torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point()
            else torch.randint(0, int(t.max()) + 1, t.shape, generator=g, dtype=t.dtype)
            for t in inputs
        ))
    return out


def train(module, data, sync=lambda: None) -> tuple[list[float], list[float]]:
    """AdamW on each batch: (losses, step seconds); ``sync`` lines the ranks up once, before the
    first step. Steps are not lined up one by one: a training loop has no barrier between steps,
    and with one a plan that needs no collective would be timed as its slowest rank's worst step
    (on shared cores some rank is always waiting for a core)."""
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    losses, times = [], []
    sync()
    for batch in data:
        t0 = time.perf_counter()
        loss = module(*batch)  # the loop a user writes, whatever the plan (pipelines too)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)  # (the caller takes the slowest rank's)
        losses.append(loss.item())
    return losses, times


def layouts(mesh_shape) -> list[tuple[str, str, dict, tuple]]:
    """The layouts the demo trains next to the single-process model, as (name, how it is asked for,
    parallelize's keywords, mesh shape): autopar's own pick, and two that split the work for
    certain (on 4 CPU ranks the planner may well keep a model this small whole)."""
    from autopar import Layout, Pipeline

    line = (math.prod(mesh_shape),)
    return [
        ("autopar's pick", "every option at its default", {}, tuple(mesh_shape)),
        ("data parallel 2 x tensor parallel 2", "force=Layout(dp=2, tp=2)", {"force": Layout(dp=2, tp=2)}, (2, 2)),
        ("2-stage pipeline x data parallel 2", "pipeline=Pipeline(stages=2, microbatches=2), force=Layout(dp=2)",
         {"pipeline": Pipeline(stages=2, microbatches=2), "force": Layout(dp=2)}, line),
    ]


WHAT_IFS = ["dp=4", "tp=4", "dp=2,tp=2", "pp=2,dp=2"]


def rank_main(rank, world_size, model_name, mesh_shape, steps):
    """Inside each rank: parallelize in each layout, train in the plain loop, report (rank 0 also
    the plans' explanations and the what-ifs)."""
    import torch.distributed as dist

    import autopar

    warnings.simplefilter("ignore")
    model, inputs = models.build(model_name)
    out = []
    for name, how, kw, shape in layouts(mesh_shape):
        t0 = time.perf_counter()
        pmodel = autopar.parallelize(model, autopar.Mesh(shape), inputs, **kw)
        setup_s = time.perf_counter() - t0
        losses, times = train(pmodel, batches(inputs, steps), sync=dist.barrier)
        row = {"name": name, "how": how, "losses": losses, "times": times, "setup_s": setup_s}
        if rank == 0:
            plan = pmodel.plan
            text = plan.explain().split("\n--- stage 0 ---")[0]  # the summary (a pipeline's stage tables are long)
            row["summary"] = "\n".join(line for line in text.splitlines()
                                        if line.startswith(("layout", "chosen", "pipeline", "predicted", "memory")))
            row["predicted_s"] = plan.summary()["step_time_s"]
            row["families"] = plan.summary()["families"]
            if not kw:  # what autopar weighed its pick against, priced by the same cost model
                from autopar.solver.compare import table

                row["what_ifs"] = table(autopar.compare(plan, model, inputs, *WHAT_IFS))
        out.append(row)
    return out


def run(mesh_shape=(2, 2), model: str = "gpt", steps: int = 20) -> int:
    from autopar.runtime.launch import spawn

    warnings.simplefilter("ignore")
    module, inputs = models.build(model)
    print(graph_report(ir.trace(module, inputs)))
    print(reshard_report(Mesh(mesh_shape, cluster="cpu-gloo")))
    world = math.prod(mesh_shape)
    shape = "x".join(map(str, mesh_shape))
    print(f"\n== {model} on {world} local gloo ranks (mesh {shape}; the pipeline views them as a line of {world}),"
          f" priced with a profile of these ranks", flush=True)
    t0 = time.perf_counter()
    results = spawn(rank_main, world, args=(model, tuple(mesh_shape), steps), timeout_s=900)
    wall = time.perf_counter() - t0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank: one core
    try:
        exact = copy.deepcopy(module).double()  # the same steps in float64: the single process's own rounding
        ref_losses, ref_times = train(module, batches(inputs, steps))  # the same init (seeded build), here
        exact_losses, _ = train(exact, [tuple(_double(t) for t in b) for b in batches(inputs, steps)])
    finally:
        torch.set_num_threads(threads)
    ok = True
    for k, (name, *_) in enumerate(layouts(mesh_shape)):
        rows = [r[k] for r in results]
        first = rows[0]
        print(f"\n-- {k + 1}. {name} ({first['how']})")
        print(first["summary"])
        if "what_ifs" in first:
            print("hand-written layouts on the same mesh, priced by the same cost model:")
            print(first["what_ifs"])
        this_ok, worst = compare_losses(rows, ref_losses, exact_losses)
        ok &= this_ok
        # the slowest rank's median step after the first: the pace training runs at
        step_s = max(statistics.median(r["times"][1:] or r["times"]) for r in rows)
        print(f"{steps} AdamW steps in the plain loop (loss = pmodel(x, y); loss.backward(); opt.step()): every loss "
              f"{'matches' if this_ok else 'does NOT match'} the single-process model's (worst {worst:.1e} relative, "
              f"the same on every rank); step {step_s * 1e3:.1f} ms measured (slowest rank's median), "
              f"{first['predicted_s'] * 1e3:.1f} ms predicted; parallelize took {max(r['setup_s'] for r in rows):.1f} s")
    print(f"\nsingle process, one thread: {statistics.median(ref_times[1:] or ref_times) * 1e3:.1f} ms a step; "
          f"{wall:.0f} s for the ranks in all")
    print("(a model this small is communication-bound on CPU gloo: benchmarks/hybrid.py times a 10M one against hand-written layouts)")
    print(f"every layout's losses {'match' if ok else 'DO NOT match'} the single-process model's: within {TOL:g} "
          f"relative, or within {NOISE_FACTOR:g}x its own rounding (its distance from the same steps in float64)")
    return 0 if ok else 1


def compare_losses(rows, ref_losses, exact_losses=None) -> tuple[bool, float]:
    """(every rank's every loss the same on every rank and within TOL relative of the
    single-process one, or within NOISE_FACTOR times that one's distance from ``exact_losses``
    (the same steps in float64); the worst relative difference)."""
    worst, ok = 0.0, True
    for i, want in enumerate(ref_losses):
        loss = rows[0]["losses"][i]
        diff = abs(loss - want) / max(abs(want), 1e-30)
        worst = max(worst, diff)
        noise = abs(want - exact_losses[i]) / max(abs(want), 1e-30) if exact_losses is not None else 0.0
        ok &= (diff <= TOL or diff <= NOISE_FACTOR * noise) and all(r["losses"][i] == loss for r in rows)
    return ok, worst


def _double(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
