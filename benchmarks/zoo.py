"""Models nobody tuned autopar for: transformers causal LMs built from default-style configs with their
real vocabularies, trained by autopar's default against the layouts a person writes with PyTorch's own
APIs, on local gloo ranks. Every variant is checked exact per tensor before it is timed.

    .venv/bin/python benchmarks/zoo.py [--models gpt2,llama,qwen2] [--ranks 4] [--rounds 6] [--only SUBSTR,...]

Models (batch 8 x 128, dropout off so that every variant can be checked against one process):

    gpt2    GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4)): the README's quick start,
            16.3M parameters, 12.9M of them the 50,257-token embedding tied to the head
    llama   LlamaForCausalLM: 32,000 tokens, hidden 256, 4 layers, 4 heads (2 key/value), untied head
    qwen2   Qwen2ForCausalLM: 151,936 tokens, hidden 256, 4 layers, 4 heads (2 key/value), tied

Variants, each stepping the quick start's loop (forward, backward, ``clip_grad_norm_(1.0)``, AdamW
lr 3e-4, ``zero_grad``):

    ddp                torch DDP, each rank its quarter of the batch (the loss made from the logits)
    ddp-zero1          DDP with ``ZeroRedundancyOptimizer`` (optimizer states sharded)
    fsdp2              ``fully_shard`` on every decoder layer and the root (ZeRO-3)
    fsdp2-keep         the same with ``reshard_after_forward=False`` (parameters kept between
                       forward and backward: ZeRO-2's traffic)
    dp2-tp2            torch tensor parallel on a (2, 2) mesh (Megatron column/row on attention and
                       MLP, a vocabulary-parallel embedding and head with ``loss_parallel``),
                       gradients all-reduced over dp; where the model's projections are ``nn.Linear``
                       (GPT-2's ``Conv1D`` are not: skipped, said why)
    autopar            ``autopar.parallelize(model, Mesh((4,)), example_kwargs=batch)``, every option at
                       its default, the plain loop (``pmodel(**batch).loss``) and ``train_step``

Phase 1 builds each hand variant alone: its first step is checked (the loss and every gradient,
per tensor, against one process: within 1e-5 of the tensor's largest entry, or 10x the reference's
own float32 rounding where a gradient is zero in exact arithmetic), its next two steps' losses too
(clipping and AdamW included), then it is timed for ``--steps`` steps and closed. Phase 2 keeps
autopar's default (both paths), DDP, FSDP2 and the fastest other hand layout alive together and
times them in ``--rounds`` alternating rounds of 2 steps (the order rotating). A step is timed between
barriers, the slowest rank's; a figure is the median. autopar's first ``parallelize`` of each model
runs on an empty profile cache: ``parallelize_s`` is its first-contact time.

Output: a table per model, benchmarks/results/zoo.json and benchmarks/results/zoo.png (measured bars,
predicted marks; needs matplotlib: ``make bench``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid import gathered, pyplot, save_figure, slowest  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, SEQ = 8, 128
LR, MAX_NORM = 3e-4, 1.0
TOL, NOISE_FACTOR = 1e-5, 10.0
CHECK_STEPS = 3
MODELS = ("gpt2", "llama", "qwen2")


# ---- models ---------------------------------------------------------------------------------------
def build(name: str, dtype=torch.float32):
    """(model, vocabulary) of zoo model ``name``, the same weights every call."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(cfg)
    elif name == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown zoo model {name!r}; choose from {MODELS}")
    model.config.use_cache = False
    return model.to(dtype), model.config.vocab_size


def batches(vocab: int, steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, vocab, (BATCH, SEQ), generator=g),
             "labels": torch.randint(0, vocab, (BATCH, SEQ), generator=g)} for _ in range(steps)]


