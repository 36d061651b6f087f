"""The hand-tuned hybrid baseline, measured: every tp x pp x dp layout a person would write by hand
(benchmarks/hand_tuned.py) on local CPU gloo ranks, for the built-in GPT and LLaMA at ~10M
parameters, checked exact and timed; then the best of them next to DDP and any extra variants.

    .venv/bin/python benchmarks/hybrid.py [--model gpt|llama|both] [--ranks 4] [--steps 1] [--rounds 8]
                                          [--round-steps 2] [--only SUBSTR,...] [--tiny]

Everything runs inside one spawn of ``--ranks`` processes (one thread each):

    phase 1   for every valid configuration of the grid, one at a time (memory does not allow them
              all alive at once): build it; its first step, which is also the warm-up (optimizer
              states, pipeline buffers, DDP buckets and DTensor caches all exist after it), is
              checked exact (the loss and every full gradient within 1e-5 relative of the
              single-process model: same init, same global batch) and measures peak memory; then
              ``--steps`` timed steps; close. A configuration that is not exact is reported and not
              timed.
    phase 2   the best 3 configurations of phase 1, DDP, and the variants ``extra_variants``
              registers, all alive together, in ``--rounds`` alternating rounds (the order rotates
              each round) of ``--round-steps`` steps each. Extra variants are checked exact first.

The defaults (1 timed step per configuration in phase 1, 5 x 2 in phase 2) keep both models within
about 12 minutes on a 2-core VM: phase 1 ranks ~60 layouts per model, phase 2 measures the best.

Every step is bracketed by barriers and its time is the slowest rank's; a figure is the median.
Peak memory per rank is torch CPU-allocator tensor memory: the tensors resident between steps
(parameters, buffers, optimizer states, DDP's gradient buckets; this rank's shards) plus the peak
of allocations minus frees during forward and backward (torch.profiler memory events) of the
first step, max over ranks.

Output: a table per model, ``best-hand`` (the best phase-2 hand configuration) and
``median-hand`` (the median phase-1 time of the exact configurations), the skipped
configurations with their reasons, benchmarks/results/hybrid.json (one row per configuration and
phase, with ``predicted_s``: autopar's price of the same layout, ``predict_hands``) and benchmarks/results/hybrid-<model>.png
(measured bars; measured vs predicted where predictions exist; needs matplotlib: ``make bench``).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hand_tuned as ht  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "gpt": dict(vocab=8192, width=256, layers=8, heads=8, seq=128, batch=16),
    "llama": dict(vocab=8192, width=256, layers=8, heads=8, kv_heads=4, hidden=688, seq=128, batch=16),
}
TINY = {  # --tiny: the shapes of tests/benchmarks/test_hand_tuned.py, for trying the driver
    "gpt": dict(vocab=64, width=32, layers=8, heads=4, seq=16, batch=16),
    "llama": dict(vocab=64, width=32, layers=8, heads=8, kv_heads=4, hidden=64, seq=16, batch=16),
}
FINALISTS = 3


# ---- autopar's plans ----------------------------------------------------------------------------
# (name, mesh shape, Layout fields or None for the planner's choice, pipeline=, precision=)
AUTOPAR_VARIANTS = [
    ("autopar 4 auto", (4,), None, "auto", None),  # the default of parallelize
    ("autopar 4 one-stage", (4,), None, False, None),
    ("autopar 2x2 one-stage", (2, 2), None, False, None),
    ("autopar 4 data-parallel", (4,), dict(dp=4), False, None),
    # the mixed-precision recipe (bf16 compute on fp32 masters), checked against one process running it
    ("autopar 4 auto bf16", (4,), None, "auto", "bf16"),
    ("autopar 4 one-stage bf16", (4,), None, False, "bf16"),
]


def extra_variants(model_name: str, model_kw: dict, rank: int, world: int) -> dict:
    """autopar's plans, built inside each rank: name -> AutoparVariant (HandVariant's interface,
    with ``predicted_s``): the default plan (pipeline="auto": stages allowed), the planner's
    one-stage plan (pipeline=False) on a (world,) and a 2-D mesh, a plan forced to pure data
    parallelism, and the first two in bf16 (``precision="bf16"``)."""
    from autopar import Layout, Mesh
    from autopar_variant import AutoparVariant

    out = {}
    for name, shape, fields, pipeline, precision in AUTOPAR_VARIANTS:
        if math.prod(shape) == world:
            out[name] = AutoparVariant.builtin(model_name, model_kw, Mesh(shape), layout=Layout(**fields) if fields else None,
                                               pipeline=pipeline, options={"precision": precision} if precision else None)
    return out


def predict_hands(model_name: str, model_kw: dict, configs, meshes: dict) -> dict[str, float]:
    """autopar's predicted step time of every hand configuration it can express (pp == 1; ZeRO-1
    priced as ZeRO-2), with the live cluster and op table its own plans were priced with
    (``meshes``: mesh shape -> the mesh dict of an autopar plan of this run). Run on rank 0 inside
    the ranks (the op table is cached per ranks on the host); no collectives."""
    import torch

    from autopar import Layout, Mesh, ir, models, plan
    from autopar.compose.live_profile import cached_live_op_table

    model, example = models.build(model_name, device="meta", **model_kw)
    graph = ir.trace(model, example)
    out = {}
    for cfg in configs:
        shape = tuple(d for d in (cfg.dp, cfg.tp) if d > 1) or (1,)
        if cfg.pp > 1 or shape not in meshes:
            continue
        layout = Layout(dp=cfg.dp, tp=cfg.tp, zero=cfg.zero)
        mesh = Mesh.from_dict(meshes[shape])
        table = cached_live_op_table(torch.device("cpu"), mesh.resolved_cluster().rank_contention)
        try:
            p = plan(model, mesh, graph=graph, force=layout, op_table=table)
        except Exception as err:  # a layout autopar cannot form on this model: no prediction
            _say(0, f"  no prediction for {cfg.name}: {type(err).__name__}: {str(err)[:120]}")
            continue
        out[cfg.name] = p.predicted["step_time_s"]
    return out


# ---- measuring, inside each rank -------------------------------------------------------------
@contextlib.contextmanager
def _no_fd2():
    """Send file descriptor 2 to /dev/null: the profiler's C++ side prints a line on every start
    and stop. Python exceptions still propagate (and print) after it is restored."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def allocation_peak(fn):
    """``fn()``'s result and the peak of (allocated - freed) CPU tensor bytes while it ran."""
    from torch.profiler import ProfilerActivity, profile

    with _no_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()  # (also quiet: a once-per-process CPUAllocator warning about pre-profile blocks)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return out, peak


