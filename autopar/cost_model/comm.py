"""Alpha-beta prices of collectives, in seconds. Pure functions of (kind, bytes, group).

A collective over a group of n ranks runs as a ring (or pairwise exchange) of ``n - 1`` hops. Each
call also pays one alpha of set-up, so one fused collective beats two that move the same data:

    all_gather      alpha * n        + beta * (n-1)/n * B      B = bytes each rank ends with
    reduce_scatter  alpha * n        + beta * (n-1)/n * B      B = bytes each rank starts with
    all_to_all      alpha * n        + beta * (n-1)/n * B      B = bytes each rank holds
    all_reduce      alpha * (2n - 1) + beta * 2(n-1)/n * B     B = bytes each rank holds

A group spanning several mesh axes is priced on its slowest link: the largest alpha and the
largest beta among its axes (a ring over the group crosses every kind of link it contains).
``mesh_collective_time`` also multiplies alpha and beta by the cluster's
``collective_factor(kind)`` ((1, 1) unless a profiled cluster measured that the backend runs that
kind slower or faster than the ring model), and prices an all_reduce of one value (at most
``SCALAR_BYTES``) at the cluster's ``scalar_all_reduce_alphas`` where it has one: a backend need not
run its ring for a value it cannot split (gloo, measured: about one hop where the ring pays 2n - 1).
"""
from __future__ import annotations

import math
from typing import Sequence

from autopar.cluster import Link

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


SCALAR_BYTES = 8  # one value of any dtype: what ``scalar_all_reduce_alphas`` prices


def local_sum_time(kind: str, nbytes: float, n: int, cluster) -> float:
    """Seconds a rank spends after a ZeRO-2 sum-and-split collective ``kind`` of ``nbytes`` on
    ``n`` ranks: an all-to-all leaves it the ``n`` parts of its chunk to add up (memory-bound:
    read them all, write one); the others end with the sum."""
    if kind != "all_to_all" or n <= 1:
        return 0.0
    return nbytes * (1 + 1 / n) / cluster.sustained_memory_bandwidth


def group_link(links: Sequence[Link]) -> Link:
    """The effective link of a group over several mesh axes."""
    if not links:
        raise ValueError("a group needs at least one mesh axis")
    return Link(alpha=max(l.alpha for l in links), beta=max(l.beta for l in links))


def latency_hops(kind: str, n: int) -> float:
    """How many alphas one call of ``kind`` on ``n`` ranks pays (0 when there is nothing to do)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * n - 1
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n
    raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")


def volume_factor(kind: str, n: int) -> float:
    """How many times B each rank sends over the wire, as a fraction."""
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    return 2 * frac if kind == "all_reduce" else frac


def collective_time(kind: str, nbytes: float, n: int, link: Link, scalar_alphas: float | None = None) -> float:
    """Seconds for one ``kind`` collective of ``nbytes`` (see the module docstring for which bytes);
    ``scalar_alphas``: the alphas of an all_reduce of one value, where not the ring's."""
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    hops = latency_hops(kind, n)
    if scalar_alphas is not None and kind == "all_reduce" and nbytes <= SCALAR_BYTES and hops:
        hops = min(hops, scalar_alphas)
    return link.alpha * hops + link.beta * volume_factor(kind, n) * nbytes


def mesh_collective_time(kind: str, nbytes: float, mesh, axes: Sequence[int], *, alone: bool = True) -> float:
    """Seconds for ``kind`` on the mesh's group over ``axes``. ``alone``: the call moves these bytes
    only (False: they share a bigger call, a gradient bucket, which runs the ring whatever their size)."""
    links = mesh.links()
    link = group_link([links[a] for a in axes])
    cluster = mesh.resolved_cluster()
    fa, fb = cluster.collective_factor(kind)
    if (fa, fb) != (1.0, 1.0):
        link = Link(link.alpha * fa, link.beta * fb)
    n = math.prod(mesh.shape[a] for a in axes)
    return (collective_time(kind, nbytes, n, link, cluster.scalar_all_reduce_alphas if alone else None)
            + (cluster.collective_overhead_s if n > 1 else 0.0))


def send_time(nbytes: float, mesh, axes: Sequence[int]) -> float:
    """Seconds for a point-to-point send of ``nbytes`` between ranks of the mesh's group on ``axes``
    (a pipeline stage's activation to the next, a ring attention block to a neighbour): one alpha
    and the bytes once on the group's slowest link, and the per-call overhead of a call reached
    from compute. A rank sending and receiving at once pays it once."""
    if math.prod(mesh.shape[a] for a in axes) <= 1:
        return 0.0
    links = mesh.links()
    link = group_link([links[a] for a in axes])
    return link.alpha + link.beta * nbytes + mesh.resolved_cluster().collective_overhead_s


def ring_pass_time(nbytes: float, mesh, axes: Sequence[int]) -> float:
    """Seconds for one step of a ring over the mesh's group on ``axes``: every rank sends
    ``nbytes`` to the next and receives as many from the previous, both at once (``send_time``)."""
    return send_time(nbytes, mesh, axes) if nbytes > 0 else 0.0


def layout_copy_bytes(kind: str, nbytes: float, n: int, src_dim: int | None = None, dst_dim: int | None = None) -> float:
    """Bytes one call of ``kind`` copies on the rank besides the wire (``codegen.collectives``):
    collectives send and receive contiguous memory, so a dim other than the leading one is moved
    in front and back, a reduce-scatter packs its input (gloo may reduce into it) and an all-reduce
    sums a copy; a slice (local) copies out its chunk. ``nbytes`` as the alpha-beta formulas count
    it (a slice's: its input); ``src_dim``: the dim gathered or received, ``dst_dim``: the dim
    scattered or sent."""
    if n <= 1:
        return 0.0
    if kind == "slice":  # the chunk cut out and made contiguous
        return nbytes / n
    if kind == "all_gather":
        return packed_gather_bytes(nbytes, n) if src_dim else 0.0
    if kind == "reduce_scatter":
        return nbytes + (nbytes / n if dst_dim else 0.0)
    if kind == "all_to_all":
        return (nbytes if dst_dim else 0.0) + (nbytes if src_dim else 0.0)
    return nbytes  # all_reduce


def packed_gather_bytes(nbytes: float, n: int) -> float:
    """Bytes an all-gather of ``nbytes`` (gathered) on ``n`` ranks copies where its shard is packed
    into the buffer sent and the whole is unpacked out of the one received (a dim other than the
    leading one; a layer's or ZeRO-2's gather of several parameters in one call)."""
    return nbytes / n + nbytes if n > 1 else 0.0


def layout_copy_time(nbytes: float, cluster) -> float:
    """Seconds to copy ``nbytes`` in memory (read and write), at the cluster's sustained bandwidth."""
    return 2.0 * nbytes / cluster.sustained_memory_bandwidth if nbytes else 0.0


def slice_backward_time(nbytes: float, n: int, cluster) -> float:
    """Seconds of a slice's backward (``codegen.collectives.Slice``): the gradient of its ``nbytes``
    input written as zeros into a new tensor and the chunk's gradient copied in (a tied embedding read split by its
    lookup pays its whole table here every step)."""
    if n <= 1:
        return 0.0
    return nbytes / cluster.fresh_write_bandwidth + 2.0 * nbytes / n / cluster.sustained_memory_bandwidth
