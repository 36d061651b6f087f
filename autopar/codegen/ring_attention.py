"""Ring attention: scaled dot-product attention over a sequence split across a group of ranks.

Each rank holds a contiguous shard of the sequence of q, k and v (shard order: ``GroupHandle``).
Queries stay put; key/value blocks travel around the ring (rank i sends to i + 1 and receives
from i - 1, shard order), one block per step, the next step's exchange started before the block's
attention runs. Each block gives a partial output and its log-sum-exp per query row; partials
merge in fp32 (``_merge``), so the result is softmax over the whole key length. Backward runs the
same ring with the final log-sum-exp: the query gradient stays, the key/value gradients travel
with their block (each pass overlapped with the next block's work: a block's part is added in
when the traveling sum arrives) and arrive home after one more step. One code path for gloo and
NCCL, the exchanges ``batch_isend_irecv``. A block without a mask tensor runs the fused CPU
kernel (``_scaled_dot_product_flash_attention_for_cpu``: its log-sum-exp out, its backward from
the merged output and log-sum-exp, as ring implementations on flash attention do); a masked block,
or one on another device, plain matmuls and softmax in fp32 (``_attend``).

Causal balance: under a causal mask the ranks holding late queries would do most of the work. The
sequence is cut in 2n chunks and, for the attention only, rank r holds the query chunks r and
2n-1-r (an exchange of query chunks before, and of the output after; ``_balance``; backward the
same for the output's and the queries' gradients); keys and values stay as they are. Query chunk
c reads c + 1/2 chunks of keys wherever they lie, so every rank computes the same number of
(query, key) block pairs (``causal_pairs``). The rest of the model keeps its contiguous shard, so
positions (rotary tables, position ids) need no change.

Grouped-query attention: q's Hq heads are read as Hk groups of Hq / Hk (PyTorch's ``enable_gqa``
order: query head h uses key/value head h // (Hq / Hk)), so only Hk heads of keys and values travel.
Masks: ``mask`` is the rank's rows of a mask broadcastable to (B, Hq, L, S) whose key dim is whole
(bool: True attends; float: added), sliced per block; a row every key of a block masks adds
nothing from that block. With a mask no block is skipped (its pattern is not known).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.errors import ShardingError


# ---- blocks -----------------------------------------------------------------------------------------
def _scores(q, k, scale, mask, causal_diag: bool, rows: int):
    """fp32 scores of q (B, Hk, G*Lq, E) against k (B, Hk, Lk, E), masked: ``mask`` (broadcastable
    to (B, Hk, G*Lq, Lk), or None); ``causal_diag``: q and k are the same chunk (row i of each group
    sees keys <= i); ``rows``: Lq."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal_diag:
        lq, lk = rows, k.shape[-2]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        keep = keep.repeat(s.shape[-2] // lq, 1)
        s = s.masked_fill(~keep, -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    return s


_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_CUDA_FUSED = torch.ops.aten._scaled_dot_product_flash_attention.default
_CUDA_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default


def _kernel(q, k, mask) -> str | None:
    """The fused kernel a block runs (no scores made: the output and its log-sum-exp), or None for
    the math path (a mask, or a device and dtype no flash kernel takes): torch's CPU flash kernel
    on CPU and on meta (a dry run: its shapes stand for any device's fused kernel), CUDA's for half
    types on GPUs it runs on."""
    if mask is not None:
        return None
    if q.device.type in ("cpu", "meta") and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 \
            and q.shape[-1] % 8 == 0 and torch.cuda.get_device_capability(q.device)[0] >= 8:  # (flash: Ampere on)
        return "cuda"
    return None


def _flash(kernel: str, q, k, v, causal: bool, scale):
    """(output, log-sum-exp) of ``kernel`` (``_kernel``) on (B, H, L, E) blocks."""
    if kernel == "cuda":
        out, lse = _CUDA_FUSED(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    return _FUSED(q, k, v, 0.0, causal, scale=scale)


def _flash_backward(kernel: str, do, q, k, v, out, lse, causal: bool, scale):
    """(dq, dk, dv) of ``_flash``'s block from the output's gradient ``do``."""
    if kernel == "cuda":
        unread = torch.empty((), dtype=torch.uint64, device=q.device)  # the dropout's seed and offset (none)
        return _CUDA_FUSED_BACKWARD(do, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal,
                                    unread, unread, scale=scale)
    return _FUSED_BACKWARD(do, q, k, v, out, lse, 0.0, causal, scale=scale)


def _per_head(q, k, v, groups: int, rows: int):
    """A causal diagonal block of grouped queries (B, Hk, G*rows, E) as the kernel's per-head call:
    queries (B, Hk*G, rows, E), keys and values repeated per query head."""
    b, hk = q.shape[:2]
    return (q.reshape(b, hk * groups, rows, q.shape[-1]), k.repeat_interleave(groups, 1),
            v.repeat_interleave(groups, 1))


def _attend(q, k, v, scale, mask, diag: bool, rows: int, groups: int):
    """(output fp32, log-sum-exp fp32) of one block: queries q (B, Hk, G*rows, E) against k, v
    (B, Hk, rows, .); ``diag``: causal within the block (the same chunk); rows no key reaches:
    output 0, log-sum-exp -inf."""
    kernel = _kernel(q, k, mask)
    if kernel is not None:
        b, hk = q.shape[:2]
        if diag and groups > 1:
            out, lse = _flash(kernel, *_per_head(q, k, v, groups, rows), True, scale)
            return out.reshape(b, hk, groups * rows, -1).float(), lse.reshape(b, hk, groups * rows)
        out, lse = _flash(kernel, q, k.contiguous(), v.contiguous(), diag, scale)
        return out.float(), lse
    s = _scores(q.float(), k.float(), scale, mask, diag, rows)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.matmul(p, v.float()), lse


def _attend_backward(do, q, k, v, out, lse, scale, mask, diag: bool, rows: int, groups: int):
    """(dq, dk, dv), fp32, of one block from the output's gradient ``do``, the merged output ``out``
    and log-sum-exp ``lse`` of its query rows (shapes as ``_attend``'s)."""
    kernel = _kernel(q, k, mask)
    if kernel is not None:
        b, hk = q.shape[:2]
        dt = q.dtype
        if diag and groups > 1:
            qh, kh, vh = _per_head(q, k, v, groups, rows)
            per = (b, hk * groups, rows)
            dq, dk, dv = _flash_backward(kernel, do.to(dt).reshape(*per, -1), qh, kh, vh, out.reshape(*per, -1),
                                         lse.reshape(per), True, scale)
            fold = (b, hk, groups, rows, -1)
            return dq.reshape(b, hk, groups * rows, -1).float(), dk.reshape(fold).sum(2).float(), \
                dv.reshape(fold).sum(2).float()
        dq, dk, dv = _flash_backward(kernel, do.to(dt), q, k.contiguous(), v.contiguous(), out, lse, diag, scale)
        return dq.float(), dk.float(), dv.float()
    qf, kf, vf = q.float(), k.float(), v.float()
    s = _scores(qf, kf, scale, mask, diag, rows)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    delta = (do * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-1, -2), qf) * scale, torch.matmul(p.transpose(-1, -2), do)


def _merge(out, lse, part, part_lse):
    """Two partial softmax results as one (fp32; -inf lse: nothing yet)."""
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isfinite(new), new, 0.0)
    a = torch.where(torch.isfinite(lse), torch.exp(lse - safe), 0.0).unsqueeze(-1)
    b = torch.where(torch.isfinite(part_lse), torch.exp(part_lse - safe), 0.0).unsqueeze(-1)
    return out * a + part * b, new


# ---- which blocks a rank computes -------------------------------------------------------------------
def chunk_ids(shard: int, n: int, balanced: bool) -> tuple[int, int]:
    """The two sequence chunks (of 2n) a rank of shard index ``shard`` holds: balanced (its queries
    under a causal mask) or contiguous (keys and values, and everything outside attention)."""
    return (shard, 2 * n - 1 - shard) if balanced else (2 * shard, 2 * shard + 1)


def pair_kind(qc: int, kc: int, causal: bool) -> str | None:
    """How query chunk ``qc`` reads key chunk ``kc``: "full", "diag" (causal, the same chunk) or
    None (causal, a later chunk: nothing)."""
    if not causal or kc < qc:
        return "full"
    return "diag" if kc == qc else None


def causal_pairs(n: int, balanced: bool, causal: bool = True) -> list[float]:
    """Per shard, the (query, key) chunk pairs it computes, a diagonal pair counting half: its
    share of the attention's work."""
    out = []
    for r in range(n):
        mine = chunk_ids(r, n, balanced)
        work = 0.0
        for src in range(n):
            for qc in mine:
                for kc in chunk_ids(src, n, False):
                    kind = pair_kind(qc, kc, causal)
                    work += {"full": 1.0, "diag": 0.5, None: 0.0}[kind]
        out.append(work)
    return out


# ---- exchanges --------------------------------------------------------------------------------------
def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], g):
    """Point-to-point sends and receives (tensor, shard index of the peer) over ``g``, started in
    the order given (two ranks match theirs by order); the works to wait on."""
    if not all(t.is_contiguous() for t, _ in recvs):  # before any op starts: a rank must not leave its peer waiting
        raise ShardingError("ring attention: a point-to-point receive buffer is not contiguous")
    ops = [dist.P2POp(dist.isend, t.contiguous(), g.ranks[i], g.pg) for t, i in sends if i != g.index]
    ops += [dist.P2POp(dist.irecv, t, g.ranks[i], g.pg) for t, i in recvs if i != g.index]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works) -> None:
    for w in works:
        w.wait()


