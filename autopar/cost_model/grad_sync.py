"""The price of a parameter's gradient sync as the reducer runs it, one formula for the ILP and the
step model.

The reducer (``runtime.reducer``) sums gradients in flat buckets, one run of buckets per group of
gradients synchronised alike (``SyncPrice.group``: collective, axes, dtype). A group pays its
collective's latency once for its first bucket, whatever it holds, and each gradient its share of
one more call (its bytes over ``bucket_bytes``, at most one: the reducer never splits a gradient,
so one past a bucket's size is a bucket of its own); the runtime's count is within one call of
this. Every byte is paid once. So a parameter's price is linear in its bytes but for one
latency per group paid when any parameter syncs there: the ILP charges that as a once-paid cost
(``ilp.OnceCost``), the step model per group it finds.

Under overlap (a GPU's copy engine) backward hides the sums but the last bucket's
(``SyncPrice.floor_s``: the share of a parameter's sum one bucket of the model's gradients is, and
every group's first latency); ZeRO-2's all-gather of the updated chunk after the step, its packing
copies and the buffers it makes anew (``zero2_fresh_s``) are never hidden.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from autopar.cost_model.comm import layout_copy_time, local_sum_time, mesh_collective_time, packed_gather_bytes
from autopar.record.buckets import DEFAULT_BUCKET_BYTES, pooled_buffers, zero2_in_use_bytes, zero2_pool_cap, zero2_saved_bytes


@dataclasses.dataclass(frozen=True)
class SyncPrice:
    """Seconds one step spends on one parameter's gradient sync. ``group``: (collective, axes,
    dtype, the collectives after the step) of the reducer's buckets it joins; ``latency_s`` /
    ``after_latency_s``: the group's first call of the sum / of the gathers after the step, paid
    once per group; ``sum_s``: its bytes in the sums, its share of further buckets' latency and,
    for an all-to-all, adding up its chunk (backward may hide these); ``floor_s``: the part of
    ``sum_s`` in the last bucket; ``gather_s``: ZeRO-2's all-gather of the updated chunk with its
    packing copies; ``fresh_s``: ZeRO-2's buffers made anew (``zero2_fresh_s``)."""

    group: tuple
    latency_s: float
    after_latency_s: float
    sum_s: float
    floor_s: float
    gather_s: float = 0.0
    fresh_s: float = 0.0

    @property
    def per_tensor_s(self) -> float:
        """What the parameter pays beside its group's first calls."""
        return self.sum_s + self.gather_s + self.fresh_s