def timed_step(v) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    v.step()
    dist.barrier()
    return time.perf_counter() - t0


def first_step(v, ref) -> tuple[dict, int]:
    """The variant's first step, which is also its warm-up: forward and backward under the
    profiler, checked exact (ht.check_exact; a bf16 variant against one process running its
    recipe, within ht.BF16_TOL), AdamW step. Returns the verdict and the peak memory
    estimate: the resident tensors after the step (parameters, buffers, optimizer states, DDP's
    buckets) plus the allocation peak of forward and backward (which ends holding every gradient;
    the optimizer step adds only per-parameter temporaries on top of those)."""
    loss, peak = allocation_peak(v.forward_backward)
    bf16 = getattr(v, "precision", None) is not None
    verdict = ht.check_exact(v, ref and ref["bf16"] if bf16 else ref, loss=loss, tol=ht.BF16_TOL if bf16 else ht.TOL,
                             bf16=bf16)
    resident = v.resident_bytes() if hasattr(v, "resident_bytes") else 0
    return verdict, resident + peak


def gathered(value):
    """``value`` of every rank, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def slowest(times_per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*times_per_rank)]


def _say(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def phase1(model_name, kw, rank, world, opts, ref) -> list[dict]:
    rows = []
    for cfg, why in ht.enumerate_grid_for(model_name, kw, world):
        if opts["only"] and not any(s in cfg.name for s in opts["only"]):
            continue
        row = dict(model=model_name, config=cfg.name, phase=1, **cfg.fields())
        if why:
            rows.append(dict(row, skipped=why, exact=None, error=f"skipped: {why}"))
            continue
        dist.barrier()
        t0 = time.perf_counter()
        try:
            v = ht.build_variant(cfg, model_name, kw, rank, world)
            build_s = time.perf_counter() - t0
            verdict, mem = first_step(v, ref)
            times = [timed_step(v) for _ in range(opts["steps"])] if verdict["exact"] else []
            v.close()
            del v
        except Exception as err:
            raise RuntimeError(f"{model_name} {cfg.name} failed on rank {rank}: {err}") from err
        if len(rows) % 4 == 3:  # the closed variants' reference cycles; 0.4 s a call, so not every time
            gc.collect()
        per_rank = gathered((times, mem, build_s))
        steps = slowest([t for t, _, _ in per_rank]) if times else []
        row.update(verdict, skipped=None, step_times=steps, s_per_step=statistics.median(steps) if steps else None,
                   peak_bytes=max(m for _, m, _ in per_rank) if times else None,
                   build_s=max(b for _, _, b in per_rank))
        rows.append(row)
        _say(rank, f"  {cfg.name:<40}" + (f"{row['s_per_step']:7.3f} s/step  {row['peak_bytes'] / 2**20:7.1f} MiB"
                                          if steps else f"NOT EXACT: {verdict['error']}"))
    return rows


def phase2(model_name, kw, rank, world, opts, ref, finalists: list[ht.HandConfig]) -> dict:
    variants, info = {}, {}
    for cfg in finalists:
        variants[cfg.name] = ht.build_variant(cfg, model_name, kw, rank, world)
        variants[cfg.name].step()  # warm-up (checked exact in phase 1)
        info[cfg.name] = dict(exact=True, error=None, cfg=cfg)
    for name, v in extra_variants(model_name, kw, rank, world).items():
        verdict, mem = first_step(v, ref)
        info[name] = dict(verdict, cfg=None, predicted_s=getattr(v, "predicted_s", None), peak_bytes=max(gathered(mem)),
                          precision=getattr(v, "precision", None),
                          mesh=v.plan.mesh if hasattr(v, "plan") else None,
                          plan=v.describe() if hasattr(v, "describe") else None)  # what the planner chose
        if verdict["exact"]:
            variants[name] = v
        else:
            _say(rank, f"  {name}: NOT EXACT, not timed: {verdict['error']}")
            v.close()
    alternate(variants, info, opts)
    return info


def alternate(variants: dict, info: dict, opts) -> None:
    """Time every variant in ``opts["rounds"]`` alternating rounds of ``opts["round_steps"]``
    steps (the order rotating each round), each round's steps after one untimed step, close them
    all, and put each one's slowest-rank step times and their median into ``info[name]``.

    The untimed step warms what the other variants' rounds let go cold, which a job training one
    plan never does: without it the 2-D plans of ``fidelity.py`` measured 7-28% over their price
    while LLaMA's dp2 x tp2 timed alone on fresh ranks measured 0.80 s/step against 0.79 priced
    (0.95 in the rounds). Part of it is TCP's slow start on process groups that sat idle (Linux's
    ``tcp_slow_start_after_idle``): with it off, the GPT's 2-D plans measured within 8% of their
    price without the untimed step, the LLaMA's still 11-22% over; with the step, 5-9%."""
    names = list(variants)
    times = {n: [] for n in names}
    for r in range(opts["rounds"]):
        for n in names[r % len(names):] + names[: r % len(names)]:
            timed_step(variants[n])
            times[n] += [timed_step(variants[n]) for _ in range(opts["round_steps"])]
    for v in variants.values():
        v.close()
    variants.clear()
    gc.collect()
    per_rank = gathered(times)
    for n in names:
        info[n]["step_times"] = slowest([t[n] for t in per_rank])
        info[n]["s_per_step"] = statistics.median(info[n]["step_times"])


