"""The gradient buckets the reducer fills and the step model prices, from one assignment.

Gradients are synchronised in flat buckets per (collective, axes, dtype, device), launched during
backward in the order backward finishes the parameters (the reverse of their first reads): a small
first bucket, so its collective starts early, then ``DEFAULT_BUCKET_BYTES`` each (DDP's 25 MiB).
ZeRO-2 buckets are summed by reduce-scatter-like collectives whose whole-bucket buffers the reducer
keeps in a pool from step to step; ``zero2_pool_cap`` bounds it.
"""
from __future__ import annotations

from autopar.ir.graph import per_graph

DEFAULT_BUCKET_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20
# ZeRO-2 reduce-scatters in flight at once (``runtime.reducer``): each holds a whole bucket.
SCATTERS_IN_FLIGHT = 2
# The share of the gradient bytes ZeRO-2 frees (each rank keeps its chunk of a gradient, not the
# whole) that the reducer's pool may spend on keeping bucket buffers from step to step: a pool as
# large as the buckets in use (a model whose gradients fit in a few buckets: all of them, twice for
# an all-to-all) held more than data parallel does. Buffers past the cap are made anew each use;
# the pool keeps whole buffers, so a model whose one bucket outgrows the cap keeps none.
POOL_SHARE_OF_SAVING = 0.5


def pooled_buffers(sum_by: str) -> int:
    """Whole-bucket buffers a ZeRO-2 sum by the collective ``sum_by`` (``GradSync.sum_by``) keeps:
    the one sent, and for an all-to-all the one received."""
    return 2 if sum_by == "all_to_all" else 1


def zero2_in_use_bytes(kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """The buffers ZeRO-2 buckets summed by ``kind`` use at once: those a sum uses
    (``pooled_buffers``) of ``SCATTERS_IN_FLIGHT`` buckets and one filling."""
    return pooled_buffers(kind) * (SCATTERS_IN_FLIGHT + 1) * bucket_bytes


def zero2_pool_cap(kind: str, saved_bytes: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """The most bytes the reducer's pool keeps for ZeRO-2 buckets summed by ``kind``: the buffers in
    use at once (``zero2_in_use_bytes``), and no more than ``POOL_SHARE_OF_SAVING`` of
    ``saved_bytes``, the gradient bytes ZeRO-2 frees on this rank (``zero2_saved_bytes``)."""
    return int(min(zero2_in_use_bytes(kind, bucket_bytes), POOL_SHARE_OF_SAVING * saved_bytes))


def zero2_saved_bytes(grads) -> float:
    """The gradient bytes ZeRO-2 frees on a rank: for each (whole gradient bytes, ranks it is split
    over) of ``grads``, all but the rank's chunk."""
    return sum(nbytes * (1 - 1 / ways) for nbytes, ways in grads if ways > 1)


def bucket_sizes(total: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[int]:
    """The reducer's buckets for ``total`` gradient bytes of one (collective, axes) group: a small
    first bucket (its collective starts early in backward), then ``bucket_bytes`` each. Parameters
    are never split across buckets in the runtime; this ignores that rounding."""
    if total <= 0:
        return []
    first = min(FIRST_BUCKET_BYTES, bucket_bytes)
    sizes = [min(total, first)]
    rest = total - sizes[0]
    while rest > 0:
        sizes.append(min(rest, bucket_bytes))
        rest -= sizes[-1]
    return sizes


def assign_buckets(items, bucket_bytes: int = DEFAULT_BUCKET_BYTES, first_bucket_bytes: int = FIRST_BUCKET_BYTES
                   ) -> list[tuple[object, list[int], int]]:
    """The reducer's buckets (``runtime.reducer.GradReducer``) and the step model's: ``items`` are
    (key, bytes) in the order backward finishes them (the reverse of the forward's first reads);
    each key (collective, axes, dtype, device) fills buckets of its own, a parameter never split
    across two; the first bucket made holds at most ``first_bucket_bytes`` (its collective starts
    early in backward), every other ``bucket_bytes``. Returns (key, item indices, bytes) per
    bucket, in the order they are made."""
    open_: dict = {}
    made: list[list] = []
    for i, (key, nbytes) in enumerate(items):
        cap = min(first_bucket_bytes, bucket_bytes) if not made else bucket_bytes
        cur = open_.get(key)
        if cur is None or (cur[2] + nbytes > cur[3] and cur[1]):
            cur = open_[key] = [key, [], 0, cap]
            made.append(cur)
        cur[1].append(i)
        cur[2] += nbytes
    return [(key, members, total) for key, members, total, _ in made]


def bucket_count(total: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """``len(bucket_sizes(total, bucket_bytes))``, without the list (a 175B model fills ~13,000)."""
    if total <= 0:
        return 0
    first = min(FIRST_BUCKET_BYTES, bucket_bytes)
    return 1 + -(-max(0, total - first) // bucket_bytes)


@per_graph
def first_reads(graph) -> dict[str, int]:
    """Placeholder -> the forward position of its first reader (its gradient is finished in the
    reverse order; the reducer orders its buckets so)."""
    order = {n: t for t, n in enumerate(graph.nodes)}
    return {name: min((order[u] for u in node.users), default=len(order)) for name, node in graph.nodes.items()
            if node.op == "placeholder"}