def causal_loss(logits, labels):
    """transformers' causal LM loss: token t predicts label t + 1, the mean over the batch."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1))


def decoder_layers(model) -> list[nn.Module]:
    return list(model.transformer.h) if hasattr(model, "transformer") else list(model.model.layers)


def reference(name: str) -> dict:
    """One process: the first step's loss and gradients in float32 and float64 (the rounding a
    float32 gradient carries), and the losses of ``CHECK_STEPS`` clipped AdamW steps."""
    out = {}
    for dtype in (torch.float64, torch.float32):
        model, vocab = build(name, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for i, b in enumerate(batches(vocab, CHECK_STEPS)):
            loss = model(**b).loss
            loss.backward()
            if i == 0:
                out[dtype] = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if dtype == torch.float32:
            out["losses"] = losses
    return {"grads": out[torch.float32], "noise": {n: (g - out[torch.float64][n]).abs().max().item()
                                                    for n, g in out[torch.float32].items()}, "losses": out["losses"]}


def saved_references(names, directory) -> dict[str, str]:
    """``reference`` of each model, made in this process before the ranks start and saved under
    ``directory`` (rank 0 loads its model's): a rank that ran them would carry its allocator's
    history of a float64 run into every step timed after it (rank 0 stepped ~8% slower)."""
    paths = {}
    for n in names:
        t0 = time.perf_counter()
        paths[n] = str(Path(directory) / f"{n}.pt")
        torch.save(reference(n), paths[n])
        print(f"{n}: reference {time.perf_counter() - t0:.1f} s", flush=True)
    return paths


def judge(grads: dict, losses: list[float], ref: dict) -> dict:
    """Per tensor: within TOL of its largest entry, or NOISE_FACTOR x the reference's own rounding;
    the losses within TOL relative."""
    worst, worst_name = 0.0, None
    for n, want in ref["grads"].items():
        got = grads.get(n)
        if got is None or got.shape != want.shape:
            return {"exact": False, "error": f"no gradient of {n}" if got is None else f"{n} has shape {tuple(got.shape)}"}
        err = (got.float() - want).abs().max().item()
        allowed = max(TOL * want.abs().max().item(), NOISE_FACTOR * ref["noise"][n])
        if err / max(allowed, 1e-30) > worst:
            worst, worst_name = err / max(allowed, 1e-30), n
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    error = (f"gradient of {worst_name} {worst:.1f}x its allowance" if worst > 1
             else f"losses {losses} vs {ref['losses']}" if loss_err > TOL else None)
    return {"exact": error is None, "error": error, "grad_allowance_used": worst, "loss_err": loss_err}


# ---- hand-written layouts --------------------------------------------------------------------------
HAND = ("ddp", "ddp-zero1", "fsdp2", "fsdp2-keep", "dp2-tp2")


def why_not(kind: str, name: str, world: int) -> str | None:
    if kind == "dp2-tp2":
        if world != 4:
            return "needs 4 ranks"
        if name == "gpt2":
            return "GPT-2's projections are transformers Conv1D, which torch's tensor-parallel styles do not take"
    return None


class Hand:
    """A hand-written layout of zoo model ``name`` inside one rank: ``step(batch)`` (the whole loop;
    returns the loss), ``first(batch)`` (forward and backward only), ``full_grads()`` (rank 0),
    ``finish()`` (clip, AdamW step, zero_grad), ``close()``."""

    def __init__(self, kind: str, name: str, rank: int, world: int):
        from torch.distributed.device_mesh import init_device_mesh

        self.kind, self.rank, self.world = kind, rank, world
        model, self.vocab = build(name)
        self.model = model
        self.dp, self.tp = (2, 2) if kind == "dp2-tp2" else (world, 1)
        self.dp_rank = rank // self.tp
        self.dp_group = None
        if kind in ("ddp", "ddp-zero1"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.module = DDP(model)
        elif kind in ("fsdp2", "fsdp2-keep"):
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh, reshard_after_forward=kind == "fsdp2")
            fully_shard(model, mesh=mesh, reshard_after_forward=kind == "fsdp2")
            self.module = model
        else:  # dp2-tp2
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            self.tp_mesh, self.dp_group = mesh["tp"], mesh["dp"].get_group()
            self._tensor_parallel(model, self.tp_mesh)
            self.module = model
        self.named = list(model.named_parameters())  # (after the wrapping: torch's modules keep the names)
        params = [p for _, p in self.named]
        self.params = params
        if kind == "ddp-zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            self.opt = torch.optim.AdamW(params, lr=LR)

    @staticmethod
    def _tensor_parallel(model, tp_mesh) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(len(model.model.layers)):
            pre = f"model.layers.{i}"
            plan.update({f"{pre}.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
            plan[f"{pre}.self_attn.o_proj"] = RowwiseParallel()
            plan.update({f"{pre}.mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
            plan[f"{pre}.mlp.down_proj"] = RowwiseParallel()
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        parallelize_module(model, tp_mesh, plan)
        if tied:  # both were split by rows (vocabulary); tie the two DTensors again
            model.lm_head.weight = model.model.embed_tokens.weight

    def _rows(self, b: dict) -> dict:
        per = BATCH // self.dp
        return {k: v[self.dp_rank * per:(self.dp_rank + 1) * per] for k, v in b.items()}

    def first(self, b: dict) -> float:
        """Forward and backward of the global batch; gradients synchronised; the global mean loss."""
        mine = self._rows(b)
        if self.kind == "dp2-tp2":
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss = causal_loss(self.module(input_ids=mine["input_ids"]).logits, mine["labels"])
                loss.backward()
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            self._all_reduce_over_dp()
        else:
            loss = causal_loss(self.module(input_ids=mine["input_ids"]).logits, mine["labels"])
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / self.world

    @torch.no_grad()
    def _all_reduce_over_dp(self) -> None:
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp
        at = 0
        for g in grads:
            g.copy_(flat[at: at + g.numel()].view_as(g))
            at += g.numel()

    def finish(self) -> None:
        if self.kind == "dp2-tp2":
            self._clip_tp()
        else:
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def _clip_tp(self) -> None:
        """Megatron's global-norm clipping: split gradients counted by their shards, replicated ones
        by tensor-parallel rank 0, the squares summed over the tp group (torch's clip_grad_norm_
        refuses a mix of DTensor and plain gradients)."""
        from torch.distributed.tensor import Replicate

        total = torch.zeros((), dtype=torch.float64)
        first = self.tp_mesh.get_local_rank() == 0
        for p in self.params:
            g = p.grad
            if g is None:
                continue
            split = hasattr(g, "placements") and any(not isinstance(pl, Replicate) for pl in g.placements)
            if split or first:
                local = g.to_local() if hasattr(g, "to_local") else g
                total += local.double().pow(2).sum()
        dist.all_reduce(total, group=self.tp_mesh.get_group())
        coef = min(1.0, MAX_NORM / (total.sqrt().item() + 1e-6))
        for p in self.params:
            if p.grad is not None:
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)

    def step(self, b: dict) -> float:
        loss = self.first(b)
        self.finish()
        return loss

    @torch.no_grad()
    def full_grads(self) -> dict:
        out = {}
        for n, p in self.named:
            g = p.grad
            if hasattr(g, "full_tensor"):
                g = g.full_tensor()  # (a collective: every rank)
            out[n] = g.detach().clone()
        return out if self.rank == 0 else {}

    def close(self) -> None:
        for attr in ("module", "model", "params", "named", "opt"):
            if hasattr(self, attr):
                delattr(self, attr)


class Autopar:
    """autopar's default on a (world,) mesh: ``step`` runs the plain loop, ``train_step`` the fast path."""

    def __init__(self, name: str, rank: int, world: int, cache: str):
        import autopar

        os.environ["AUTOPAR_CACHE_DIR"] = cache  # empty: the first contact a new user sees
        model, self.vocab = build(name)
        b = batches(self.vocab, 1)[0]
        dist.barrier()
        t0 = time.perf_counter()
        self.pm = autopar.parallelize(model, autopar.Mesh((world,)), example_kwargs=b)
        self.parallelize_s = time.perf_counter() - t0
        self.plan = self.pm.plan
        self.predicted_s = self.plan.predicted["step_time_s"]
        self.rank = rank
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=LR)

    def describe(self) -> str:
        from autopar.solver.explain import layout_words

        p = self.plan.pipeline
        staged = p is not None and len(p.stages) > 1
        return layout_words(self.plan) + (f", {p.schedule}, {p.microbatches} microbatches" if staged else "")

    def first(self, b: dict) -> float:
        loss = self.pm(**b).loss
        loss.backward()
        return loss.item()

    def finish(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.pm.parameters(), MAX_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, b: dict) -> float:
        loss = self.first(b)
        self.finish()
        return loss

    def train_step(self, b: dict) -> float:
        loss = self.pm.train_step(**b).item()
        self.finish()
        return loss

    def full_grads(self) -> dict:
        grads = self.pm.full_grads()
        return {k: g for k, g in grads.items() if g is not None} if self.rank == 0 else {}

    def close(self) -> None:
        for attr in ("pm", "opt", "plan"):
            if hasattr(self, attr):
                delattr(self, attr)