def rank_main(rank, world, opts):
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = {}
    for model_name in opts["models"]:
        kw = opts["shapes"][model_name]
        t0 = time.perf_counter()
        ref = dict(ht.reference(model_name, kw), bf16=ht.reference(model_name, kw, dtype=torch.bfloat16)) if rank == 0 else None
        dist.barrier()
        _say(rank, f"{model_name}: single-process reference {time.perf_counter() - t0:.1f} s; phase 1")
        rows = phase1(model_name, kw, rank, world, opts, ref)
        timed = sorted((r for r in rows if r.get("s_per_step") is not None), key=lambda r: r["s_per_step"])
        ddp = ht.HandConfig(dp=world)
        chosen = [ht.HandConfig(**{k: r[k] for k in ht.HandConfig().fields()}) for r in timed[:FINALISTS]]
        if ddp not in chosen and any(r["config"] == ddp.name for r in timed):
            chosen.append(ddp)
        _say(rank, f"{model_name}: phase 2, {opts['rounds']} rounds of {', '.join(c.name for c in chosen)} + extras")
        info = phase2(model_name, kw, rank, world, opts, ref, chosen)
        predicted = {}
        if rank == 0:
            meshes = {tuple(i["mesh"]["shape"]): i["mesh"] for i in info.values() if i.get("mesh")}
            configs = [ht.HandConfig(**{k: r[k] for k in ht.HandConfig().fields()}) for r in rows]
            predicted = predict_hands(model_name, kw, configs, meshes)
        dist.barrier()
        out[model_name] = {"phase1": rows, "phase2": info, "predicted": predicted}
    return out if rank == 0 else None


