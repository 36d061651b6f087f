"""Does autopar's cost model predict the runtime? Predicted vs measured step time over forced plans.

    .venv/bin/python benchmarks/fidelity.py [--model gpt|llama|both] [--ranks 4] [--rounds 3] [--round-steps 2] [--tiny]

For each model (the GPT and LLaMA of benchmarks/hybrid.py) and each case of ``CASES`` -- autopar's
one-stage plan (``pipeline=False``) on Mesh((4,)) and Mesh((2, 2)), and plans forced to hand-style layouts
(``autopar.Layout``: data parallel, ZeRO-2, ZeRO-3, Megatron tensor parallel, 2D = dp x tp, with and
without the vocabulary-parallel loss) -- every rank runs ``autopar.parallelize`` (priced as it
prices by default: the live collective profile and the live op profile) with the user's AdamW.
Each plan's first step is checked exact against one process (loss and every gradient within 1e-5);
then all exact plans of a model run in ``--rounds`` alternating rounds of ``--round-steps`` steps
(order rotating), every step bracketed by barriers and timed on its slowest rank; a plan's figure
is the median.

The zoo's transformers models (``--zoo``, benchmarks/zoo.py: GPT-2, LLaMA and Qwen2 with 50k, 32k and 151k
vocabularies) run ``ZOO_CASES`` one plan at a time (all alive at once would not fit in this machine's
memory): built, checked per tensor against one process over three clipped AdamW steps, timed alone
(``train_step``, clipping, AdamW) and closed.

Printed: per plan predicted and measured s/step and the error; per model and over all, the
Spearman rank correlation of predicted vs measured and the median |predicted/measured - 1|.
Written: benchmarks/results/fidelity.json and fidelity.png (needs matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hand_tuned as ht  # noqa: E402
from autopar_variant import AutoparVariant  # noqa: E402
from hybrid import RESULTS, SHAPES, TINY, alternate, first_step, gathered, pyplot, save_figure, slowest  # noqa: E402

# (mesh shape, Layout fields or None for the planner's own one-stage plan)
CASES = [
    ((4,), None),
    ((2, 2), None),
    ((4,), dict(dp=4)),
    ((4,), dict(dp=4, zero=2)),
    ((4,), dict(dp=4, zero=3)),
    ((4,), dict(tp=4)),
    ((4,), dict(tp=4, vocab_parallel=False)),
    ((2, 2), dict(dp=2, tp=2)),
    ((2, 2), dict(dp=2, tp=2, vocab_parallel=False)),
    ((2, 2), dict(dp=2, tp=2, zero=2)),
    ((2, 2), dict(dp=2, tp=2, zero=3)),
    ((2, 2), dict(dp=2, tp=2, zero=3, vocab_parallel=False)),
]


# the zoo's transformers models (benchmarks/zoo.py: GPT-2 50k, LLaMA 32k, Qwen2 151k vocabularies), with
# every case alive at once too large for this machine: each plan is built, checked and timed alone
ZOO_CASES = [
    ((4,), None),
    ((2, 2), None),
    ((4,), dict(dp=4)),
    ((4,), dict(dp=4, zero=2)),
    ((4,), dict(dp=4, zero=3)),
    ((2, 2), dict(dp=2, tp=2)),
]


def case_name(shape, fields) -> str:
    from autopar import Layout

    mesh = "x".join(map(str, shape))
    return f"{mesh} one-stage" if fields is None else f"{mesh} {Layout(**fields).name}"


def rank_main(rank, world, opts):
    from autopar import Layout, Mesh

    warnings.simplefilter("ignore")
    out = {}
    for model_name in opts["models"]:
        kw = opts["shapes"][model_name]
        ref = ht.reference(model_name, kw) if rank == 0 else None
        variants, rows = {}, {}
        for shape, fields in CASES:
            name = case_name(shape, fields)
            dist.barrier()
            t0 = time.perf_counter()
            try:
                v = AutoparVariant.builtin(model_name, kw, Mesh(shape), layout=Layout(**fields) if fields else None)
            except Exception as err:  # a layout the planner cannot form here: report, go on
                rows[name] = dict(error=f"{type(err).__name__}: {err}")
                continue
            build_s = time.perf_counter() - t0
            verdict, _ = first_step(v, ref)
            rows[name] = dict(verdict, predicted_s=v.predicted_s, predicted=dict(v.plan.predicted), build_s=build_s,
                              families=_families(v.plan))
            if verdict["exact"]:
                variants[name] = v
            else:
                v.close()
            if rank == 0:
                print(f"  {model_name} {name}: built in {build_s:.1f} s, "
                      + ("exact" if verdict["exact"] else f"NOT EXACT: {verdict['error']}"), flush=True)
        alternate(variants, rows, opts)
        out[model_name] = rows
    return out if rank == 0 else None


def zoo_main(rank, world, opts):
    """The zoo's models: each plan of ``ZOO_CASES`` built, checked exact per tensor against one process
    (``zoo.checked``: three clipped AdamW steps), timed alone for ``rounds x round_steps`` steps
    (``train_step``, clipping, AdamW) and closed."""
    import gc

    import zoo
    from autopar import Layout, Mesh

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out = {}
    for name in opts["zoo"]:
        ref = torch.load(opts["refs"][name]) if rank == 0 else None
        vocab = zoo.build(name)[1]
        b = zoo.batches(vocab, 1)[0]
        rows = {}
        for shape, fields in ZOO_CASES:
            case = case_name(shape, fields)
            model = zoo.build(name)[0]
            dist.barrier()
            t0 = time.perf_counter()
            try:
                v = AutoparVariant(model, (), b, Mesh(shape), layout=Layout(**fields) if fields else None, lr=zoo.LR)
            except Exception as err:  # a layout the planner cannot form here: report, go on
                rows[case] = dict(error=f"{type(err).__name__}: {err}")
                continue
            build_s = time.perf_counter() - t0
            verdict = zoo.checked(_ZooStep(v), ref, vocab)
            row = dict(verdict, predicted_s=v.predicted_s, predicted=dict(v.plan.predicted), build_s=build_s,
                       families=_families(v.plan))
            if verdict["exact"]:
                times = [zoo.timed(_ZooStep(v).train_step, b) for _ in range(opts["rounds"] * opts["round_steps"])]
                steps = slowest(gathered(times))
                row.update(step_times=steps, s_per_step=statistics.median(steps))
            rows[case] = row
            v.close()
            del v
            gc.collect()
            if rank == 0:
                print(f"  {name} {case}: " + (f"predicted {row['predicted_s']:.3f} measured {row['s_per_step']:.3f}"
                                              if verdict["exact"] else f"NOT EXACT: {verdict['error']}"), flush=True)
        out[name] = rows
    return out if rank == 0 else None


class _ZooStep:
    """An AutoparVariant in the zoo's loop: the plain call for the checked steps, ``train_step`` timed;
    clipping and AdamW after each."""

    def __init__(self, v):
        self.v = v

    def first(self, b):
        loss = self.v.pm(**b).loss
        loss.backward()
        return loss.item()

    def full_grads(self):
        return self.v.full_grads()

    def finish(self):
        torch.nn.utils.clip_grad_norm_(self.v.pm.parameters(), 1.0)
        self.v.optimizer_step()

    def step(self, b):
        loss = self.first(b)
        self.finish()
        return loss

    def train_step(self, b):
        self.v.pm.train_step(**b)
        self.finish()


def _families(plan) -> dict:
    counts: dict = {}
    for n in plan.nodes.values():
        if not n.family.has("view") and n.target not in ("placeholder", "output"):
            counts[n.family] = counts.get(n.family, 0) + 1
    return counts


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / den if den else float("nan")


def figures(rows: list[dict]) -> dict:
    pts = [r for r in rows if r.get("s_per_step") and r.get("predicted_s")]
    if len(pts) < 2:
        return {"plans": len(pts)}
    errs = [abs(r["predicted_s"] / r["s_per_step"] - 1) for r in pts]
    return {"plans": len(pts), "spearman": spearman([r["predicted_s"] for r in pts], [r["s_per_step"] for r in pts]),
            "median_abs_err": statistics.median(errs), "max_abs_err": max(errs)}


def report(res: dict) -> dict:
    all_rows, summary = [], {}
    for model_name, rows in res.items():
        print(f"\n{model_name}: predicted vs measured (alternating rounds)")
        print(f"{'plan':<34}{'predicted':>10}{'measured':>10}{'error':>8}  exact")
        for name, r in rows.items():
            row = dict(model=model_name, plan=name, **r)
            all_rows.append(row)
            if r.get("error") and "exact" not in r:
                print(f"{name:<34}  not formed: {r['error'][:90]}")
                continue
            m = r.get("s_per_step")
            err = f"{r['predicted_s'] / m - 1:+8.0%}" if m else f"{'-':>8}"
            print(f"{name:<34}{r['predicted_s']:>10.3f}{m if m else float('nan'):>10.3f}{err}  "
                  + ("yes" if r.get("exact") else f"NO: {r.get('error')}"))
        summary[model_name] = figures([x for x in all_rows if x["model"] == model_name])
    summary["all"] = figures(all_rows)
    for k, f in summary.items():
        if "spearman" in f:
            print(f"fidelity {k}: {f['plans']} plans, Spearman {f['spearman']:.2f}, median |error| "
                  f"{f['median_abs_err']:.0%}, max {f['max_abs_err']:.0%}")
    return {"summary": summary, "rows": all_rows}


def plot(rows, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    pts = [r for r in rows if r.get("s_per_step") and r.get("predicted_s")]
    if not pts:
        return False
    fig, ax = plt.subplots(figsize=(7, 6))
    for model, mark in (("gpt", "o"), ("llama", "s"), ("zoo gpt2", "^"), ("zoo llama", "v"), ("zoo qwen2", "D")):
        mine = [r for r in pts if r["model"] == model]
        ax.scatter([r["predicted_s"] for r in mine], [r["s_per_step"] for r in mine], marker=mark, label=model)
        for r in mine:
            ax.annotate(r["plan"], (r["predicted_s"], r["s_per_step"]), fontsize=6)
    top = max(max(r["predicted_s"], r["s_per_step"]) for r in pts) * 1.05
    ax.plot([0, top], [0, top], "k:", lw=1)
    ax.set_xlabel("predicted s/step")
    ax.set_ylabel("measured s/step (median, slowest rank)")
    ax.set_title("autopar cost model: predicted vs measured, 4 gloo ranks")
    ax.legend()
    return save_figure(plt, fig, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["gpt", "llama", "both", "none"], default="both")
    p.add_argument("--zoo", default="gpt2,llama,qwen2", help="the zoo's models (benchmarks/zoo.py) too, each plan "
                   "alone; '' for none")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (2 keeps `make bench` near 15 min)")
    p.add_argument("--round-steps", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (to try the driver in seconds)")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args()
    from autopar.runtime.launch import spawn

    names = {"both": ["gpt", "llama"], "none": []}.get(a.model, [a.model])
    shapes = TINY if a.tiny else SHAPES
    zoo_names = [n for n in a.zoo.split(",") if n]
    opts = dict(models=names, shapes={n: shapes[n] for n in names}, rounds=a.rounds, round_steps=a.round_steps, zoo=zoo_names)
    print(f"cost-model fidelity on {a.ranks} gloo ranks, {os.cpu_count()} cores, torch {torch.__version__}: "
          f"{len(CASES)} plans per built-in model, {a.rounds} rounds x {a.round_steps} steps; {len(ZOO_CASES)} plans "
          f"per zoo model ({', '.join(zoo_names) or 'none'}), each alone", flush=True)
    t0 = time.perf_counter()
    res = spawn(rank_main, a.ranks, args=(opts,), timeout_s=3600)[0] if names else {}
    if zoo_names:
        import zoo

        with tempfile.TemporaryDirectory() as refs:
            opts["refs"] = zoo.saved_references(zoo_names, refs)
            res.update({f"zoo {k}": v for k, v in spawn(zoo_main, a.ranks, args=(opts,), timeout_s=3600)[0].items()})
    wall = time.perf_counter() - t0
    out = report(res)
    out["meta"] = dict(ranks=a.ranks, rounds=a.rounds, round_steps=a.round_steps, torch=torch.__version__,
                       cores=os.cpu_count(), wall_s=wall, tiny=a.tiny, shapes=opts["shapes"])
    path = Path(a.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "fidelity.json").write_text(json.dumps(out, indent=1, default=str))
    if plot(out["rows"], path / "fidelity.png"):
        print(f"wrote {path / 'fidelity.png'}")
    print(f"wrote {path / 'fidelity.json'}; {wall:.0f} s wall for the ranks")


if __name__ == "__main__":
    main()