def grad_bytes_total(graph, precision=None) -> float:
    """Bytes of all the model's gradients as the reducer sums them (in ``precision``'s reduction
    dtype, else each parameter's own): what fills the buckets."""
    if precision is None:
        return float(graph.param_bytes())
    itemsize = precision.reduce_dtype.itemsize
    return float(sum(graph.nodes[n].meta.nbytes // graph.nodes[n].meta.itemsize * itemsize for n in graph.params.values()))


def last_bucket_share(total_bytes: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """The share of the model's gradients (``total_bytes``) the last bucket holds."""
    return min(1.0, bucket_bytes / max(1.0, total_bytes))


def sync_price(sync, working_bytes: float, dtype, mesh, *, total_bytes: float,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncPrice:
    """The price of ``sync`` (a ``record.grad_sync.GradSync``) of a parameter whose local working
    copy is ``working_bytes`` (ZeRO-2 gathers that), of ``dtype``, on ``mesh``, in a model whose
    gradients are ``total_bytes`` (``grad_bytes_total``)."""
    return _sync_price(sync, float(working_bytes), dtype, mesh, float(total_bytes), int(bucket_bytes))


@functools.lru_cache(maxsize=1 << 16)  # repeated blocks price the same syncs over and over
def _sync_price(sync, working_bytes: float, dtype, mesh, total_bytes: float, bucket_bytes: int) -> SyncPrice:
    cluster = mesh.resolved_cluster()
    kind, *after = sync.collectives
    ways = math.prod(mesh.shape[a] for a in sync.axes)
    nbytes = sync.nbytes
    latency = mesh_collective_time(kind, 0, mesh, sync.axes, alone=False)
    per_byte = mesh_collective_time(kind, nbytes, mesh, sync.axes, alone=False) - latency + local_sum_time(kind, nbytes, ways, cluster)
    share = min(1.0, nbytes / bucket_bytes)  # a gradient past a bucket's size is a bucket of its own
    sum_s = per_byte + latency * share
    after_latency = gather = fresh = 0.0
    for k in after:  # ZeRO-2's all-gather of the updated chunk, in the same buckets
        lat = mesh_collective_time(k, 0, mesh, sync.axes, alone=False)
        after_latency += lat
        gather += (mesh_collective_time(k, working_bytes, mesh, sync.axes, alone=False) - lat + lat * share
                   + layout_copy_time(packed_gather_bytes(working_bytes, ways), cluster))
    if sync.split:
        # the rank's ZeRO-2 gradients are priced as if all were, split as this one
        fresh = zero2_fresh_s(nbytes, kind, total_bytes, zero2_saved_bytes([(total_bytes, ways)]), working_bytes, ways,
                              cluster, bucket_bytes)
    return SyncPrice((kind, sync.axes, str(dtype), tuple(after)), latency, after_latency, sum_s,
                     per_byte * last_bucket_share(total_bytes, bucket_bytes), gather, fresh)


def group_latencies(prices) -> dict[tuple, tuple[float, float]]:
    """Group -> (its first sum's latency, its first gathers' latency) over ``prices``."""
    return {p.group: (p.latency_s, p.after_latency_s) for p in prices}


def with_group_shares(prices) -> list[float]:
    """Each price's seconds with its share (by ``sum_s``) of its group's first calls, so that they
    add up to what the syncs cost together: a plan's per-parameter figure."""
    totals: dict = {}  # group -> (its prices' sum_s, how many)
    for p in prices:
        total, count = totals.get(p.group, (0.0, 0))
        totals[p.group] = (total + p.sum_s, count + 1)
    out = []
    for p in prices:
        total, count = totals[p.group]
        weight = p.sum_s / total if total > 0 else 1.0 / count
        out.append(p.per_tensor_s + (p.latency_s + p.after_latency_s) * weight)
    return out


def zero2_pool_kept(kind: str, zero2_bytes: float, saved_bytes: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """Bytes the reducer's pool keeps from step to step for the rank's ZeRO-2 gradients
    (``zero2_bytes`` whole, ``saved_bytes`` freed: ``zero2_saved_bytes``): whole buckets' buffers
    (``pooled_buffers`` of a full bucket each) up to ``zero2_pool_cap``."""
    bucket = pooled_buffers(kind) * min(zero2_bytes, bucket_bytes)
    if bucket <= 0:
        return 0.0
    return float(zero2_pool_cap(kind, saved_bytes, bucket_bytes) // bucket * bucket)


def zero2_pool_bytes(grad_bytes: float, kind: str, zero2_bytes: float, saved_bytes: float,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """Bytes a ZeRO-2 gradient of ``grad_bytes`` (in its reduction dtype) adds to the reducer's
    pool: its share of what the pool keeps (``zero2_pool_kept``)."""
    zero2_bytes = zero2_bytes or grad_bytes
    if not zero2_bytes:
        return 0.0
    return grad_bytes * zero2_pool_kept(kind, zero2_bytes, saved_bytes, bucket_bytes) / zero2_bytes


def zero2_fresh_s(grad_bytes: float, kind: str, zero2_bytes: float, saved_bytes: float, gathered_bytes: float,
                  ways: int, cluster, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """Seconds a step spends faulting in the pages of the ZeRO-2 buffers the pool does not keep
    (``zero2_pool_kept``) for a gradient of ``grad_bytes``: its share of the buffers the sum takes
    (``pooled_buffers``) and the gather after the step (the chunk and the whole, ``gathered_bytes``
    in the working dtype), made anew each use, written at ``fresh_write_bandwidth`` instead of the
    sustained rate (none where the allocator keeps its blocks, as a GPU's does)."""
    zero2_bytes = zero2_bytes or grad_bytes
    per_byte = max(0.0, 1.0 / cluster.fresh_write_bandwidth - 1.0 / cluster.sustained_memory_bandwidth)
    if not zero2_bytes or not per_byte:
        return 0.0
    buffers = pooled_buffers(kind)
    wanted = min(buffers * zero2_bytes, zero2_in_use_bytes(kind, bucket_bytes))
    fresh = 1.0 - min(1.0, zero2_pool_kept(kind, zero2_bytes, saved_bytes, bucket_bytes) / wanted)
    taken = buffers * grad_bytes + gathered_bytes * (1 + 1 / ways)
    return fresh * taken * per_byte
