"""`make demo`: the main job. A built-in model on a 2x2 CPU mesh of local gloo ranks:

1. a short graph summary and a few resharding plans (what the planner works with);
2. ``autopar.parallelize`` inside 4 spawned ranks (rank 0 plans, priced with a short profile of the
   live groups; every rank runs its program), then ``plan.explain()``;
3. 5 AdamW steps, each loss beside the single-process model's (same init, same batches, computed
   here in the parent), with step times;
4. the same model as a 2-stage pipeline on the same 4 ranks viewed as a line (``Mesh((4,))``,
   ``pipeline=Pipeline(stages=2, microbatches=2)``, each stage data parallel on 2 ranks; the cut
   and the schedule chosen by the planner), trained with ``pmodel.train_step`` for the same 5 steps, also exact.

``run`` returns 0 when every loss matches within 1e-5 relative, else 1 (the command's exit code).
"""
from __future__ import annotations

import math
import statistics
import time
import warnings

import torch

from autopar import ir, models
from autopar.errors import ShardingError
from autopar.sharding_spec import Mesh, ShardingSpec, plan_reshard

TOL = 1e-5
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
        if hasattr(module, "train_step"):  # forward + backward of the batch (a pipeline's whole schedule)
            loss = module.train_step(*batch)
        else:
            loss = module(*batch)
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)  # (the caller takes the slowest rank's)
        losses.append(loss.item())
    return losses, times


def rank_main(rank, world_size, model_name, mesh_shape, steps):
    """Inside each rank: parallelize, train, report (rank 0 also returns the plan's explanation)."""
    import torch.distributed as dist

    import autopar

    warnings.simplefilter("ignore")
    model, inputs = models.build(model_name)
    t0 = time.perf_counter()
    # Every mesh axis in use: left free, the planner runs a model this small redundantly on every
    # rank (all axes idle), which is right on 2 cores but shows nothing; rank 0 reports that plan too.
    pmodel = autopar.parallelize(model, autopar.Mesh(mesh_shape), inputs, plan_kwargs={"idle_axes": ()})
    setup_s = time.perf_counter() - t0
    losses, times = train(pmodel, batches(inputs, steps), sync=dist.barrier)
    out = {"losses": losses, "times": times, "setup_s": setup_s}
    if rank == 0:
        out["explain"] = pmodel.plan.explain()
        out["predicted_s"] = pmodel.plan.summary()["step_time_s"]
        from autopar.compose.live_profile import cached_live_op_table

        cluster = pmodel.plan.mesh_obj.cluster  # priced as parallelize priced its plan
        free = autopar.plan(model, autopar.Mesh(mesh_shape, cluster=cluster), inputs, pipeline=False,
                            op_table=cached_live_op_table("cpu", cluster.rank_contention))
        out["free_choice"] = (
            f"left free to leave mesh axes idle, autopar would leave axes {free.idle_axes} idle "
            f"(predicted {free.predicted['step_time_s'] * 1e3:.2f} ms vs {out['predicted_s'] * 1e3:.2f} ms using every axis)"
            if free.idle_axes else "left free, autopar would still use every mesh axis")
    # Part 2: the same model cut into 2 pipeline stages over the ranks in a line.
    t0 = time.perf_counter()
    piped = autopar.parallelize(model, autopar.Mesh((world_size,)), inputs, pipeline=autopar.Pipeline(stages=2, microbatches=2),
                                force=autopar.Layout(dp=2))
    out["pipe_setup_s"] = time.perf_counter() - t0
    out["pipe_losses"], out["pipe_times"] = train(piped, batches(inputs, steps), sync=dist.barrier)
    if rank == 0:
        out["pipe_explain"] = piped.plan.explain().split("\n--- stage 0 ---")[0]  # the summary; the stages' tables are long
    return out


def loss_table(results, losses_key: str, times_key: str, ref_losses, ref_times) -> bool:
    """Print each step's loss beside the single-process one, with the slowest rank's step time;
    whether every loss is within TOL and the same on every rank."""
    losses = results[0][losses_key]
    print(f"{'step':>4}  {'autopar loss':>14}  {'single-process':>14}  {'rel. diff':>9}  {'step ms':>8}  {'1-proc ms':>9}")
    print(f"{'':>4}  {'':>14}  {'':>14}  {'':>9}  {'(slowest)':>8}  {'(1 thread)':>9}")
    ok = True
    for i, (loss, want) in enumerate(zip(losses, ref_losses)):
        diff = abs(loss - want) / max(abs(want), 1e-30)
        same_on_ranks = all(r[losses_key][i] == loss for r in results)
        ok &= diff <= TOL and same_on_ranks
        step_s = max(r[times_key][i] for r in results)
        print(f"{i:>4}  {loss:>14.8f}  {want:>14.8f}  {diff:>9.1e}  {step_s * 1e3:>8.1f}  {ref_times[i] * 1e3:>9.1f}"
              + ("" if same_on_ranks else "  (ranks disagree)"))
    return ok


def run(mesh_shape=(2, 2), model: str = "gpt", steps: int = 20) -> int:
    from autopar.runtime.launch import spawn

    warnings.simplefilter("ignore")
    module, inputs = models.build(model)
    print(graph_report(ir.trace(module, inputs)))
    print(reshard_report(Mesh(mesh_shape, cluster="cpu-gloo")))

    world = math.prod(mesh_shape)
    print(f"\n== parallelize {model} on a {'x'.join(map(str, mesh_shape))} mesh of {world} local gloo ranks", flush=True)
    t0 = time.perf_counter()
    results = spawn(rank_main, world, args=(model, tuple(mesh_shape), steps), timeout_s=600)
    wall = time.perf_counter() - t0
    print(results[0]["explain"])
    print(results[0]["free_choice"])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank: one core
    try:
        ref_losses, ref_times = train(module, batches(inputs, steps))  # the same init (seeded build), here
    finally:
        torch.set_num_threads(threads)
    # the slowest rank's median step after the first: the pace training runs at
    step_s = max(statistics.median(r["times"][1:] or r["times"]) for r in results)
    print(f"\n== {steps} AdamW steps (lr {LR}): autopar on {world} ranks vs the single-process model")
    ok = loss_table(results, "losses", "times", ref_losses, ref_times)
    print(f"\nmedian step after the first (slowest rank): {step_s * 1e3:.1f} ms measured "
          f"(plan predicted {results[0]['predicted_s'] * 1e3:.1f} ms); parallelize took "
          f"{max(r['setup_s'] for r in results):.1f} s per rank; {wall:.0f} s for the ranks in all")
    print("(a model this small is communication-bound on CPU gloo; benchmarks/hybrid.py times a 10M one against hand-written layouts)")
    print(f"losses {'match' if ok else 'DO NOT match'} the single-process model within {TOL:g} relative")

    print(f"\n== the same model as a 2-stage pipeline on {world} ranks in a line (Pipeline(stages=2, microbatches=2), Layout(dp=2) per stage)")
    print(results[0]["pipe_explain"])
    pipe_ok = loss_table(results, "pipe_losses", "pipe_times", ref_losses, ref_times)
    print(f"pipelined losses {'match' if pipe_ok else 'DO NOT match'} the single-process model within {TOL:g} relative "
          f"(parallelize took {max(r['pipe_setup_s'] for r in results):.1f} s per rank)")
    return 0 if ok and pipe_ok else 1
