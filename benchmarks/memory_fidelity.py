"""Does autopar's memory model predict what a rank holds? Predicted vs measured peak per device.

    .venv/bin/python benchmarks/memory_fidelity.py [--model gpt|llama|both] [--ranks 4] [--tiny] [--only NAME,...]

For each model (the GPT and LLaMA of benchmarks/hybrid.py) and each plan of ``CASES`` -- the default
plan, plans forced to data parallel, ZeRO-2, ZeRO-3, Megatron tensor parallel, 2-D dp x tp, and
2-stage pipelines without recomputation, with it whole and selective -- every rank runs ``autopar.parallelize`` with the
user's AdamW, takes two warm-up steps (so that every buffer kept from step to step exists), then
measures one more full step (``train_step``, ``optimizer.step()``, ``zero_grad()``) two ways:

- torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) with every tensor alive before
  the step registered (found by the garbage collector: parameters, optimizer states, the reducer's
  kept buckets, gather buffers, ...), and everything the step allocates tracked through dispatch:
  its peak of live tensor bytes on the device;
- the same live tensors plus the peak of (allocated - freed) bytes that ``torch.profiler``'s memory
  events see during the step (every allocation of the CPU allocator, under the dispatcher or not).

A rank's prediction is the plan's ``memory_bytes_per_device`` (the stages it runs, for pipelines).
Printed: per plan and rank, predicted, both measurements and measured/predicted; the median and worst
|measured/predicted - 1|. Written: benchmarks/results/memory_fidelity.json and .png (matplotlib).
Not counted by either: memory outside torch's allocator (gloo's own staging buffers, the Python heap).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autopar_variant import AutoparVariant  # noqa: E402
from autopar.compose.dry_run import predicted_bytes  # noqa: E402
from hybrid import RESULTS, SHAPES, TINY, allocation_peak, pyplot  # noqa: E402

# name -> (mesh shape, Layout fields or None, Pipeline fields or None (one stage) or "auto")
CASES = {
    "default": ((4,), None, "auto"),
    "dp4": ((4,), dict(dp=4), None),
    "dp4 zero2": ((4,), dict(dp=4, zero=2), None),
    "dp4 zero3": ((4,), dict(dp=4, zero=3), None),
    "tp4": ((4,), dict(tp=4), None),
    "dp2 x tp2": ((2, 2), dict(dp=2, tp=2), None),
    "dp2 x tp2 zero3": ((2, 2), dict(dp=2, tp=2, zero=3), None),
    "pp2 x dp2 1f1b": ((4,), dict(dp=2), dict(stages=2, schedule="1f1b", microbatches=4, recompute=False)),
    "pp2 x dp2 1f1b recompute": ((4,), dict(dp=2), dict(stages=2, schedule="1f1b", microbatches=4, recompute=True)),
    "pp2 x dp2 1f1b selective": ((4,), dict(dp=2), dict(stages=2, schedule="1f1b", microbatches=4,
                                                        recompute="selective")),
    "pp2 x dp2 gpipe": ((4,), dict(dp=2), dict(stages=2, schedule="gpipe", microbatches=4, recompute=False)),
}


def live_storages() -> dict[int, torch.Tensor]:
    """Every CPU tensor the garbage collector reaches, one per storage (by its address), after a
    collection."""
    gc.collect()
    out: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu" or obj.is_meta:
                continue
            key = obj.untyped_storage().data_ptr()
        except Exception:  # fake or subclass tensors without a storage
            continue
        if key:
            out.setdefault(key, obj)
    return out


def live_tensors() -> list[torch.Tensor]:
    return list(live_storages().values())


def storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


class _NoModules:
    """Stands in for MemTracker's module tracker: its hooks on every module's inputs
    (``register_multi_grad_hook``) make ``autograd.grad`` with inputs fail ("a leaf node was passed
    to _will_engine_execute_node"), and zero bubble's split backward runs exactly that."""

    parents: set = set()
    is_bw = False

    def register_user_hooks(self, *hooks): pass
    def clear_user_hooks(self): pass
    def get_known_fqn(self, module): return None
    def __enter__(self): return self
    def __exit__(self, *exc): pass


def tracked_peak(step, held) -> int:
    """The peak of live tensor bytes while ``step()`` runs, by torch's MemTracker with the tensors
    ``held`` before it registered. Its per-module statistics are off: they refuse a module called
    twice in one step (every pipeline stage runs once per microbatch), and their hooks break a split
    backward; the device totals need none."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker._mod_tracker = _NoModules()
    tracker.track_external(*held)
    with tracker:
        step()
    return max((d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values()), default=0)


def measure(v) -> dict:
    """Peak bytes of one full training step of variant ``v`` (see the module docstring)."""
    def one_step():
        v.forward_backward()
        v.optimizer_step()

    base = live_tensors()
    resident = storage_bytes(base)
    dist.barrier()
    tracked = tracked_peak(one_step, base)
    del base
    dist.barrier()
    _, delta = allocation_peak(one_step)
    # where the peak falls: forward and backward, or the optimizer's step
    resident = storage_bytes(live_tensors())
    _, fb = allocation_peak(v.forward_backward)
    after_fb = storage_bytes(live_tensors())
    _, opt = allocation_peak(v.optimizer_step)
    return dict(memtracker=int(tracked), profiler=int(resident + delta), resident=int(resident),
                forward_backward=int(resident + fb), after_backward=int(after_fb), optimizer=int(after_fb + opt))


def rank_main(rank, world, model_name, model_kw, case, save_plans=""):
    """One plan in fresh processes (a plan measured after others would count what they left);
    rank 0 writes it to ``save_plans`` (a folder) where given."""
    from autopar import Layout, Mesh, Pipeline

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    shape, fields, pipe = CASES[case]
    try:
        pipeline = pipe if pipe in ("auto", None) else Pipeline(**pipe)
        v = AutoparVariant.builtin(model_name, model_kw, Mesh(shape), layout=Layout(**fields) if fields else None,
                                   pipeline=False if pipeline is None else pipeline)
    except Exception as err:  # a plan the planner cannot form here: report, go on
        return dict(error=f"{type(err).__name__}: {err}")
    if save_plans and rank == 0:
        Path(save_plans).mkdir(parents=True, exist_ok=True)
        v.plan.save(str(Path(save_plans) / f"{model_name}-{case.replace(' ', '_')}.json"))
    for _ in range(2):
        v.step()
    m = measure(v)
    m.update(predicted=predicted_bytes(v.plan, rank), parts=v.plan.predicted.get("memory_parts", {}), layout=v.describe())
    return m


def report(res: dict) -> dict:
    mib = 2**20
    rows, errors = [], []
    print(f"\n{'plan':34s} {'rank':>4s} {'predicted':>10s} {'MemTracker':>10s} {'profiler':>10s} {'meas/pred':>9s}")
    for name, ranks in res.items():
        if isinstance(ranks, dict):
            print(f"{name:34s} {ranks['error']}")
            continue
        for r, x in enumerate(ranks):
            ratio = x["memtracker"] / x["predicted"] if x["predicted"] else float("nan")
            rows.append(dict(plan=name, rank=r, **x, ratio=ratio))
            errors.append(abs(ratio - 1))
            print(f"{name:34s} {r:4d} {x['predicted'] / mib:10.1f} {x['memtracker'] / mib:10.1f} "
                  f"{x['profiler'] / mib:10.1f} {ratio:9.2f}")
    summary = dict(median_abs_error=statistics.median(errors) if errors else None, worst_abs_error=max(errors, default=None))
    if errors:
        print(f"\nmedian |measured/predicted - 1| {summary['median_abs_error']:.3f}, worst {summary['worst_abs_error']:.3f} "
              f"over {len(errors)} (plan, rank) pairs")
    return dict(rows=rows, summary=summary)


def plot(rows, path) -> bool:
    plt = pyplot()
    if plt is None or not rows:
        return False
    fig, ax = plt.subplots(figsize=(6, 6))
    mib = 2**20
    xs = [r["predicted"] / mib for r in rows]
    ys = [r["memtracker"] / mib for r in rows]
    ax.scatter(xs, ys, s=14)
    lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], alpha=0.1, color="k")
    ax.set_xlabel("predicted peak MiB per device")
    ax.set_ylabel("measured peak MiB (MemTracker)")
    ax.set_title("autopar memory fidelity (one training step, per rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["gpt", "llama", "both"], default="gpt")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (to try the driver in seconds)")
    p.add_argument("--only", default="", help="comma-separated plan names of CASES")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--save-plans", default="", help="a folder to write each measured plan to (JSON), to dry-run or reprice")
    a = p.parse_args()
    from autopar.runtime.launch import spawn

    names = ["gpt", "llama"] if a.model == "both" else [a.model]
    shapes = TINY if a.tiny else SHAPES
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    opts = dict(shapes={n: shapes[n] for n in names})
    print(f"memory fidelity on {a.ranks} gloo ranks, torch {torch.__version__}: {len(only) or len(CASES)} plans per model",
          flush=True)
    t0 = time.perf_counter()
    res = {}
    for model_name in names:
        for case in only or CASES:
            rows = spawn(rank_main, a.ranks, args=(model_name, opts["shapes"][model_name], case, a.save_plans), timeout_s=1800)
            res[f"{model_name} {case}"] = rows[0] if "error" in rows[0] else rows
            if "error" not in rows[0]:
                print(f"  {model_name} {case}: " + ", ".join(
                    f"r{r} {x['memtracker'] / 2**20:.1f}/{x['predicted'] / 2**20:.1f} MiB" for r, x in enumerate(rows)), flush=True)
    wall = time.perf_counter() - t0
    out = report(res)
    out["meta"] = dict(ranks=a.ranks, torch=torch.__version__, wall_s=wall, tiny=a.tiny, shapes=opts["shapes"])
    path = Path(a.out)
    path.mkdir(parents=True, exist_ok=True)
    suffix = "" if not a.tiny else "-tiny"
    (path / f"memory_fidelity{suffix}.json").write_text(json.dumps(out, indent=1, default=str))
    if plot(out["rows"], path / f"memory_fidelity{suffix}.png"):
        print(f"wrote {path / f'memory_fidelity{suffix}.png'}")
    print(f"wrote {path / f'memory_fidelity{suffix}.json'}; {wall:.0f} s wall for the ranks")


if __name__ == "__main__":
    main()