# ---- reporting, in the parent ----------------------------------------------------------------
def report(model_name, kw, res, n_params, world) -> tuple[list[dict], dict]:
    rows = []
    for r in res["phase1"]:
        cfg = ht.HandConfig(**{k: r[k] for k in ht.HandConfig().fields()})
        rows.append(dict(r, predicted_s=res["predicted"].get(cfg.name)))
    for name, i in res["phase2"].items():
        cfg = i.pop("cfg")
        row = dict(model=model_name, config=name, phase=2, hand=cfg is not None, **(cfg.fields() if cfg else {}))
        if cfg is not None:
            p1 = next(r for r in rows if r["config"] == name)
            row.update(peak_bytes=p1["peak_bytes"], loss=p1["loss"], grad_err=p1["grad_err"],
                       predicted_s=res["predicted"].get(name))
        rows.append(dict(row, **i))
    p1 = [r for r in rows if r["phase"] == 1 and r.get("s_per_step") is not None]
    p2 = {r["config"]: r for r in rows if r["phase"] == 2 and r.get("s_per_step") is not None}
    ddp_name = ht.HandConfig(dp=world).name
    ddp1 = next((r["s_per_step"] for r in p1 if r["config"] == ddp_name), None)
    ddp2 = p2[ddp_name]["s_per_step"] if ddp_name in p2 else None

    print(f"\n{model_name} ({n_params / 1e6:.1f}M parameters, {kw}): phase 1, every configuration")
    head = f"{'config':<42}{'s/step':>8}{'vs DDP':>8}{'peak MiB/rank':>15}{'first loss':>12}  exact"
    print(head)
    for r in rows:
        if r["phase"] != 1 or r.get("skipped"):
            continue
        s = r.get("s_per_step")
        print(f"{r['config']:<42}" + (f"{s:>8.3f}{s / ddp1 if ddp1 else float('nan'):>8.2f}{r['peak_bytes'] / 2**20:>15.1f}"
                                      if s is not None else f"{'-':>8}{'-':>8}{'-':>15}")
              + f"{r['loss']:>12.6f}  {'yes' if r['exact'] else 'NO: ' + str(r['error'])}")
    skipped = [r for r in rows if r["phase"] == 1 and r.get("skipped")]
    for r in skipped:
        print(f"  skipped {r['config']}: {r['skipped']}")
    print(f"{model_name}: phase 2, alternating rounds")
    print(f"{'variant':<42}{'s/step':>8}{'vs DDP':>8}{'peak MiB/rank':>15}{'first loss':>12}  exact")
    for name, r in p2.items():
        mib = r["peak_bytes"] / 2**20 if r.get("peak_bytes") else float("nan")
        print(f"{name:<42}{r['s_per_step']:>8.3f}{r['s_per_step'] / ddp2 if ddp2 else float('nan'):>8.2f}{mib:>15.1f}"
              f"{r.get('loss', float('nan')):>12.6f}  " + (f"bf16 recipe within {ht.BF16_TOL}" if r.get("precision") else "yes"))
    hand2 = sorted((r for r in p2.values() if r.get("hand")), key=lambda r: r["s_per_step"])
    summary = {"ddp_s": ddp2, "n_params": n_params, "shapes": kw,
               "best_hand": {"config": hand2[0]["config"], "s_per_step": hand2[0]["s_per_step"]} if hand2 else None,
               "median_hand_s": statistics.median(r["s_per_step"] for r in p1) if p1 else None,
               "exact": sum(1 for r in rows if r["phase"] == 1 and r.get("exact")),
               "not_exact": [r["config"] for r in rows if r["phase"] == 1 and r.get("exact") is False],
               "skipped": len(skipped)}
    if hand2:
        print(f"best-hand {model_name}: {hand2[0]['config']} {hand2[0]['s_per_step']:.3f} s/step"
              + (f" ({hand2[0]['s_per_step'] / ddp2:.2f} x DDP)" if ddp2 else ""))
    if summary["median_hand_s"] is not None:
        print(f"median-hand {model_name}: {summary['median_hand_s']:.3f} s/step (phase 1, {len(p1)} exact configurations)")
    summary["autopar"] = {}
    for name, r in p2.items():
        if r.get("hand"):
            continue
        ratios = {"s_per_step": r["s_per_step"], "predicted_s": r.get("predicted_s"), "plan": r.get("plan"),
                  "vs_ddp": r["s_per_step"] / ddp2 if ddp2 else None,
                  "vs_best_hand": r["s_per_step"] / hand2[0]["s_per_step"] if hand2 else None,
                  "vs_median_hand": r["s_per_step"] / summary["median_hand_s"] if summary["median_hand_s"] else None}
        fp32 = p2.get(name.removesuffix(" bf16")) if r.get("precision") else None
        if fp32 is not None:  # the same plan request in fp32
            ratios["vs_fp32"] = r["s_per_step"] / fp32["s_per_step"]
        summary["autopar"][name] = ratios
        print(f"{name} {model_name}: {r['s_per_step']:.3f} s/step = " + ", ".join(
            f"{v:.2f} x {k[3:].replace('_', '-')}" for k, v in ratios.items() if k.startswith("vs_") and v is not None)
            + (f" (predicted {r['predicted_s']:.3f}; {r['plan']})" if r.get("predicted_s") and r.get("plan") else ""))
    return rows, summary