# ---- inside each rank -------------------------------------------------------------------------------
def _say(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def checked(v, ref, vocab: int) -> dict:
    """The variant's first ``CHECK_STEPS`` steps against one process (``judge``), on every rank."""
    bs = batches(vocab, CHECK_STEPS)
    losses = [v.first(bs[0])]
    grads = v.full_grads()
    v.finish()
    losses += [v.step(b) for b in bs[1:]]
    verdict = [judge(grads, losses, ref) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def timed(fn, b) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(b)
    dist.barrier()
    return time.perf_counter() - t0


def rank_main(rank, world, opts):
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    out = {}
    for name in opts["models"]:
        ref = torch.load(opts["refs"][name]) if rank == 0 else None
        vocab = build(name)[1]
        b = batches(vocab, 1)[0]
        dist.barrier()
        _say(f"{name}: phase 1")
        rows = {}
        for kind in HAND:
            if opts["only"] and not any(s in kind for s in opts["only"]):
                continue
            why = why_not(kind, name, world)
            if why:
                rows[kind] = {"skipped": why}
                continue
            v = Hand(kind, name, rank, world)
            verdict = checked(v, ref, vocab)
            times = [timed(v.step, b) for _ in range(opts["steps"])] if verdict["exact"] else []
            v.close()
            del v
            gc.collect()
            steps = slowest(gathered(times)) if times else []
            rows[kind] = dict(verdict, s_per_step=statistics.median(steps) if steps else None, step_times=steps)
            _say(f"  {kind:<12}" + (f"{rows[kind]['s_per_step']:7.3f} s/step" if steps else f"NOT EXACT: {verdict['error']}"))
        # phase 2
        with tempfile.TemporaryDirectory() as cache:
            cache = gathered(cache)[0]  # rank 0's (empty) directory, for every rank
            ap = Autopar(name, rank, world, cache)
            info = {"autopar": dict(checked(ap, ref, vocab), parallelize_s=max(gathered(ap.parallelize_s)),
                                    predicted_s=ap.predicted_s, plan=ap.describe())}
            if not info["autopar"]["exact"] and rank == 0:  # kept to run again: autopar.parallelize(plan=...)
                opts["out"].mkdir(parents=True, exist_ok=True)
                ap.plan.save(opts["out"] / f"zoo-{name}-not-exact-plan.json")
            _say(f"  autopar     plan: {info['autopar']['plan']}; first contact {info['autopar']['parallelize_s']:.1f} s; "
                 f"predicted {ap.predicted_s:.3f} s; exact: {info['autopar']['exact']} {info['autopar']['error'] or ''}")
            hands = sorted((k for k, r in rows.items() if r.get("s_per_step")), key=lambda k: rows[k]["s_per_step"])
            keep = [k for k in ("ddp", "fsdp2") if k in hands] + [k for k in hands if k not in ("ddp", "fsdp2")][:1]
            variants = {k: Hand(k, name, rank, world) for k in keep}
            for v in variants.values():
                v.step(b)  # warm-up (checked in phase 1)
            fns = {k: v.step for k, v in variants.items()}
            if info["autopar"]["exact"]:
                fns["autopar"], fns["autopar train_step"] = ap.step, ap.train_step
            names = list(fns)
            times = {n: [] for n in names}
            for r in range(opts["rounds"]):
                for n in names[r % len(names):] + names[: r % len(names)]:
                    times[n] += [timed(fns[n], b) for _ in range(2)]
            for v in variants.values():
                v.close()
            ap.close()
            variants.clear()
            gc.collect()
            per_rank = gathered(times)
        phase2 = {}
        for n in names:
            steps = slowest([p[n] for p in per_rank])
            phase2[n] = {"s_per_step": statistics.median(steps), "step_times": steps}
        out[name] = {"phase1": rows, "phase2": phase2, "autopar": info["autopar"]}
        dist.barrier()
    return out if rank == 0 else None


# ---- report ------------------------------------------------------------------------------------------
def report(name: str, res: dict) -> dict:
    p1, p2, ap = res["phase1"], res["phase2"], res["autopar"]
    model, vocab = build(name)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n{name} ({n_params / 1e6:.1f}M parameters, vocabulary {vocab}): phase 1, each layout alone")
    for kind, r in p1.items():
        if r.get("skipped"):
            print(f"  {kind:<20} skipped: {r['skipped']}")
        else:
            s = r.get("s_per_step")
            print(f"  {kind:<20}" + (f"{s:7.3f} s/step  exact" if s else f"NOT EXACT: {r['error']}"))
    ddp = p2.get("ddp", {}).get("s_per_step")
    hands = {k: v["s_per_step"] for k, v in p2.items() if not k.startswith("autopar")}
    best = min(hands, key=hands.get) if hands else None
    print(f"{name}: phase 2, alternating rounds")
    for n, r in p2.items():
        print(f"  {n:<20}{r['s_per_step']:7.3f} s/step" + (f"  {r['s_per_step'] / ddp:.2f}x DDP" if ddp else "")
              + (f"  {r['s_per_step'] / hands[best]:.2f}x best hand ({best})" if best else ""))
    summary = {"n_params": n_params, "vocab": vocab, "ddp_s": ddp, "best_hand": best,
               "best_hand_s": hands.get(best), "plan": ap["plan"], "predicted_s": ap["predicted_s"],
               "parallelize_s": ap["parallelize_s"], "exact": ap["exact"]}
    for n in ("autopar", "autopar train_step"):
        if n in p2:
            s = p2[n]["s_per_step"]
            summary[n] = {"s_per_step": s, "vs_ddp": s / ddp if ddp else None,
                          "vs_best_hand": s / hands[best] if best else None,
                          "predicted_over_measured": ap["predicted_s"] / s}
            print(f"{n} {name}: {s:.3f} s/step = {s / ddp:.2f}x DDP, {s / hands[best]:.2f}x best hand; predicted "
                  f"{ap['predicted_s']:.3f} ({ap['predicted_s'] / s - 1:+.0%}); {ap['plan']}; first contact "
                  f"{ap['parallelize_s']:.1f} s")
    return summary


def plot(summaries: dict, results: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    names = list(summaries)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    for ax, n in zip(axes[0], names):
        p2 = results[n]["phase2"]
        labels = list(p2)
        vals = [p2[k]["s_per_step"] for k in labels]
        ax.barh(range(len(labels)), vals, color=["tab:red" if k.startswith("autopar") else "tab:blue" for k in labels])
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        pred = summaries[n]["predicted_s"]
        ax.axvline(pred, color="tab:red", ls=":", lw=1)
        ax.text(pred, len(labels) - 0.5, " predicted", color="tab:red", fontsize=7, va="top")
        ax.invert_yaxis()
        ax.set_xlabel("s/step (median, slowest rank)")
        ax.set_title(f"{n}: vocabulary {summaries[n]['vocab']}", fontsize=9)
    return save_figure(plt, fig, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per hand layout in phase 1")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds (2 steps each) in phase 2")
    p.add_argument("--only", default="", help="comma-separated substrings: the hand layouts to run")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args()
    from autopar.runtime.launch import spawn

    names = [n for n in a.models.split(",") if n]
    opts = dict(models=names, steps=a.steps, rounds=a.rounds, only=[s for s in a.only.split(",") if s], out=Path(a.out))
    print(f"zoo on {a.ranks} gloo ranks (1 thread each), {platform.processor() or platform.machine()} with "
          f"{os.cpu_count()} cores, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as refs:
        opts["refs"] = saved_references(names, refs)
        t0 = time.perf_counter()
        res = spawn(rank_main, a.ranks, args=(opts,), timeout_s=7200)[0]
        wall = time.perf_counter() - t0
    summaries = {n: report(n, res[n]) for n in names}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(ranks=a.ranks, steps=a.steps, rounds=a.rounds, torch=torch.__version__, cores=os.cpu_count(), wall_s=wall,
                commit=os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip(), date=time.strftime("%Y-%m-%d"))
    (out / "zoo.json").write_text(json.dumps({"meta": meta, "summary": summaries, "results": res}, indent=1, default=str))
    if plot(summaries, res, out / "zoo.png"):
        print(f"wrote {out / 'zoo.png'}")
    print(f"wrote {out / 'zoo.json'}; {wall:.0f} s wall for the ranks")


if __name__ == "__main__":
    main()
