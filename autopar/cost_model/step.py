"""One training step of a chosen plan, priced the way the runtime runs it.

The ILP adds per-node and per-edge prices; the runtime runs more than that sum: every op pays a
framework overhead (views included), parameters stored split (ZeRO-3) are gathered a layer at a
time (``param_gather_groups``), gradients are synchronised in buckets (``GradReducer``: flat
buckets per (collective, axes), launched during backward, waited once at its end), ZeRO-2
parameters are all-gathered in the same buckets before the next forward, and the optimizer steps
every local shard. ``step_time`` prices exactly these, per rank:

    step = compute + op overheads + reshard collectives (forward and their backward duals)
         + collectives inside lowered ops (vocabulary-parallel loss) + gradient sums of
           identical-gradient axes (``autopar.cost_model.gradients``) + gradient accumulation
           (``accumulate_s``) + exposed gradient sync + ZeRO-2 parameter gathers + the pages of
           ZeRO-2 buffers its pool does not keep (``zero2_fresh_s``) + optimizer

    exposed sync = max(the last bucket's collective, sync - comm_overlap * backward compute)

(the last bucket is ready only when backward ends, so it is never hidden; ``comm_overlap`` from
the cluster: 1 where a copy engine or a spare core runs collectives beside compute, 0 where ranks
share their cores with gloo's threads).
"""
from __future__ import annotations

import math

from autopar.cost_model.comm import layout_copy_time, local_sum_time, mesh_collective_time, packed_gather_bytes
from autopar.cost_model.gradients import backward_reshard_s, grad_sum_s
from autopar.record.gradients import whole_on
from autopar.cost_model.lowered import lowered_comm_s
from autopar.ir.graph import edge_itemsize, runs_backward
from autopar.ir.losses import counted_from_inputs
from autopar.record.buckets import (
    DEFAULT_BUCKET_BYTES, assign_buckets, first_reads, pooled_buffers, zero2_in_use_bytes, zero2_pool_cap,
    zero2_saved_bytes,
)
from autopar.record.gathers import param_gather_groups
from autopar.sharding_spec.reshard import local_bytes
from autopar.sharding_spec.strategy import needs_lowering


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


def zero2_totals(plan, mesh) -> tuple[float, float]:
    """(the whole bytes of the rank's ZeRO-2 gradients, the bytes ZeRO-2 frees of them:
    ``zero2_saved_bytes``) under ``plan``, what its pool's share and fresh pages are priced from."""
    zero2 = [(p.grad_sync.nbytes, math.prod(mesh.shape[a] for a in p.grad_sync.axes)) for p in plan.params.values()
             if not p.buffer and p.grad_sync is not None and p.grad_sync.split]
    return sum(n for n, _ in zero2), zero2_saved_bytes(zero2)


def op_overheads_s(node, grad, cluster) -> tuple[float, float]:
    """(forward, backward) framework seconds of one traced op run eagerly: every op pays the
    forward's; only an op a gradient flows through (an input in ``grad``: ``ir.graph.needs_grad``)
    runs a backward."""
    backward = cluster.backward_op_overhead_s if runs_backward(node, grad) else 0.0
    return cluster.op_overhead_s, backward


def in_op_comm_s(node_plan, graph, mesh, identical=()) -> float:
    """Seconds of the collectives a lowered family runs inside its op, forward and backward
    (``cost_model.lowered``), on a plan whose gradients are whole on the ``identical`` axes; 0 for
    the families run as the plain local op."""
    if not needs_lowering(node_plan.family):
        return 0.0
    node = graph.nodes[node_plan.name]
    return lowered_comm_s(node_plan.target, node_plan.family, node_plan.inputs, node_plan.output, mesh,
                          identical=identical, counted_locally=counted_from_inputs(graph, node),
                          compute_s=node_plan.compute_s, value_itemsize=getattr(node.meta, "itemsize", 4))


def optimizer_s(elements: float, tensors: float, cluster) -> float:
    """Seconds of the optimizer's step over ``elements`` local elements in ``tensors`` tensors
    (the profiled AdamW rates: per element and per tensor)."""
    return elements * cluster.optimizer_s_per_element + tensors * cluster.optimizer_s_per_tensor


def accumulate_s(nbytes: float, bucketed: bool, step_share: float, cluster) -> float:
    """Seconds per run of the graph (one microbatch) the runtime spends adding one parameter's
    local gradient (``nbytes``) into what holds it: memory-bound, three passes (read the sum, read
    the part, write the sum) and one op. A bucketed gradient (the reducer's) is copied into its
    buffer by the step's first run (two passes) and added by the others; the others are autograd's,
    whose first run keeps its gradient as it is. ``step_share``: the share of a step one run is. With
    many microbatches this is real work: GPT-3 on a stage holding whole attention weights adds
    ~4.5 GB of bfloat16 gradients per microbatch, ~16% of its compute on an A100."""
    runs = 1.0 if bucketed else 1.0 - step_share
    passes = 3.0 * runs - (step_share if bucketed else 0.0)
    return nbytes * passes / cluster.sustained_memory_bandwidth + runs * cluster.backward_op_overhead_s


