"""Embedding lookup: ``aten.embedding(weight[V, H], indices[...]) -> out[..., H]``.

Each active mesh axis splits one of:
    an indices dim      the output splits the same dim; the table is read whole on that axis.
                        Family part "dp" (dim 0) or "sp" (a later dim).
    H (hidden)          the table by columns, the output's last dim: "embedding-hidden".
    V (vocabulary)      the table by rows, the output a pending sum: "embedding-vocab-parallel".

Vocabulary-parallel is NOT what the local ``aten.embedding`` computes on a row shard of the table
(it would index out of range). Codegen must lower a strategy whose family contains
"embedding-vocab-parallel" as a masked lookup, per rank with row offset ``off`` and ``V_local``
rows over the V axes::

    local = indices - off
    hit = (local >= 0) & (local < V_local)
    out = embedding(weight_shard, local.masked_fill(~hit, 0)).masked_fill(~hit[..., None], 0)

so each rank holds its rows' embeddings and zeros elsewhere: together, a pending sum over the V
axes. The parts of a family are joined with "+" in the order dp, sp, embedding-hidden,
embedding-vocab-parallel. ``padding_idx`` only affects gradients and is kept as is.
"""
from __future__ import annotations

from autopar.sharding_spec.rules._common import is_tensor_meta, letter_choices, letters_for
from autopar.sharding_spec.strategy import VOCAB_EMBEDDING, Family, OpContext, Strategy, register


def embedding_family(assign: dict, idx_letters: tuple[str, ...]) -> Family:
    parts = []
    if idx_letters and idx_letters[0] in assign:
        parts.append("dp")
    if any(ch in assign for ch in idx_letters[1:]):
        parts.append("sp")
    if "h" in assign:
        parts.append("embedding-hidden")
    if "v" in assign:
        parts.append(VOCAB_EMBEDDING)
    return Family.of(*parts)


@register("aten.embedding.default")
def embedding_rule(ctx: OpContext) -> list[Strategy]:
    w, idx = ctx.input_metas[0], ctx.input_metas[1]
    if not (is_tensor_meta(w) and is_tensor_meta(idx)) or len(w.shape) != 2:
        return []
    idx_letters = letters_for(len(idx.shape))
    ins = [(tuple(w.shape), ("v", "h")), (tuple(idx.shape), idx_letters)] + [None] * (len(ctx.input_metas) - 2)
    outs = [(tuple(ctx.out_meta.shape), idx_letters + ("h",))]
    out = []
    for c in letter_choices(ctx.mesh, ins, outs, splittable=idx_letters + ("h", "v")):
        # A vocabulary split saves no work: every rank still reads (or zeroes) a row per index.
        frac = c.split_fraction * ctx.mesh.axes_size(c.assign.get("v", ()))
        out.append(Strategy(c.inputs, c.outputs[0], embedding_family(c.assign, idx_letters), frac))
    return out
