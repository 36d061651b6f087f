"""Colossal-AI's own ``HybridParallelPlugin`` as a second hand-tuned baseline, next to autopar, on
local CPU gloo ranks: a small transformers GPT-2, every tp x pp x dp layout a user would configure
by hand, checked exact against one process, then timed in alternating rounds.

    .venv-colossalai/bin/python benchmarks/colossalai_bench.py [--rounds 3] [--round-steps 2]
                                                               [--only SUBSTR,...] [--tiny]

Needs colossalai 0.5.0 next to a CPU torch (``make bench-colossalai`` builds ``.venv-colossalai``:
colossalai pins torch<=2.5.1, for which no CPU build is reachable here, so it is installed without
its dependencies next to torch 2.13 and only what its imports touch; see the Makefile).

Everything runs inside one spawn of ``--ranks`` processes (one torch thread each):

    1. rank 0 runs the single-process model: first-step loss and every gradient, in fp32 (and the
       first-step loss of a bfloat16 copy, for the ZeRO configurations, below).
    2. every configuration of the grid, one after the other: ``HybridParallelPlugin(tp_size,
       pp_size, zero_stage, num_microbatches, pp_style, num_model_chunks)`` and ``Booster.boost`` of
       the same seeded model with ``torch.optim.AdamW``; its first step (forward, backward, gradient
       sync; ``booster.execute_pipeline`` for pipelines) is checked: the global mean loss within
       1e-5 relative of one process, and every full gradient (tensor-parallel shards gathered,
       pipeline stages merged) within 1e-5 relative; then the AdamW step. That first step is the
       warm-up. A configuration the plugin refuses or that fails is skipped with the reason; one
       that is not exact is reported and not timed. The exact ones stay alive for step 4.
    3. autopar's plans of the same model in the same processes: ``autopar.parallelize`` on
       ``Mesh((4,))``, the one-stage plan (``pipeline=False``) and the default ``pipeline="auto"``,
       in fp32 and in bf16 (``precision="bf16"``: bf16 compute on fp32 masters, gradients summed
       in fp32; and, the plugin's recipe whole, summed in bf16: ``MixedPrecision(torch.bfloat16,
       reduce_dtype=torch.bfloat16)``), trained with ``pmodel.train_step`` and ``torch.optim.AdamW(pmodel.parameters())``,
       checked the same way as the plugin's rows of their precision.
    4. ``--rounds`` alternating rounds (the order rotates each round) of ``--round-steps`` steps of
       every live variant; every step is bracketed by barriers, its time is the slowest rank's,
       and a variant's figure is the median of its steps.

ZeRO: the plugin refuses ``zero_stage > 0`` in fp32 ("Please set precision to 'fp16' or 'bf16' when
using ZeRO"), so the ZeRO configurations run in bfloat16 (the plugin's mixed precision: bf16
working weights, fp32 master weights in the optimizer). They cannot be exact against fp32; their
first-step loss is checked against a bfloat16 copy of the single-process model within
``BF16_TOL`` (their gradients live in ZeRO's flat shards and are not compared), they are timed,
and the table marks them bf16. The best plugin figure autopar is compared with is the best fp32
(exact) configuration; an autopar bf16 plan is compared with the best plugin bf16 configuration
and with autopar's fp32 plan of the same request.

Shims for CPU (monkeypatches in this process, nothing in site-packages is edited), see ``shim``.

Output: a table (config, s/step, ratio to the best plugin configuration), the skipped
configurations and why, and benchmarks/results/colossalai.json (one row per configuration and
autopar plan; the autopar/best-plugin ratios; the versions of torch, colossalai and transformers).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
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
from autopar_variant import AutoparVariant  # noqa: E402
from hybrid import timed_step  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = dict(vocab=8192, width=256, layers=8, heads=8, seq=128, batch=16)
TINY = dict(vocab=256, width=32, layers=8, heads=4, seq=16, batch=16)  # vocab: a multiple of 64 x tp
LR = 1e-3
BF16_SUMS = "bf16, bf16 sums"  # an autopar variant: MixedPrecision(bf16, reduce_dtype=bf16)
TOL = 1e-5
BF16_TOL = 2e-2  # a bfloat16 first-step loss against a bfloat16 single-process copy (8-bit mantissa)
CHUNKS = 2  # model chunks per rank under the interleaved schedule


# ---- shims: Colossal-AI 0.5.0 on a CPU build of torch 2.13 ----------------------------------------
def shim() -> None:
    """Fill the gaps between Colossal-AI 0.5.0 (written for CUDA and torch <= 2.5.1) and a CPU
    build of torch 2.13, in this process only:

    - ``CpuAccelerator.get_rng_state`` passes a device to ``torch.get_rng_state()``, which takes
      none; ``manual_seed`` raises. Shardformer's layers call both (their dropout randomizers).
    - ``colossalai/pipeline/p2p.py`` calls ``torch.distributed.is_hccl_available``, absent from
      CPU builds.
    - the GPT-2 pipeline forward calls ``torch.cuda.set_device`` before every block.
    - ``LowLevelZeroOptimizer._sanity_checks`` (ZeRO) asserts a CUDA or NPU accelerator; the
      check is kept without that assert.
    - ZeRO's gradient buckets make a ``Stream()`` each and reduce inside
      ``stream(current_stream())``, which ``CpuAccelerator`` raises on: on the CPU there is one
      stream, so ``Stream``/``current_stream`` give None and ``stream(s)`` is a no-op context
      (ZeRO's ``overlap_communication``, which would need a second stream, is off).
    """
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    CpuAccelerator.get_rng_state = lambda self, device=None: torch.get_rng_state()
    CpuAccelerator.manual_seed = lambda self, seed: torch.manual_seed(seed)
    CpuAccelerator.manual_seed_all = lambda self, seed: torch.manual_seed(seed)
    CpuAccelerator.Stream = lambda self, *a, **k: None
    CpuAccelerator.current_stream = lambda self, device=None: None
    CpuAccelerator.stream = lambda self, stream: contextlib.nullcontext()
    if not hasattr(dist, "is_hccl_available"):
        dist.is_hccl_available = lambda: False
    if not torch.cuda.is_available():
        torch.cuda.set_device = lambda device: None

    def sanity_checks(self):
        for group in self.optim.param_groups:
            for p in group["params"]:
                if not getattr(p, "skip_zero_check", False):
                    assert p.dtype == self._dtype, f"parameters are expected in {self._dtype}, got {p.dtype}"

    LowLevelZeroOptimizer._sanity_checks = sanity_checks


# ---- the model --------------------------------------------------------------------------------
def build_model(kw: dict):
    """The seeded GPT2LMHeadModel (tied embedding and head, no dropout, eager attention: with SDPA
    Colossal-AI's GPT-2 forward loses the causal mask) and the global batch: the keywords of a
    call, input ids = labels (the model shifts them) and an attention mask of ones (Colossal-AI's
    GPT-2 forward needs one)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=kw["vocab"], n_embd=kw["width"], n_layer=kw["layers"], n_head=kw["heads"],
                                  n_positions=kw["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, kw["vocab"], (kw["batch"], kw["seq"]), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def reference(kw: dict) -> dict:
    """The single-process first step: loss and gradients in fp32, and a bfloat16 copy's loss."""
    model, batch = build_model(kw)
    half = copy.deepcopy(model).to(torch.bfloat16)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        bf16 = half(**batch).loss.item()
    return {"loss": loss.item(), "grads": grads, "bf16_loss": bf16}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (inf when the shapes differ)."""
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


# ---- the configurations -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class CaiConfig:
    """One ``HybridParallelPlugin`` configuration on tp * pp * dp ranks."""

    tp: int = 1
    """tp_size: shardformer's Megatron-style tensor parallelism (vocabulary-parallel embedding/head)."""
    pp: int = 1
    """pp_size: pipeline stages over ranks."""
    dp: int = 1
    """The rest of the ranks: data parallel (torch DDP at zero 0 without pipeline)."""
    zero: int = 0
    """zero_stage: 0, or 1 (optimizer states sharded over dp; the plugin needs fp16/bf16 for it)."""
    microbatches: int = 1
    """num_microbatches (pp > 1)."""
    style: str | None = None
    """pp_style: "1f1b" or "interleaved" (num_model_chunks=2, overlap_p2p=False on gloo)."""

    @property
    def precision(self) -> str:
        return "bf16" if self.zero else "fp32"

    @property
    def name(self) -> str:
        s = f"tp{self.tp}-pp{self.pp}-dp{self.dp}"
        if self.dp > 1:
            s += f"-zero{self.zero}"
        if self.pp > 1:
            s += f"-{self.style}-mb{self.microbatches}"
        return s

    def plugin_kwargs(self) -> dict:
        kw = dict(tp_size=self.tp, pp_size=self.pp, zero_stage=self.zero, precision=self.precision,
                  overlap_communication=False,  # ZeRO's overlap needs CUDA streams
                  enable_all_optimization=False)  # fused kernels (apex, flash attention) are CUDA-only
        if self.pp > 1:
            kw.update(num_microbatches=self.microbatches, pp_style=self.style)
            if self.style == "interleaved":
                kw.update(num_model_chunks=CHUNKS, overlap_p2p=False)  # overlapped p2p deadlocks on gloo
        return kw


def enumerate_grid(world: int, kw: dict) -> list[tuple[CaiConfig, str | None]]:
    """Every configuration a user would write by hand on ``world`` ranks, with the reason it cannot
    run (None: it can)."""
    out = []
    for pp in (1, 2, 4):
        for tp in (1, 2, 4):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            bad = [f"{k} ({kw[k]}) not divisible by tp ({tp})" for k in ("heads", "width", "vocab") if kw[k] % tp]
            if kw["batch"] % dp:
                bad.append(f"global batch ({kw['batch']}) not divisible by dp ({dp})")
            for zero in ((0, 1) if dp > 1 else (0,)):
                if pp == 1:
                    out.append((CaiConfig(tp=tp, dp=dp, zero=zero), "; ".join(bad) or None))
                    continue
                for style in ("1f1b", "interleaved"):
                    for mb in (pp, 2 * pp):
                        cfg = CaiConfig(tp=tp, pp=pp, dp=dp, zero=zero, microbatches=mb, style=style)
                        why = list(bad)
                        if (kw["batch"] // dp) % mb:
                            why.append(f"local batch ({kw['batch'] // dp}) not divisible by microbatches ({mb})")
                        stages = pp * (CHUNKS if style == "interleaved" else 1)
                        if kw["layers"] % stages:
                            why.append(f"layers ({kw['layers']}) not divisible by stages ({stages})")
                        out.append((cfg, "; ".join(why) or None))
    return out


# ---- one configuration inside one rank --------------------------------------------------------
class CaiVariant:
    """``HybridParallelPlugin`` + ``Booster`` on this rank: ``forward_backward()`` (the global mean
    loss, gradients synchronised), ``full_grads()``, ``optimizer_step()``, ``step()``."""

    def __init__(self, cfg: CaiConfig, kw: dict):
        from colossalai.booster import Booster
        from colossalai.booster.plugin import HybridParallelPlugin

        self.cfg = cfg
        self.plugin = HybridParallelPlugin(**cfg.plugin_kwargs())
        model, batch = build_model(kw)
        dp_rank = self.plugin.pg_mesh.coordinate(self.plugin.dp_axis)
        per = kw["batch"] // cfg.dp
        self.batch = {k: t[dp_rank * per: (dp_rank + 1) * per].contiguous() for k, t in batch.items()}
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.booster = Booster(plugin=self.plugin)
        self.model, self.opt, self.criterion, _, _ = self.booster.boost(model, opt, criterion=lambda out, batch: out.loss)
        self.tp_rank = dist.get_rank(self.plugin.tp_group)

    def forward_backward(self) -> float:
        if self.cfg.pp == 1:
            loss = self.criterion(self.model(**self.batch), self.batch)
            self.booster.backward(loss, self.opt)
        else:
            out = self.booster.execute_pipeline(iter([self.batch]), self.model, self.criterion, self.opt,
                                                return_loss=True)
            loss = out["loss"]
        buf = torch.zeros(2)
        if loss is not None and self.tp_rank == 0:  # the last stage's (or every) dp slice's mean
            buf[0], buf[1] = loss.detach().float(), 1.0
        dist.all_reduce(buf)
        return (buf[0] / buf[1]).item()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def step(self) -> float:
        loss = self.forward_backward()
        self.optimizer_step()
        return loss

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every full gradient under the original names, on rank 0 ({} elsewhere); a collective.
        Tensor-parallel shards are gathered over the tp group (the fused q/k/v weight of GPT-2
        reordered from [q_r, k_r, v_r] per rank), padded vocabulary rows dropped by the caller,
        pipeline stages merged (the head tied to the embedding is the embedding's gradient)."""
        from colossalai.tensor.d_tensor.api import is_customized_distributed_tensor, is_distributed_tensor, to_global
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = self.model.unwrap()
        if isinstance(module, DDP):
            module = module.module
        fused = {id(getattr(m, a)): m.split_sizes for m in module.modules() if hasattr(m, "split_sizes")
                 for a in ("weight", "bias") if getattr(m, a, None) is not None}
        mine = {}
        for name, p in module.named_parameters():
            if p.grad is None or p.numel() == 0:
                continue
            g = p.grad.detach()
            if is_distributed_tensor(p):
                g = g.clone()
                g.dist_layout = p.dist_layout
                g = to_global(g)
            elif is_customized_distributed_tensor(p):  # GPT-2's Conv1D column split per fused part
                g = _gather_fused(g, fused[id(p)], self.plugin.tp_group)
            mine["transformer.wte.weight" if name == "lm_head.weight" else name] = g.clone()
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, mine)
        if dist.get_rank() != 0:
            return {}
        out = {}
        for d in everything:
            for k, v in d.items():
                out.setdefault(k, v)
        return out

    def close(self) -> None:
        for attr in ("model", "opt", "booster", "criterion"):
            if hasattr(self, attr):
                delattr(self, attr)


def _gather_fused(g: torch.Tensor, split_sizes: list[int], group) -> torch.Tensor:
    """The full tensor of a column-split GPT-2 Conv1D (``GPT2FusedLinearConv1D_Col``: c_attn with
    split_sizes [C, C, C], c_fc with [4C]): rank r holds [q_r, k_r, v_r] along the last dim, the
    full tensor is [q_0 .. q_n, k_0 .. k_n, v_0 .. v_n] (Colossal-AI's own gather,
    ``gather_fused_qkv_in_gpt2_style``, moves the tensor to CUDA first)."""
    n = dist.get_world_size(group)
    parts = [torch.empty_like(g) for _ in range(n)]
    dist.all_gather(parts, g.contiguous(), group=group)
    pieces = [p.split([sz // n for sz in split_sizes], dim=-1) for p in parts]
    return torch.cat([pieces[r][i] for i in range(len(split_sizes)) for r in range(n)], dim=-1)



# ---- checking and timing, inside each rank ----------------------------------------------------
def check_first_step(v, ref: dict | None, *, bf16: bool) -> dict:
    """The variant's first step (which is also its warm-up), checked against ``ref`` on rank 0:
    fp32: the loss and every full gradient within TOL relative; bf16: the loss within BF16_TOL of
    the bfloat16 copy. Then the AdamW step. The same verdict on every rank: ``passed``, and
    ``exact`` (fp32; None for bf16), or ``failed`` (the error) when the step raised."""
    err = None
    try:
        loss = v.forward_backward()
        grads = {} if bf16 else v.full_grads()
    except Exception as e:  # a failure every rank meets alike (one stuck in a collective would hang)
        err = _why(e)
    err = _agree(err is None, err)
    if err:
        return {"failed": err}
    verdict = [None]
    if dist.get_rank() == 0:
        want = ref["bf16_loss"] if bf16 else ref["loss"]
        loss_err = abs(loss - want) / abs(want)
        grad_err, worst, error = None, None, None
        if not bf16:
            errs = {}
            for n, g in ref["grads"].items():
                got = grads.get(n)
                if got is not None and got.shape != g.shape and got.dim() == g.dim():  # padded vocabulary rows
                    got = got[tuple(slice(0, s) for s in g.shape)]
                errs[n] = rel(got, g) if got is not None else math.inf
            extra = sorted(set(grads) - set(ref["grads"]))
            worst = max(errs, key=errs.get)
            grad_err = errs[worst]
            if extra:
                error = f"gradients for unknown parameters {extra[:3]}"
            elif not grad_err <= TOL:
                error = f"gradient of {worst} off by {grad_err:.2e}"
        if error is None and not loss_err <= (BF16_TOL if bf16 else TOL):
            error = f"loss {loss:.6f} vs {want:.6f} ({loss_err:.2e})"
        verdict = [{"passed": error is None, "exact": None if bf16 else error is None, "loss": loss, "ref_loss": want,
                    "loss_err": loss_err, "grad_err": grad_err, "worst": worst, "error": error,
                    "check": f"bf16 loss vs a bf16 copy, tol {BF16_TOL}" if bf16 else f"fp32 loss + every gradient, tol {TOL}"}]
    dist.broadcast_object_list(verdict, src=0)
    v.optimizer_step()
    return verdict[0]


def alternate(variants: dict, rounds: int, round_steps: int) -> dict[str, list[float]]:
    """Slowest-rank step times of every variant over ``rounds`` alternating rounds (the order
    rotating each round) of ``round_steps`` steps, on every rank."""
    names = list(variants)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            times[n] += [timed_step(variants[n]) for _ in range(round_steps)]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, times)
    return {n: [max(ts) for ts in zip(*(t[n] for t in per_rank))] for n in names}


def _say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _why(e: BaseException) -> str:
    """The exception in one line, with the innermost frame inside colossalai."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "colossalai" in f.filename]
    where = f" (at {frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}{where}"


def _agree(ok: bool, err: str | None) -> str | None:
    """The first rank's error if any rank failed (the same answer on every rank)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, None if ok else err)
    return next((e for e in every if e), None)


def rank_main(rank, world, opts):
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # colossalai's logger and the DTensor redistribute chatter
    shim()
    kw = opts["shapes"]
    t0 = time.perf_counter()
    ref = reference(kw) if rank == 0 else None
    dist.barrier()
    _say(f"single-process reference {time.perf_counter() - t0:.1f} s (loss {ref['loss']:.6f})" if ref else "")
    rows, live = [], {}
    for cfg, why in enumerate_grid(world, kw):
        if opts["only"] and not any(s in cfg.name for s in opts["only"]):
            continue
        row = dict(config=cfg.name, kind="colossalai", precision=cfg.precision, **dataclasses.asdict(cfg))
        if why:
            rows.append(dict(row, skipped=why))
            _say(f"  {cfg.name:<36} skipped: {why}")
            continue
        t0 = time.perf_counter()
        err = None
        try:
            v = CaiVariant(cfg, kw)
        except Exception as e:  # the plugin refuses the configuration (the same on every rank)
            err = _why(e)
        err = _agree(err is None, err)
        if err:
            rows.append(dict(row, skipped=f"refused by the plugin: {err}"))
            _say(f"  {cfg.name:<36} skipped: refused by the plugin: {err}")
            continue
        build_s = time.perf_counter() - t0
        verdict = check_first_step(v, ref, bf16=cfg.precision == "bf16")
        if "failed" in verdict:
            v.close()
            rows.append(dict(row, skipped=f"failed in its first step: {verdict['failed']}"))
            _say(f"  {cfg.name:<36} skipped: failed in its first step: {verdict['failed']}")
            continue
        row.update(verdict, build_s=build_s, skipped=None)
        rows.append(row)
        if verdict["passed"]:
            live[cfg.name] = v
        else:
            v.close()
        grads = f", grads {verdict['grad_err']:.1e}" if verdict["grad_err"] is not None else ""
        _say(f"  {cfg.name:<36} {'bf16 ' if cfg.zero else ''}loss {verdict['loss']:.6f} "
             + (f"(err {verdict['loss_err']:.1e}{grads})" if verdict["passed"]
                else f"{'NOT EXACT' if cfg.precision == 'fp32' else 'FAILS the bf16 check'}: {verdict['error']}")
             + f"  built in {build_s:.1f} s, rank-0 RSS {_rss_mib():.0f} MiB")
    import autopar

    for name, pipeline, precision in opts["autopar"]:
        t0 = time.perf_counter()
        model, call = build_model(kw)
        policy = (autopar.MixedPrecision(torch.bfloat16, reduce_dtype=torch.bfloat16) if precision == BF16_SUMS
                  else precision)  # the plugin's recipe whole: bf16 compute and bf16 gradient sums
        v = AutoparVariant(model, (), call, autopar.Mesh((world,)), pipeline=pipeline, lr=LR,
                           options={"precision": policy} if policy else None)
        build_s = time.perf_counter() - t0
        precision = "bf16" if precision == BF16_SUMS else precision
        verdict = check_first_step(v, ref, bf16=precision == "bf16")
        if "failed" in verdict:
            v.close()
            rows.append(dict(config=name, kind="autopar", precision=precision or "fp32", pipeline=pipeline,
                             skipped=f"failed in its first step: {verdict['failed']}"))
            _say(f"  {name:<36} FAILED in its first step: {verdict['failed']}")
            continue
        rows.append(dict(config=name, kind="autopar", precision=precision or "fp32", pipeline=pipeline, plan=v.describe(),
                         explain=v.plan.explain().split("\n\n")[0] if rank == 0 else None,  # its summary paragraph
                         predicted_s=v.predicted_s, build_s=build_s, skipped=None, **verdict))
        _say(f"  {name:<36} loss {verdict['loss']:.6f} " + ("exact" if verdict["passed"] else f"NOT EXACT: {verdict['error']}")
             + f"  planned and built in {build_s:.1f} s: {v.describe()}")
        if verdict["passed"]:
            live[name] = v
        else:
            v.close()
    gc.collect()
    _say(f"timing {len(live)} variants: {opts['rounds']} alternating rounds of {opts['round_steps']} steps; "
         f"rank-0 RSS {_rss_mib():.0f} MiB")
    times = alternate(live, opts["rounds"], opts["round_steps"])
    for r in rows:
        if r["config"] in times:
            r["step_times"] = times[r["config"]]
            r["s_per_step"] = statistics.median(times[r["config"]])
    for v in live.values():
        v.close()
    return rows if rank == 0 else None


# ---- reporting, in the parent -----------------------------------------------------------------
def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "colossalai", "transformers")}


def report(rows: list[dict]) -> dict:
    timed = [r for r in rows if r.get("s_per_step") is not None]
    plugin = sorted((r for r in timed if r["kind"] == "colossalai"), key=lambda r: r["s_per_step"])
    fp32 = [r for r in plugin if r["precision"] == "fp32"]
    best = fp32[0] if fp32 else None
    best_bf16 = next((r for r in plugin if r["precision"] == "bf16"), None)
    print("\ns/step: median of the slowest rank's step times; vs best: over the best fp32 plugin configuration's")
    print(f"{'config':<38}{'prec':>5}{'s/step':>8}{'vs best':>9}{'first loss':>12}  check")
    for r in plugin + [r for r in timed if r["kind"] == "autopar"]:
        ratio = r["s_per_step"] / best["s_per_step"] if best else float("nan")
        print(f"{r['config']:<38}{r['precision']:>5}{r['s_per_step']:>8.3f}{ratio:>9.2f}{r['loss']:>12.6f}  "
              + ("exact" if r["precision"] == "fp32" else f"bf16 loss within {r['loss_err']:.1e} of a bf16 copy"))
    for r in rows:
        if r.get("skipped"):
            print(f"  skipped {r['config']}: {r['skipped']}")
        elif r.get("passed") is False:
            print(f"  {'NOT EXACT' if r['precision'] == 'fp32' else 'FAILS the bf16 check'}, not timed: "
                  f"{r['config']}: {r['error']}")
    summary = {"best_plugin": {"config": best["config"], "s_per_step": best["s_per_step"]} if best else None,
               "best_plugin_any_precision": {"config": plugin[0]["config"], "s_per_step": plugin[0]["s_per_step"],
                                             "precision": plugin[0]["precision"]} if plugin else None,
               "median_plugin_fp32_s": statistics.median(r["s_per_step"] for r in fp32) if fp32 else None,
               "exact": [r["config"] for r in rows if r["kind"] == "colossalai" and r.get("exact")],
               "bf16_checked": [r["config"] for r in rows if r["kind"] == "colossalai" and r.get("passed") and r["precision"] == "bf16"],
               "not_exact": [r["config"] for r in rows if r.get("passed") is False],
               "skipped": {r["config"]: r["skipped"] for r in rows if r.get("skipped")},
               "autopar": {}}
    summary["best_plugin_bf16"] = ({"config": best_bf16["config"], "s_per_step": best_bf16["s_per_step"]}
                                   if best_bf16 else None)
    if best:
        print(f"best-plugin: {best['config']} {best['s_per_step']:.3f} s/step (fp32)")
    if best_bf16:
        print(f"best-plugin bf16: {best_bf16['config']} {best_bf16['s_per_step']:.3f} s/step")
    autopar_rows = {r["config"]: r for r in timed if r["kind"] == "autopar"}
    for r in autopar_rows.values():
        bf16 = r["precision"] == "bf16"
        base = best_bf16 if bf16 else best  # the plugin's best of the same precision
        ratio = r["s_per_step"] / base["s_per_step"] if base else None
        fp32_twin = autopar_rows.get(r["config"].replace(" bf16", "")) if bf16 else None
        vs_fp32 = r["s_per_step"] / fp32_twin["s_per_step"] if fp32_twin else None
        summary["autopar"][r["config"]] = {"s_per_step": r["s_per_step"], "predicted_s": r["predicted_s"], "plan": r["plan"],
                                           "precision": r["precision"], "autopar/best-plugin": ratio,
                                           "autopar/autopar-fp32": vs_fp32}
        print(f"{r['config']}: {r['s_per_step']:.3f} s/step"
              + (f" = {ratio:.2f} x best-plugin{' bf16' if bf16 else ''}" if ratio else "")
              + (f", {vs_fp32:.2f} x autopar fp32" if vs_fp32 else "") + f" ({r['plan']})")
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    p.add_argument("--round-steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--only", default="", help="comma-separated substrings: run only the configurations (and autopar "
                   "plans) whose name has one")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, to try the driver quickly")
    p.add_argument("--out", default=str(RESULTS / "colossalai.json"))
    a = p.parse_args()
    os.environ.setdefault("AUTOPAR_CACHE_DIR", "/tmp/cai_cache")  # autopar's profiles of the live ranks
    from autopar.runtime.launch import spawn

    shapes = TINY if a.tiny else SHAPES
    only = [s for s in a.only.split(",") if s]
    plans = [("autopar 4 one-stage", False, None), ("autopar 4 auto", "auto", None),
             ("autopar 4 one-stage bf16", False, "bf16"), ("autopar 4 auto bf16", "auto", "bf16"),
             ("autopar 4 auto bf16 sums", "auto", BF16_SUMS)]
    plans = [(n.replace(" 4 ", f" {a.ranks} "), pl, pr) for n, pl, pr in plans]
    opts = dict(shapes=shapes, rounds=a.rounds, round_steps=a.round_steps, only=only,
                autopar=[(n, pl, pr) for n, pl, pr in plans if not only or any(s in n for s in only)])
    vers = versions()
    print(f"Colossal-AI HybridParallelPlugin vs autopar on {a.ranks} gloo ranks (1 thread each) on "
          f"{platform.processor() or platform.machine()} with {os.cpu_count()} cores; "
          + ", ".join(f"{k} {v}" for k, v in vers.items()) + f"; GPT-2 {shapes}; {a.rounds} rounds x {a.round_steps} steps",
          flush=True)
    t0 = time.perf_counter()
    rows = spawn(rank_main, a.ranks, args=(opts,), timeout_s=3600)[0]
    wall = time.perf_counter() - t0
    summary = report(rows)
    meta = dict(ranks=a.ranks, rounds=a.rounds, round_steps=a.round_steps, cores=os.cpu_count(), wall_s=wall, tiny=a.tiny,
                only=only, shapes=shapes, tol=TOL, bf16_tol=BF16_TOL, versions=vers,
                n_params=sum(t.numel() for t in build_model(shapes)[0].parameters()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1, default=str))
    print(f"wrote {out}; {wall:.0f} s wall for the ranks")


if __name__ == "__main__":
    main()