def reshard_s(graph, edges, mesh, identical=()) -> float:
    """Seconds of ``edges``' reshards, forward and backward, as the runtime runs them: parameters
    gathered whole in groups (``param_gather_groups``: one all-gather per group of a layer, each
    parameter once, one reduce-scatter back), every other edge its steps and their duals. The
    step model prices a plan's edges with it, and the ILP's objective is corrected to it."""
    groups, grouped = param_gather_groups(graph, edges, least=1)
    total = sum(e.forward_s + backward_reshard_s(e, mesh, identical, edge_itemsize(graph.nodes[e.src].meta, graph.nodes[e.dst]))
                for e in edges if (e.dst, e.position) not in grouped)
    cluster = mesh.resolved_cluster()
    for (_, axes), members in groups.items():  # one gather per group, one reduce-scatter back
        nbytes = sum(e.steps[0].nbytes for _, e in members)
        # the shards packed into the buffer sent, every full tensor cut out of the one received
        copies = packed_gather_bytes(nbytes, math.prod(mesh.shape[a] for a in axes))
        total += mesh_collective_time("all_gather", nbytes, mesh, axes) + layout_copy_time(copies, cluster)
        if any(e.backward for _, e in members) and not whole_on(axes, identical):
            total += mesh_collective_time("reduce_scatter", nbytes, mesh, axes) + layout_copy_time(copies, cluster)
    return total


def step_time(plan, graph, mesh, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """Seconds of one training step per rank under ``plan`` (see the module docstring), by part.
    ``mesh``: the mesh the plan was priced on (its cluster gives links, overheads and overlap)."""
    from autopar.ir.graph import needs_grad

    cluster = mesh.resolved_cluster()
    grad = needs_grad(graph)
    compute = overhead = 0.0
    backward_compute = 0.0
    for name, n in plan.nodes.items():
        node = graph.nodes.get(name)
        if node is None or node.op != "call_function":
            continue
        compute += n.compute_s
        forward_s, backward_s = op_overheads_s(node, grad, cluster)
        overhead += forward_s + backward_s
        if runs_backward(node, grad):
            backward_compute += n.compute_s * 2 / 3  # node compute is forward + backward (x2)
    identical = plan.identical_axes
    reshard = reshard_s(graph, plan.edges, mesh, identical)
    in_ops = sum(in_op_comm_s(n, graph, mesh, identical) for n in plan.nodes.values())
    in_ops += grad_sum_s(plan, graph, mesh, identical)

    first_use = first_reads(graph)
    # (first use, (collective, axes, dtype, ZeRO-2's all-gathers after the step, their bytes per
    # synced byte: a gradient summed in a wider dtype than the working copy gathered), bytes)
    synced = []
    elements = tensors = 0
    accumulate = fresh = 0.0
    zero2_bytes, saved = zero2_totals(plan, mesh)
    for p in plan.params.values():
        if p.buffer:
            continue
        accumulate += p.accumulate_s
        meta = graph.nodes[p.node].meta
        local = local_bytes(p.storage, mesh.shape, meta.itemsize)  # (a gradient may be synced in a wider dtype)
        if p.grad_sync is not None:
            sync = p.grad_sync
            first, *rest = sync.collectives
            key = (first, sync.axes, str(meta.dtype), tuple(rest), round(local / sync.nbytes, 6) if sync.nbytes else 1.0)
            synced.append((first_use.get(p.node, 0), key, int(sync.nbytes)))
            if sync.split:
                ways = math.prod(mesh.shape[a] for a in sync.axes)
                fresh += zero2_fresh_s(sync.nbytes, sync.sum_by, zero2_bytes, saved, local, ways, cluster, bucket_bytes)
                local = local / ways
        elements += local / meta.itemsize
        tensors += 1
    # the reducer's buckets (``assign_buckets``), in backward's order; ZeRO-2's updated chunks are
    # all-gathered in the same buckets before the next forward
    synced.sort(key=lambda x: -x[0])
    buckets, gathers = [], 0.0
    priced: dict = {}
    for (kind, axes, _, after, gathered), _, nbytes in assign_buckets([(key, n) for _, key, n in synced], bucket_bytes):
        ways = math.prod(mesh.shape[a] for a in axes)
        for k, n in ((kind, nbytes), *((a, int(nbytes * gathered)) for a in after)):
            if (k, axes, n) not in priced:
                priced[(k, axes, n)] = mesh_collective_time(k, n, mesh, axes) + local_sum_time(k, n, ways, cluster)
        buckets.append(priced[(kind, axes, nbytes)])
        # each all-gather after the step packs the chunk and unpacks the whole into the working copies
        gathers += sum(priced[(k, axes, int(nbytes * gathered))] + layout_copy_time(packed_gather_bytes(nbytes * gathered, ways), cluster)
                       for k in after)
    sync = sum(buckets)
    exposed = max(max(buckets, default=0.0), sync - cluster.comm_overlap * backward_compute) if buckets else 0.0
    optimizer = optimizer_s(elements, tensors, cluster)
    total = compute + overhead + reshard + in_ops + exposed + gathers + fresh + optimizer + accumulate
    return {
        "compute_s": compute,
        "overhead_s": overhead,
        "reshard_s": reshard,
        "op_comm_s": in_ops,
        "grad_sync_s": sync,
        "exposed_sync_s": exposed,
        "param_gather_s": gathers,
        "zero2_fresh_s": fresh,
        "optimizer_s": optimizer,
        "grad_accumulate_s": accumulate,
        "comm_s": reshard + in_ops + exposed + gathers + fresh,
        "step_time_s": total,
        "buckets": len(buckets),
    }