def _ring_pass(tensors, g):
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's:
    (the buffers they arrive in, the works)."""
    n, i = g.size, g.index
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    works = _exchange([(t, (i + 1) % n) for t in tensors], [(b, (i - 1) % n) for b in bufs], g)
    return bufs, works


def _holder(chunk: int, n: int, balanced: bool) -> tuple[int, int]:
    """(shard index, slot) that holds sequence chunk ``chunk`` in a layout."""
    for r in range(n):
        ids = chunk_ids(r, n, balanced)
        if chunk in ids:
            return r, ids.index(chunk)
    raise ValueError(f"chunk {chunk} of {2 * n}")


def _balance(x: torch.Tensor, dim: int, g, inverse: bool = False) -> torch.Tensor:
    """``x``, this rank's contiguous shard (chunks 2i, 2i+1 along ``dim``), in the balanced layout
    (chunks i, 2n-1-i); or back with ``inverse``. Chunks go point to point, in chunk order."""
    n, i = g.size, g.index
    have, want = chunk_ids(i, n, inverse), chunk_ids(i, n, not inverse)
    halves = x.chunk(2, dim=dim)
    out = [None, None]
    sends, recvs = [], []
    for slot, chunk in enumerate(have):
        peer, peer_slot = _holder(chunk, n, not inverse)
        if peer == i:
            out[peer_slot] = halves[slot]
        else:
            sends.append((chunk, halves[slot], peer))
    for slot, chunk in enumerate(want):
        if out[slot] is None:
            out[slot] = torch.empty_like(halves[0], memory_format=torch.contiguous_format)
            recvs.append((chunk, out[slot], _holder(chunk, n, inverse)[0]))
    _wait(_exchange([(t, p) for _, t, p in sorted(sends, key=lambda s: s[0])],
                    [(t, p) for _, t, p in sorted(recvs, key=lambda s: s[0])], g))
    return torch.cat(out, dim=dim)


# ---- the layout of one rank's attention ---------------------------------------------------------------
class _Blocks:
    """One rank's query chunks (balanced or contiguous) against a ring step's key chunks
    (contiguous): which (query slot, key slot) pairs it computes, and the grouped views
    (B, Hk, G*rows, ...) of query-side tensors by slot."""

    def __init__(self, g, q_shape, hk: int, causal: bool, balanced: bool):
        self.n, self.i, self.causal, self.balanced = g.size, g.index, causal, balanced
        self.b, self.hq, self.lq = q_shape[0], q_shape[1], q_shape[2]
        self.hk, self.half = hk, q_shape[2] // 2
        self.groups = self.hq // hk
        self.mine = chunk_ids(self.i, self.n, balanced)

    def pairs(self, src: int):
        """(query slot, key slot, key chunk, kind) of the blocks against shard ``src``'s keys."""
        for qs, qc in enumerate(self.mine):
            for ks, kc in enumerate(chunk_ids(src, self.n, False)):
                kind = pair_kind(qc, kc, self.causal)
                if kind is not None:
                    yield qs, ks, kc, kind

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """A query-side (B, Hq, Lq, ...) tensor as (B, Hk, G, Lq, ...): query head h reads key head h // G."""
        return x.reshape(self.b, self.hk, self.groups, self.lq, *x.shape[3:])

    def ungrouped(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.b, self.hq, self.lq, *x.shape[4:])

    def rows(self, grouped: torch.Tensor, slot: int) -> torch.Tensor:
        """Slot ``slot``'s rows of a grouped tensor, flattened to (B, Hk, G*half, ...) (a copy)."""
        part = grouped[:, :, :, slot * self.half:(slot + 1) * self.half]
        return part.reshape(self.b, self.hk, self.groups * self.half, *grouped.shape[4:])

    def rows_view(self, grouped: torch.Tensor, slot: int) -> torch.Tensor:
        """Slot ``slot``'s rows of a grouped tensor, (B, Hk, G, half, ...), a view to write in."""
        return grouped[:, :, :, slot * self.half:(slot + 1) * self.half]

    def keys(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        return x[:, :, slot * self.half:(slot + 1) * self.half]

    def mask(self, mask, slot: int, chunk: int):
        """The block of this rank's ``mask`` rows (broadcastable to (B, Hq, Lq, S)) for query slot
        ``slot`` and key chunk ``chunk``, as (B|1, Hk|1, G*half, half)."""
        if mask is None:
            return None
        m = mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        m = m[..., chunk * self.half:(chunk + 1) * self.half]
        if m.shape[-2] != 1:
            m = m[..., slot * self.half:(slot + 1) * self.half, :]
        b, h = m.shape[0], m.shape[1]
        m = m.expand(b, h, self.half, self.half)
        if h == 1:
            return m.unsqueeze(2).expand(b, 1, self.groups, self.half, self.half).reshape(b, 1, -1, self.half)
        return m.reshape(b, self.hk, self.groups * self.half, self.half)


# ---- the op -------------------------------------------------------------------------------------------
class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, g, causal: bool, scale: float):
        balanced = causal and mask is None
        if balanced:
            q = _balance(q, 2, g)
        blocks = _Blocks(g, q.shape, k.shape[1], causal, balanced)
        qg = blocks.grouped(q)
        out = torch.zeros(*qg.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full(qg.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        kv = (k, v)
        for step in range(g.size):
            src = (g.index - step) % g.size
            nxt, works = _ring_pass(kv, g) if step < g.size - 1 else (None, [])
            for qs, ks, kc, kind in blocks.pairs(src):
                part, part_lse = _attend(blocks.rows(qg, qs), blocks.keys(kv[0], ks), blocks.keys(kv[1], ks), scale,
                                         blocks.mask(mask, qs, kc), kind == "diag", blocks.half, blocks.groups)
                o_view, l_view = blocks.rows_view(out, qs), blocks.rows_view(lse, qs)
                merged, merged_lse = _merge(o_view.reshape(part.shape), l_view.reshape(part_lse.shape), part, part_lse)
                o_view.copy_(merged.view(o_view.shape))
                l_view.copy_(merged_lse.view(l_view.shape))
            _wait(works)
            if nxt is not None:
                kv = tuple(nxt)
        out = out.to(q.dtype)  # kept as the fused kernels keep it: in the inputs' dtype
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.g, ctx.scale, ctx.blocks = g, scale, blocks
        o = blocks.ungrouped(out)
        return _balance(o, 2, g, inverse=True) if balanced else o

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        g, scale, blocks = ctx.g, ctx.scale, ctx.blocks
        if blocks.balanced:
            grad_out = _balance(grad_out.contiguous(), 2, g)
        qg, dog = blocks.grouped(q), blocks.grouped(grad_out).float()
        dq = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        kv = (k, v)
        arriving, dworks = None, []  # the traveling key/value gradient sums of the block in hand
        for step in range(g.size):
            src = (g.index - step) % g.size
            nxt, works = _ring_pass(kv, g) if step < g.size - 1 else (None, [])
            dkv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                   torch.zeros(v.shape, dtype=torch.float32, device=v.device))
            for qs, ks, kc, kind in blocks.pairs(src):
                dq_b, dk_b, dv_b = _attend_backward(
                    blocks.rows(dog, qs), blocks.rows(qg, qs), blocks.keys(kv[0], ks), blocks.keys(kv[1], ks),
                    blocks.rows(out, qs), blocks.rows(lse, qs), scale, blocks.mask(mask, qs, kc), kind == "diag",
                    blocks.half, blocks.groups)
                dq_view = blocks.rows_view(dq, qs)
                dq_view += dq_b.view(dq_view.shape)
                blocks.keys(dkv[0], ks).add_(dk_b)
                blocks.keys(dkv[1], ks).add_(dv_b)
            # this block's part joins the sum that traveled with it (its pass overlapped the work
            # above) and goes on; one more step than the blocks brings each sum home
            _wait(dworks)
            if arriving is not None:
                dkv[0].add_(arriving[0])
                dkv[1].add_(arriving[1])
            arriving, dworks = _ring_pass(dkv, g)
            _wait(works)
            if nxt is not None:
                kv = tuple(nxt)
        _wait(dworks)
        dq = blocks.ungrouped(dq).to(q.dtype)
        dk, dv = arriving[0].to(k.dtype), arriving[1].to(v.dtype)
        if blocks.balanced:
            dq = _balance(dq, 2, g, inverse=True)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, g, *, causal: bool = False, scale: float | None = None, mask=None) -> torch.Tensor:
    """Attention of this rank's query shard over the whole sequence, the sequence split over the
    ranks of ``g`` (contiguous shards in shard order): q (B, Hq, L/n, E), k and v (B, Hk, L/n, .)
    with Hk dividing Hq; ``mask``: this rank's query rows of a mask broadcastable to
    (B, Hq, L, S), its key dim whole. The output as q's shard; differentiable."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ShardingError(f"ring attention takes (B, H, L, E) tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ShardingError(f"ring attention: {q.shape[1]} query heads do not group over {k.shape[1]} key/value heads")
    if q.shape[2] % 2 or q.shape[2] != k.shape[2]:
        raise ShardingError(f"ring attention needs an even local sequence length, the same for queries and keys "
                            f"(got {q.shape[2]} and {k.shape[2]}): split the sequence into 2 x {g.size} equal chunks")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if g.size == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])
    # (point-to-point buffers must be contiguous: the blocks travel as made here)
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), mask, g, causal, scale)