def pyplot():
    """matplotlib.pyplot on a file backend, or None (said once) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; `make bench` installs it)")
        return None
    return plt


def save_figure(plt, fig, path) -> bool:
    """Lay out, write and close ``fig``: what every plot of these benchmarks ends with."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(model_name, rows, path, world) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    p1 = sorted((r for r in rows if r["phase"] == 1 and r.get("s_per_step") is not None), key=lambda r: r["s_per_step"])
    p2 = [r for r in rows if r["phase"] == 2 and r.get("s_per_step") is not None]
    pred = [r for r in rows if r.get("predicted_s") is not None and r.get("s_per_step") is not None]
    fig, axes = plt.subplots(1, 2 if pred else 1, figsize=(14 if pred else 9, 2.5 + 0.2 * len(p1)), squeeze=False)
    ax = axes[0][0]
    family = lambda r: "pp" if r["pp"] > 1 and r["tp"] == 1 else "tp" if r["tp"] > 1 and r["pp"] == 1 else "tp+pp" if r["tp"] > 1 else "dp"
    colors = {"dp": "tab:blue", "tp": "tab:orange", "pp": "tab:green", "tp+pp": "tab:purple"}
    ax.barh(range(len(p1)), [r["s_per_step"] for r in p1], color=[colors[family(r)] for r in p1])
    ax.set_yticks(range(len(p1)), [r["config"] for r in p1], fontsize=7)
    y = {r["config"]: i for i, r in enumerate(p1)}
    for r in p2:
        if r["config"] in y:
            ax.plot(r["s_per_step"], y[r["config"]], "k*", ms=8)
        else:
            ax.axvline(r["s_per_step"], color="red", ls="--", lw=1)
            ax.text(r["s_per_step"], len(p1) - 0.5, r["config"], color="red", fontsize=7, rotation=90, va="top")
    for f, c in colors.items():
        ax.barh([0], [0], color=c, label=f)
    ax.plot([], [], "k*", label="phase 2 (alternating rounds)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6 / max(len(p1), 1) - 0.04), ncol=5, fontsize=8, frameon=False)
    ax.invert_yaxis()
    ax.set_xlabel("measured s/step (median; slowest rank)")
    ax.set_title(f"{model_name}: hand-written layouts on {world} gloo ranks (red: extra variants)")
    if pred:
        ax2 = axes[0][1]
        for phase, mark in ((1, "o"), (2, "*")):
            pts = [r for r in pred if r["phase"] == phase]
            ax2.scatter([r["predicted_s"] for r in pts], [r["s_per_step"] for r in pts], marker=mark, s=14 if phase == 1 else 60,
                        label=f"phase {phase}")
            if phase == 2:
                for r in pts:
                    ax2.annotate(r["config"], (r["predicted_s"], r["s_per_step"]), fontsize=6)
        top = max(max(r["predicted_s"], r["s_per_step"]) for r in pred) * 1.05
        ax2.plot([0, top], [0, top], "k:", lw=1)
        ax2.set_xlabel("predicted s/step")
        ax2.set_ylabel("measured s/step")
        ax2.set_title("measured vs predicted")
        ax2.legend(fontsize=8)
    return save_figure(plt, fig, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["gpt", "llama", "both"], default="both")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=1, help="timed steps per configuration in phase 1 (after the first "
                   "step, which is checked exact and measures memory)")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds in phase 2")
    p.add_argument("--round-steps", type=int, default=2, help="timed steps per variant per round in phase 2")
    p.add_argument("--only", default="", help="comma-separated substrings: run only the configurations whose name has one")
    p.add_argument("--tiny", action="store_true", help="the test's tiny shapes (to try the driver in seconds)")
    p.add_argument("--out", default=str(RESULTS), help="folder for hybrid.json and the plots")
    a = p.parse_args()
    from autopar import models
    from autopar.runtime.launch import spawn

    names = ["gpt", "llama"] if a.model == "both" else [a.model]
    shapes = TINY if a.tiny else SHAPES
    opts = dict(models=names, shapes={n: shapes[n] for n in names}, steps=a.steps, rounds=a.rounds, round_steps=a.round_steps,
                only=[s for s in a.only.split(",") if s])
    print(f"hand-tuned hybrid layouts on {a.ranks} gloo ranks (1 thread each) on {platform.processor() or platform.machine()} "
          f"with {os.cpu_count()} cores; torch {torch.__version__}; phase 1: {a.steps} timed steps per configuration; "
          f"phase 2: {a.rounds} rounds x {a.round_steps} steps", flush=True)
    t0 = time.perf_counter()
    res = spawn(rank_main, a.ranks, args=(opts,), timeout_s=3600)[0]
    wall = time.perf_counter() - t0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    all_rows, summaries = [], {}
    for n in names:
        n_params = sum(t.numel() for t in models.build(n, device="meta", **shapes[n])[0].parameters())
        rows, summaries[n] = report(n, shapes[n], res[n], n_params, a.ranks)
        all_rows += rows
        if plot(n, rows, out / f"hybrid-{n}.png", a.ranks):
            print(f"wrote {out / f'hybrid-{n}.png'}")
    meta = dict(ranks=a.ranks, steps=a.steps, rounds=a.rounds, round_steps=a.round_steps, torch=torch.__version__, cores=os.cpu_count(),
                wall_s=wall, tiny=a.tiny, only=opts["only"])
    (out / "hybrid.json").write_text(json.dumps({"meta": meta, "summary": summaries, "rows": all_rows}, indent=1, default=str))
    print(f"wrote {out / 'hybrid.json'}; {wall:.0f} s wall for the ranks")


if __name__ == "__main__":
    main()
