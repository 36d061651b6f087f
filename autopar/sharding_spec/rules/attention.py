"""Scaled dot-product attention: ``sdpa(q (B.., Hq, L, E), k (B.., Hk, S, E), v (B.., Hk, S, Ev),
attn_mask broadcastable to (B.., Hq, L, S)) -> (B.., Hq, L, Ev)`` and its fused variants.

Each active mesh axis splits one of:
    a batch dim    q, k, v, the mask (where it has the full size) and the output: "dp".
    the heads      q's heads and k/v's heads (with grouped-query attention both Hq and Hk divide
                   by the ranks, so each rank's query heads find their kv heads locally) and the
                   mask's head dim where full: "heads" (Megatron attention tensor parallelism).
    the query len  q, the output and the mask's L dim where full; k and v are read whole: "sp".
                   Only without is_causal (a local causal mask would start at the rank's first
                   query, not at its global position) and, for the fused kernels, only where their
                   log-sum-exp output is laid out per query (flash; not efficient attention, which
                   pads it).
    ring           the sequence: q, k, v, the output and the mask's L dim split alike, over
                   one or more axes; ``codegen.ring_attention`` passes key/value blocks around
                   those ranks (a lowered family: "ring", or "ring(causal)" under is_causal, which
                   balances the causal work). Self-attention only (L == S), the local length
                   even, no dropout, 4-D (B, H, L, E); ``aten.scaled_dot_product_attention``
                   itself (the fused variants are not lowered).
The key length S and the head dims E, Ev are never split otherwise (softmax and the contraction
need them whole). Dropout inside attention is elementwise random, exact in distribution. Nothing
is linear, so no pending sum. Parts join with "+" in the order dp, heads, sp (or ring).
"""
from __future__ import annotations

from autopar.sharding_spec.rules._common import input_pos, is_tensor_meta, letter_choices, out_metas
from autopar.sharding_spec.strategy import RING, RING_CAUSAL, Family, OpContext, Strategy, register

SDPA = "aten.scaled_dot_product_attention.default"

# target -> (positional index of is_causal, of the mask (None: keyword only), the mask's keyword,
#            log-sum-exp layout: "per-query" (B.., H, L), "padded" (L rounded up), None (no lse))
VARIANTS = {
    "aten.scaled_dot_product_attention.default": (5, 3, "attn_mask", None),
    "aten._scaled_dot_product_flash_attention_for_cpu.default": (4, None, "attn_mask", "per-query"),
    "aten._scaled_dot_product_flash_attention.default": (4, None, None, "per-query"),
    "aten._scaled_dot_product_efficient_attention.default": (6, 3, "attn_bias", "padded"),
}


def _family(assign, batch_letters, sequence: str = "sp") -> Family:
    parts = []
    if any(ch in assign for ch in batch_letters):
        parts.append("dp")
    if "h" in assign:
        parts.append("heads")
    if "l" in assign:
        parts.append(sequence)
    return Family.of(*parts)


def ring_axes(output) -> tuple[int, ...]:
    """The mesh axes a ring strategy's sequence runs over: those splitting its output's L dim."""
    out = output[0] if isinstance(output, tuple) else output
    return tuple(out.dim_axes[-2])


def ring_blocks(strategy, mesh) -> int:
    """How many blocks of its local shapes a strategy's op computes: n for ring attention over n
    ranks (its key/value blocks go round), 1 for any other."""
    if strategy is None or strategy.family.ring is None:
        return 1
    return mesh.axes_size(ring_axes(strategy.output))


@register(*VARIANTS)
def attention_rule(ctx: OpContext) -> list[Strategy]:
    causal_i, mask_i, mask_kw, lse = VARIANTS[ctx.node.target]
    q_p, k_p, v_p = input_pos(ctx, 0, "query"), input_pos(ctx, 1, "key"), input_pos(ctx, 2, "value")
    if None in (q_p, k_p, v_p):
        return []
    q, k, v = (ctx.input_metas[p] for p in (q_p, k_p, v_p))
    nd = len(q.shape)
    if nd < 3 or len(k.shape) != nd or len(v.shape) != nd:
        return []
    has_heads = nd >= 4
    batch = tuple(f"b{j}" for j in range(nd - 3 if has_heads else nd - 2))
    lead = batch + (("h",) if has_heads else ())  # q's leading dims
    q_letters = lead + ("l", None)

    def kv_letters(shape):
        out = []
        for j, ch in enumerate(lead):
            if shape[j] == q.shape[j] or (ch == "h" and shape[j] > 1):  # grouped-query heads
                out.append(ch)
            elif shape[j] == 1:
                out.append(None)
            else:
                return None
        return tuple(out) + (None, None)

    k_letters, v_letters = kv_letters(k.shape), kv_letters(v.shape)
    if k_letters is None or v_letters is None:
        return []
    ins = [None] * len(ctx.input_metas)
    ins[q_p], ins[k_p], ins[v_p] = (tuple(q.shape), q_letters), (tuple(k.shape), k_letters), (tuple(v.shape), v_letters)
    mask_p = input_pos(ctx, 99 if mask_i is None else mask_i, mask_kw) if mask_kw else None
    if mask_p is not None:
        m = ctx.input_metas[mask_p]
        full = tuple(q.shape[:-1]) + (k.shape[-2],)  # (B.., Hq, L, S)
        ref = q_letters[:-1] + (None,)
        off = len(full) - len(m.shape)
        if off < 0:
            return []
        ins[mask_p] = (tuple(m.shape), tuple(ref[off + j] if m.shape[j] == full[off + j] else None for j in range(len(m.shape))))
    causal = bool(ctx.arg(causal_i, "is_causal", False))
    outs = []
    for j, m in enumerate(out_metas(ctx)):
        if not is_tensor_meta(m):
            outs.append(None)
        elif j == 0:
            outs.append((tuple(m.shape), q_letters))
        elif j == 1 and lse is not None:  # log-sum-exp (B.., H, L)
            outs.append((tuple(m.shape), lead + (("l",) if lse == "per-query" else (None,))))
        elif m.numel > 1:
            return []  # a debug attention mask: computed per rank, not splittable here
        else:  # rng seed and offset scalars
            outs.append((tuple(m.shape), (None,) * len(m.shape)))
    if any(o is not None and len(o[0]) != len(o[1]) for o in outs):
        return []
    splittable = list(lead) + ([] if causal or lse == "padded" else ["l"])
    single = not isinstance(ctx.out_meta, tuple)
    out = [
        Strategy(c.inputs, c.output(single), _family(c.assign, batch), c.split_fraction)
        for c in letter_choices(ctx.mesh, ins, outs, splittable=splittable)
    ]
    dropout = ctx.arg(4, "dropout_p", 0.0)
    if ctx.node.target == SDPA and nd == 4 and q.shape[-2] == k.shape[-2] and not dropout:
        # ring: k and v split along the sequence like q
        ins[k_p] = (tuple(k.shape), k_letters[:-2] + ("l", None))
        ins[v_p] = (tuple(v.shape), v_letters[:-2] + ("l", None))
        name = RING_CAUSAL if causal else RING
        for c in letter_choices(ctx.mesh, ins, outs, splittable=list(lead) + ["l"]):
            ways = ctx.mesh.axes_size(c.assign["l"]) if "l" in c.assign else 1
            if ways > 1 and q.shape[-2] % (2 * ways) == 0:  # 2 x ways equal chunks
                out.append(Strategy(c.inputs, c.output(single), _family(c.assign, batch, name), c.split_fraction))
    return out
