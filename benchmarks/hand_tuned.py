"""The hand-tuned hybrid baseline: the tp x pp x dp layouts a person would configure by hand
(Colossal-AI's ``HybridParallelPlugin(tp_size, pp_size, zero_stage, num_microbatches, pp_style)``,
torchtitan's parallel dims), built only from PyTorch's own APIs, for autopar's built-in GPT and
LLaMA.

    cfgs = grid_for("gpt", model_kw, world=4)         # every valid HandConfig (skips: enumerate_grid)
    v = build_variant(cfg, "gpt", model_kw, rank, world)   # inside each rank
    loss = v.step()                                   # one AdamW step on the global batch
    v.close()

How each piece is built (the order torchtitan composes them: TP, then data parallel, then stages):

    tp > 1      ``parallelize_module`` on the "tp" mesh axis, Megatron-style: ColwiseParallel on the
                q/k/v (GPT: the fused c_attn, its rows permuted so each rank's block holds [q, k, v]
                of its own heads) and MLP input projections, RowwiseParallel on the attention and
                MLP output projections, attention run on the local heads (LLaMA: local kv heads
                too); the token embedding vocabulary-parallel (RowwiseParallel) and the head
                vocabulary-parallel (ColwiseParallel, logits sharded) with the cross entropy under
                ``loss_parallel`` (GPT's tied embedding/head stays one shared parameter).
    dp > 1      zero 0: ``DistributedDataParallel`` (tp == 1); with tp > 1 DDP does not take DTensor
                parameters, so one flat all-reduce of the gradients after backward, as Megatron's
                contiguous gradient buffer does. zero 1: the same gradient sync plus
                ``ZeroRedundancyOptimizer`` (AdamW states sharded over dp). zero 2 / 3:
                ``fully_shard`` (FSDP2) per block and at the root, ``reshard_after_forward``
                False / True; with tp > 1 on the 2-D (dp, tp) mesh.
    pp > 1      the layers split into ``pp x virtual`` equal stages (embeddings with the first,
                final norm + head with the last), each a ``PipelineStage`` built by hand (static
                shapes, no tracer) on the "pp" axis, driven by ``ScheduleGPipe``,
                ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` (2 stages per rank, loop order).
                The schedule's loss is each microbatch's mean cross entropy; the schedule divides
                the gradients by the number of microbatches and data parallelism averages over
                dp, so the gradients are those of the global mean. Gradients are synchronised once
                per step (DDP under ``no_sync`` until the last backward, FSDP's reduce-scatter at
                the schedule's end). GPT's tied embedding lives on the first and the last stage as
                two copies whose gradients are summed over a (first, last) group after backward,
                as Megatron does; both copies then take the same AdamW step.

Ranks are laid out (pp, dp, tp) with tp fastest. Every rank builds the same seeded model, keeps
the part it runs, and trains on its data-parallel slice of the same global batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

LR = 1e-3
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
VIRTUAL_STAGES = 2  # stages per rank in the interleaved schedule


# ---- configurations ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class HandConfig:
    """One hand-written layout on tp * pp * dp ranks."""

    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split of every block, vocab-parallel head)."""
    pp: int = 1
    """Pipeline stages over ranks."""
    dp: int = 1
    """Data-parallel degree: each dp index trains on its slice of the global batch."""
    zero: int = 0
    """0: gradients all-reduced; 1: + optimizer states sharded (ZeroRedundancyOptimizer);
    2: FSDP2 without resharding after forward; 3: FSDP2 resharding after forward. Needs dp > 1."""
    microbatches: int = 1
    """Microbatches per data-parallel slice (pp > 1 only)."""
    schedule: str | None = None
    """"gpipe", "1f1b" or "interleaved-1f1b" (pp > 1 only)."""

    def __post_init__(self):
        for f in ("tp", "pp", "dp", "microbatches"):
            if getattr(self, f) < 1:
                raise ValueError(f"HandConfig: {f} ({getattr(self, f)}) must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"HandConfig: zero ({self.zero}) must be 0, 1, 2 or 3")
        if self.zero and self.dp == 1:
            raise ValueError(f"HandConfig: zero {self.zero} needs dp > 1 (dp = {self.dp})")
        if self.pp == 1 and (self.microbatches != 1 or self.schedule is not None):
            raise ValueError(f"HandConfig: microbatches ({self.microbatches}) and schedule ({self.schedule}) need pp > 1")
        if self.pp > 1 and self.schedule not in SCHEDULES:
            raise ValueError(f"HandConfig: schedule ({self.schedule}) must be one of {SCHEDULES} when pp > 1")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def virtual_stages(self) -> int:
        return VIRTUAL_STAGES if self.schedule == "interleaved-1f1b" else 1

    @property
    def name(self) -> str:
        s = f"tp{self.tp}-pp{self.pp}-dp{self.dp}"
        if self.dp > 1:
            s += f"-zero{self.zero}"
        if self.pp > 1:
            s += f"-{self.schedule}-mb{self.microbatches}"
        return s

    def fields(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return self.name


def _factorizations(world: int):
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) == 0:
                yield tp, pp, world // (tp * pp)


def enumerate_grid(world: int = 4, *, layers: int, batch: int, heads: int, width: int, vocab: int,
                   ffn: int, kv_heads: int | None = None) -> list[tuple[HandConfig, str | None]]:
    """Every candidate layout on ``world`` ranks with the reason it cannot run (None: it can).
    ``ffn`` is the MLP's inner width (GPT: 4 * width; LLaMA: hidden)."""
    out = []
    for tp, pp, dp in sorted(_factorizations(world), key=lambda f: (f[1], f[0])):
        dims = {"width": width, "heads": heads, "ffn": ffn, "vocab": vocab}
        if kv_heads is not None:
            dims["kv_heads"] = kv_heads
        tp_bad = [f"{k} ({v}) not divisible by tp ({tp})" for k, v in dims.items() if v % tp]
        dp_bad = [f"global batch ({batch}) not divisible by dp ({dp})"] if batch % dp else []
        for zero in (range(4) if dp > 1 else (0,)):
            if pp == 1:
                out.append((HandConfig(tp=tp, dp=dp, zero=zero), "; ".join(tp_bad + dp_bad) or None))
                continue
            local = batch // dp
            for schedule in SCHEDULES:
                for mb in (pp, 2 * pp, 4 * pp):
                    cfg = HandConfig(tp=tp, pp=pp, dp=dp, zero=zero, microbatches=mb, schedule=schedule)
                    why = list(tp_bad + dp_bad)
                    if local % mb:
                        why.append(f"local batch ({local}) not divisible by microbatches ({mb})")
                    stages = pp * cfg.virtual_stages
                    if layers % stages:
                        why.append(f"layers ({layers}) not divisible by stages ({stages})")
                    if schedule == "1f1b" and mb < pp:
                        why.append(f"1F1B needs microbatches ({mb}) >= stages ({pp})")
                    out.append((cfg, "; ".join(why) or None))
    return out


def model_dims(model_name: str, model_kw: dict) -> dict:
    """The model shapes ``enumerate_grid`` checks, from the built-in model's config."""
    from autopar import models

    c = models.config(model_name, **model_kw)
    dims = dict(layers=c.layers, batch=c.batch, heads=c.heads, width=c.width, vocab=c.vocab)
    if model_name == "llama":
        dims.update(ffn=c.hidden, kv_heads=c.kv_heads)
    else:
        dims.update(ffn=4 * c.width)
    return dims


def enumerate_grid_for(model_name: str, model_kw: dict, world: int = 4):
    return enumerate_grid(world, **model_dims(model_name, model_kw))


def grid(world: int = 4, **dims) -> list[HandConfig]:
    """Every valid configuration on ``world`` ranks (see ``enumerate_grid`` for the skipped ones)."""
    return [c for c, why in enumerate_grid(world, **dims) if why is None]


def grid_for(model_name: str, model_kw: dict, world: int = 4) -> list[HandConfig]:
    return grid(world, **model_dims(model_name, model_kw))


# ---- process groups (cached: every configuration of one shape shares them) ----------------------
_MESHES: dict = {}


def _mesh(pp: int, dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    key = (pp, dp, tp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("pp", "dp", "tp"))
    return _MESHES[key]


_TIE_GROUPS: dict = {}


def _tie_group(pp: int, dp: int, tp: int):
    """The group {first-stage rank, last-stage rank} with this rank's (dp, tp) coordinates; every
    rank creates every pair, in the same order, as ``new_group`` requires."""
    key = (pp, dp, tp)
    if key not in _TIE_GROUPS:
        mine = None
        for d in range(dp):
            for t in range(tp):
                pair = [d * tp + t, (pp - 1) * dp * tp + d * tp + t]
                g = dist.new_group(pair)
                if dist.get_rank() in pair:
                    mine = g
        _TIE_GROUPS[key] = mine
    return _TIE_GROUPS[key]


# ---- tensor parallel: attention on local heads ---------------------------------------------------
def _gpt_tp_attention(self, x):
    """GPT CausalSelfAttention on this rank's heads: c_attn (column-parallel, rows permuted by
    ``_permute_qkv``) gives (B, T, 3C/tp) = [q, k, v] of heads/tp heads; c_proj (row-parallel) sums."""
    B, T, _ = x.shape
    q, k, v = self.c_attn(x).chunk(3, dim=2)  # each (B, T, C/tp)
    h = self.heads // self.tp
    q, k, v = (t.view(B, T, h, -1).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


def _qkv_order(width: int, tp: int) -> torch.Tensor:
    """Row order of c_attn that puts [q_r; k_r; v_r] (rank r's heads) in rank r's column block."""
    return torch.cat([torch.arange(part * width + r * width // tp, part * width + (r + 1) * width // tp)
                      for r in range(tp) for part in range(3)])


@torch.no_grad()
def _permute_qkv(linear: nn.Linear, tp: int) -> None:
    order = _qkv_order(linear.weight.shape[1], tp)
    linear.weight.copy_(linear.weight[order])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[order])


def _llama_tp_attention(self, x, cos, sin):
    """LLaMA attention on this rank's heads/tp query heads and kv_heads/tp kv heads (query head h
    reads kv head h // rep, so contiguous column blocks of q/k/v stay matched)."""
    from autopar.models.llama import rotate_half

    B, T, _ = x.shape
    hd = self.head_dim
    h, kv = self.heads // self.tp, self.kv_heads // self.tp
    q = self.q_proj(x).view(B, T, h, hd).transpose(1, 2)  # (B, h, T, hd)
    k = self.k_proj(x).view(B, T, kv, hd).transpose(1, 2)  # (B, kv, T, hd)
    v = self.v_proj(x).view(B, T, kv, hd).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    if h > kv:
        k = k[:, :, None].expand(B, kv, h // kv, T, hd).reshape(B, h, T, hd)
        v = v[:, :, None].expand(B, kv, h // kv, T, hd).reshape(B, h, T, hd)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, hd)
    return self.o_proj(y.transpose(1, 2).reshape(B, T, h * hd))


def _blocks(model_name: str, module: nn.Module) -> dict[str, nn.Module]:
    """Transformer blocks by their path in ``module`` (the full model or a stage)."""
    prefix = "transformer.h." if model_name == "gpt" else "model.layers."
    return {n: m for n, m in module.named_modules() if n.startswith(prefix) and n.count(".") == 2}


def _patch_tp_attention(model_name: str, model: nn.Module, tp: int) -> None:
    for block in _blocks(model_name, model).values():
        if model_name == "gpt":
            _permute_qkv(block.attn.c_attn, tp)
            block.attn.tp = tp
            block.attn.forward = types.MethodType(_gpt_tp_attention, block.attn)
        else:
            block.self_attn.tp = tp
            block.self_attn.forward = types.MethodType(_llama_tp_attention, block.self_attn)


def _tp_plan(model_name: str, module: nn.Module) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    names = dict(module.named_modules())
    emb, head = ("transformer.wte", "lm_head") if model_name == "gpt" else ("model.embed_tokens", "lm_head")
    if emb in names:
        plan[emb] = RowwiseParallel(input_layouts=Replicate())
    if head in names:
        plan[head] = ColwiseParallel(output_layouts=Shard(-1))  # local logits shard; see _loss_fn
    for path in _blocks(model_name, module):
        if model_name == "gpt":
            col, row = ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")
        else:
            col = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
            row = ("self_attn.o_proj", "mlp.down_proj")
        plan.update({f"{path}.{c}": ColwiseParallel() for c in col})
        plan.update({f"{path}.{r}": RowwiseParallel() for r in row})
    return plan


def _apply_tp(model_name: str, module: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(module, tp_mesh, _tp_plan(model_name, module))
    if model_name == "gpt" and hasattr(module, "lm_head") and "wte" in getattr(module, "transformer", {}):
        module.lm_head.weight = module.transformer.wte.weight  # both Shard(0) over the vocabulary


# ---- pipeline stages -----------------------------------------------------------------------------
class GPTStage(nn.Module):
    """Blocks [lo, hi) of a GPT under their original paths (``transformer.h.5``); the first stage
    also embeds, the last also normalizes and projects to logits."""

    def __init__(self, model, lo: int, hi: int):
        super().__init__()
        t, layers = model.transformer, len(model.transformer.h)
        parts = {"h": nn.ModuleDict({str(i): t.h[i] for i in range(lo, hi)})}
        self.first, self.last = lo == 0, hi == layers
        if self.first:
            parts.update(wte=t.wte, wpe=t.wpe, drop=t.drop)
        if self.last:
            parts["ln_f"] = t.ln_f
        self.transformer = nn.ModuleDict(parts)
        if self.last:
            self.lm_head = model.lm_head  # shares wte's parameter object; a separate copy on this rank

    def forward(self, x):
        t = self.transformer
        if self.first:
            x = t.drop(t.wte(x) + t.wpe(torch.arange(x.shape[1], device=x.device)))  # (B, T, C)
        for block in t.h.values():
            x = block(x)
        return self.lm_head(t.ln_f(x)) if self.last else x


class LlamaStage(nn.Module):
    """Decoder layers [lo, hi) of a LLaMA under their original paths (``model.layers.5``), with
    the rotary tables; the first stage also embeds, the last also normalizes and projects."""

    def __init__(self, model, lo: int, hi: int):
        super().__init__()
        m, layers = model.model, len(model.model.layers)
        self.first, self.last = lo == 0, hi == layers
        inner = nn.Module()
        inner.layers = nn.ModuleDict({str(i): m.layers[i] for i in range(lo, hi)})
        if self.first:
            inner.embed_tokens = m.embed_tokens
        if self.last:
            inner.norm = m.norm
        inner.register_buffer("rope_cos", m.rope_cos, persistent=False)
        inner.register_buffer("rope_sin", m.rope_sin, persistent=False)
        self.model = inner
        if self.last:
            self.lm_head = model.lm_head

    def forward(self, x):
        m = self.model
        T = x.shape[1]
        cos, sin = m.rope_cos[:T], m.rope_sin[:T]
        if self.first:
            x = m.embed_tokens(x)  # (B, T, C)
        for layer in m.layers.values():
            x = layer(x, cos, sin)
        return self.lm_head(m.norm(x)) if self.last else x


def make_stage(model_name: str, model: nn.Module, lo: int, hi: int) -> nn.Module:
    return (GPTStage if model_name == "gpt" else LlamaStage)(model, lo, hi)


# ---- the variant ---------------------------------------------------------------------------------
def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full_tensors(grads: list) -> list[torch.Tensor]:
    """Full tensors of (possibly DTensor) gradients, a collective over their meshes: one
    all-gather per (mesh, dim) for evenly Shard(dim)-ed 1-D DTensors (FSDP's shards, most
    tensor-parallel ones), ``full_tensor()`` for the rest."""
    from torch.distributed.tensor import Replicate, Shard

    out, groups = [None] * len(grads), {}
    for i, g in enumerate(grads):
        if not hasattr(g, "placements"):
            out[i] = g
            continue
        mesh, (pl, *rest) = g.device_mesh, g.placements
        if not rest and type(pl) is Replicate:
            out[i] = g.to_local()
        elif not rest and type(pl) is Shard and g.shape[pl.dim] % mesh.size() == 0:
            groups.setdefault((id(mesh), pl.dim), []).append(i)
        else:
            out[i] = g.full_tensor()
    for (_, dim), idxs in groups.items():
        mesh = grads[idxs[0]].device_mesh
        n = mesh.size()
        locs = [grads[i].to_local() for i in idxs]
        flat = torch.cat([t.reshape(-1) for t in locs])
        buf = torch.empty(n * flat.numel(), dtype=flat.dtype)
        dist.all_gather_into_tensor(buf, flat, group=mesh.get_group())
        buf = buf.view(n, -1)
        offset = 0
        for i, t in zip(idxs, locs):
            out[i] = torch.cat([buf[r, offset: offset + t.numel()].view(t.shape) for r in range(n)], dim=dim)
            offset += t.numel()
    return out


class HandVariant:
    """One configuration inside one rank: ``forward_backward()`` (global mean loss, gradients
    synchronised), ``full_grads()``, ``optimizer_step()``, ``step()`` (all three but full_grads),
    ``resident_bytes()`` and ``close()``."""

    def __init__(self, cfg: HandConfig, model_name: str, model_kw: dict, rank: int, world: int):
        from autopar import models

        if cfg.world != world:
            raise ValueError(f"{cfg.name}: tp({cfg.tp}) * pp({cfg.pp}) * dp({cfg.dp}) != world_size({world})")
        self.cfg, self.model_name, self.rank = cfg, model_name, rank
        mesh = _mesh(cfg.pp, cfg.dp, cfg.tp)
        self.mesh = mesh
        self.tp_mesh = mesh["tp"]
        self.pp_rank, self.dp_rank, self.tp_rank = (mesh.get_local_rank(a) for a in ("pp", "dp", "tp"))
        self.dp_group = mesh["dp"].get_group() if cfg.dp > 1 else None
        model, (idx, targets) = models.build(model_name, **model_kw)
        self.vocab, self.width = model.config.vocab, model.config.width
        per = idx.shape[0] // cfg.dp
        rows = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        self.x, self.y = idx[rows].contiguous(), targets[rows].contiguous()
        canonical = {id(p): n for n, p in model.named_parameters()}
        if cfg.tp > 1:
            _patch_tp_attention(model_name, model, cfg.tp)
        # the modules this rank runs: the whole model, or its pipeline stages
        if cfg.pp == 1:
            self.stage_ids, mods = [0], [model]
        else:
            n_stages = cfg.pp * cfg.virtual_stages
            per_stage = model.config.layers // n_stages
            self.stage_ids = [self.pp_rank + k * cfg.pp for k in range(cfg.virtual_stages)]
            mods = [make_stage(model_name, model, s * per_stage, (s + 1) * per_stage) for s in self.stage_ids]
        self.names = [{n: canonical[id(p)] for n, p in m.named_parameters()} for m in mods]
        del model
        self.inner = mods  # parameters live here (DDP wraps, FSDP/TP modify in place)
        self.extra_resident = 0
        wrapped = [self._parallelize(m) for m in mods]
        params = [p for m in mods for p in m.parameters()]
        self.params = params
        self.proxies = None
        if cfg.zero == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if cfg.tp > 1:  # ZeroRedundancyOptimizer broadcasts with c10d, which DTensor does not take:
                # it steps plain parameters that share storage with the local tp shards instead
                self.proxies = [nn.Parameter(_local(p.detach())) for p in params]
            self.opt = ZeroRedundancyOptimizer(self.proxies or params, optimizer_class=torch.optim.AdamW,
                                               process_group=self.dp_group, lr=LR)
        else:
            self.opt = torch.optim.AdamW(params, lr=LR)
        self.flat_sync = cfg.dp > 1 and cfg.zero <= 1 and cfg.tp > 1
        self.tie = None
        if cfg.pp > 1 and model_name == "gpt":
            self.tie = _tie_group(cfg.pp, cfg.dp, cfg.tp)
        if cfg.pp == 1:
            self.module = wrapped[0]
        else:
            self._build_pipeline(wrapped)

    # -- construction --
    def _parallelize(self, m: nn.Module) -> nn.Module:
        cfg = self.cfg
        if cfg.tp > 1:
            _apply_tp(self.model_name, m, self.tp_mesh)
        if cfg.dp == 1:
            return m
        if cfg.zero >= 2:
            from torch.distributed.fsdp import fully_shard

            dp_mesh = self.mesh["dp"]
            reshard = cfg.zero == 3
            for block in _blocks(self.model_name, m).values():
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
            fully_shard(m, mesh=dp_mesh, reshard_after_forward=reshard)
            return m
        if cfg.tp > 1:
            return m  # flat all-reduce after backward (DDP does not take DTensor parameters)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(m, process_group=self.dp_group, broadcast_buffers=False)
        # DDP's gradient buckets: one more copy of the gradients, resident for its lifetime
        self.extra_resident += sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
        return ddp

    def _build_pipeline(self, wrapped):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        cfg = self.cfg
        n_stages = cfg.pp * cfg.virtual_stages
        mb_rows = self.x.shape[0] // cfg.microbatches
        T = self.x.shape[1]
        # static stage shapes (no metadata inference): tokens in, (mb, T, C) between, logits out
        act = torch.empty(mb_rows, T, self.width, device="meta", requires_grad=True)
        logits = torch.empty(mb_rows, T, self.vocab // cfg.tp, device="meta", requires_grad=True)
        tokens = torch.empty(mb_rows, T, dtype=torch.long, device="meta")
        group = self.mesh["pp"].get_group()
        self.stages = [
            PipelineStage(w, s, n_stages, torch.device("cpu"), group=group,
                          input_args=tokens if s == 0 else act,
                          output_args=logits if s == n_stages - 1 else act)
            for s, w in zip(self.stage_ids, wrapped)
        ]
        self.holds_loss = self.stage_ids[-1] == n_stages - 1
        kw = dict(n_microbatches=cfg.microbatches, loss_fn=self._loss_fn)
        if cfg.schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, **kw)
        else:
            cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(self.stages[0], **kw)

    # -- one step --
    def _loss_fn(self, logits, targets):
        """Mean cross entropy; with tp > 1 the logits are this rank's vocabulary shard."""
        if self.cfg.tp == 1:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        from torch.distributed.tensor import DTensor, Shard

        full = DTensor.from_local(logits, self.tp_mesh, [Shard(logits.dim() - 1)])
        return F.cross_entropy(full.reshape(-1, self.vocab), targets.reshape(-1)).to_local()

    def _loss_context(self):
        if self.cfg.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def forward_backward(self) -> float:
        """Forward and backward on the global batch, gradients synchronised; the global mean loss
        (the same number on every rank)."""
        cfg = self.cfg
        with self._loss_context():
            if cfg.pp == 1:
                loss = self._loss_fn(self.module(self.x), self.y)
                loss.backward()
                mine = loss.detach() if self.tp_rank == 0 else None
            else:
                losses = []
                self.schedule.step(self.x, target=self.y, losses=losses, return_outputs=False)
                mine = torch.stack(losses).mean().detach() if self.holds_loss and self.tp_rank == 0 else None
        if cfg.tp > 1 and cfg.zero < 2:
            self._grads_like_params()
        if self.flat_sync:
            self._all_reduce_grads()
        if self.tie is not None:
            self._sum_tied()
        buf = torch.zeros(2)
        if mine is not None:
            buf[0], buf[1] = mine, 1.0
        dist.all_reduce(buf)
        return (buf[0] / buf[1]).item()

    @torch.no_grad()
    def _grads_like_params(self) -> None:
        """Give each tensor-parallel gradient its parameter's placement: the vocabulary-parallel
        embedding's gradient comes out of backward replicated (the full table on every rank);
        sharding it is a local slice, and the optimizer and the syncs below then see shards."""
        for p in self.params:
            g = p.grad
            if g is not None and hasattr(g, "placements") and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)

    @torch.no_grad()
    def _all_reduce_grads(self) -> None:
        """Data parallel with tp > 1: one flat all-reduce of the local gradient shards, averaged."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.cfg.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def _sum_tied(self) -> None:
        """GPT with pp > 1: sum the tied embedding's gradient over its first- and last-stage copies."""
        for m, names in zip(self.inner, self.names):
            for n, p in m.named_parameters():
                if names[n] == "transformer.wte.weight" and p.grad is not None:
                    dist.all_reduce(_local(p.grad), group=self.tie)

    def optimizer_step(self) -> None:
        if self.proxies is not None:
            for q, p in zip(self.proxies, self.params):
                q.grad = None if p.grad is None else _local(p.grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.proxies is not None:
            for p in self.params:
                p.grad = None

    def step(self) -> float:
        loss = self.forward_backward()
        self.optimizer_step()
        return loss

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The full gradient of every parameter under the original model's names, on rank 0 ({}
        elsewhere). A collective: call it on every rank after ``forward_backward()``."""
        named = [(names[n], p) for m, names in zip(self.inner, self.names) for n, p in m.named_parameters()]
        grads = _full_tensors([torch.zeros(p.shape) if p.grad is None else p.grad for _, p in named])
        mine = {}
        for (canon, _), g in zip(named, grads):
            if self.cfg.tp > 1 and canon.rsplit(".", 1)[0].endswith("attn.c_attn"):  # undo _permute_qkv
                full = torch.empty_like(g)
                full[_qkv_order(g.shape[0] // 3, self.cfg.tp)] = g
                g = full
            mine.setdefault(canon, g.detach().clone())  # the tied copies hold the same sum
        # one rank per pipeline stage holds what the others of its (dp, tp) slice hold too
        owners = [p * self.cfg.dp * self.cfg.tp for p in range(self.cfg.pp)]
        if self.rank == 0:
            out = mine
            for src in owners[1:]:
                box = [None]
                dist.recv_object_list(box, src=src)
                for k, v in box[0].items():
                    out.setdefault(k, v)
            return out
        if self.rank in owners:
            dist.send_object_list([mine], dst=0)
        return {}

    def resident_bytes(self) -> int:
        """Bytes of the unique storages of parameters, buffers, gradients and optimizer states (this
        rank's shards), plus DDP's gradient buckets."""
        tensors = [_local(t) for m in self.inner for t in list(m.parameters()) + list(m.buffers())]
        tensors += [_local(p.grad) for p in self.params if p.grad is not None]
        opt = getattr(self.opt, "optim", self.opt)
        tensors += [_local(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        seen = {}
        for t in tensors:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values()) + self.extra_resident

    def close(self) -> None:
        for attr in ("schedule", "stages", "module", "inner", "params", "proxies", "opt"):
            if hasattr(self, attr):
                delattr(self, attr)
        # (no gc.collect() here: it costs ~0.2 s; callers that need the memory back run it)


def build_variant(cfg: HandConfig, model_name: str, model_kw: dict, rank: int, world: int) -> HandVariant:
    """``cfg`` built inside this rank (a collective: every rank builds the same configuration)."""
    return HandVariant(cfg, model_name, model_kw, rank, world)


# ---- exactness -----------------------------------------------------------------------------------
TOL = 1e-5
# a bf16 recipe against one process running it (bf16 compute from fp32 masters): the same products
# summed in other orders, rounded to bf16's 8-bit mantissa; the gradients as one vector (a gradient
# that nearly cancels, a norm's bias, is all rounding on its own scale)
BF16_TOL = 2e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (inf when the shapes differ)."""
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def reference(model_name: str, model_kw: dict, steps: int = 1, dtype: torch.dtype = torch.float32) -> dict:
    """The single-process run: first-step loss and full gradients, and the loss of each of
    ``steps`` AdamW steps (same init, same global batch). ``dtype`` bfloat16: the first step of
    the mixed-precision recipe (a bf16 copy of the fp32 model; its gradients in fp32)."""
    from autopar import models

    model, (idx, targets) = models.build(model_name, **model_kw)
    model = model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for i in range(steps):
        loss = model(idx, targets)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.detach().float() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"loss": losses[0], "losses": losses, "grads": grads}


def check_exact(variant, ref: dict | None, loss: float | None = None, tol: float = TOL, bf16: bool = False) -> dict:
    """Run the variant's first step (forward, backward, full gradients, AdamW step) and compare the
    loss and every gradient with the single-process ``ref`` (needed on rank 0 only), within
    ``tol`` relative; ``bf16``: against one process running the bf16 recipe, the gradients as one
    vector (global relative L2 error; ``worst`` the tensor adding most to it). Returns the same
    verdict on every rank: {"exact", "loss", "loss_err", "grad_err", "worst", "error"}. ``loss``:
    the caller already ran ``forward_backward()`` and got this loss."""
    if loss is None:
        loss = variant.forward_backward()
    grads = variant.full_grads()
    verdict = [None]
    if dist.get_rank() == 0:
        loss_err = abs(loss - ref["loss"]) / abs(ref["loss"])
        if bf16:
            errs = {n: float((grads[n].double() - g.double()).norm() ** 2) if n in grads and grads[n].shape == g.shape
                    else float("inf") for n, g in ref["grads"].items()}
            total = sum(float(g.double().norm() ** 2) for g in ref["grads"].values())
            worst = max(errs, key=errs.get)
            grad_err = (sum(errs.values()) / max(total, 1e-30)) ** 0.5
        else:
            errs = {n: rel(grads[n], g) if n in grads else float("inf") for n, g in ref["grads"].items()}
            worst = max(errs, key=errs.get)
            grad_err = errs[worst]
        extra = sorted(set(grads) - set(ref["grads"]))
        grad_err = grad_err if not extra else float("inf")
        error = None
        if extra:
            error = f"gradients for unknown parameters {extra[:3]}"
        elif not math.isfinite(grad_err) or grad_err > tol:
            error = f"gradient of {worst} off by {grad_err:.2e}"
        elif loss_err > tol:
            error = f"loss {loss:.6f} vs {ref['loss']:.6f}"
        verdict = [{"exact": error is None, "loss": loss, "loss_err": loss_err, "grad_err": grad_err,
                    "worst": worst, "error": error}]
    dist.broadcast_object_list(verdict, src=0)
    variant.optimizer_step()
    return verdict[0]
