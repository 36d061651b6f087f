"""One training step of a chosen plan, priced the way the runtime runs it.

The runtime runs more than the ops' compute and their reshards: every op pays a framework overhead
(views included), parameters stored split (ZeRO-3) are gathered a layer at a time
(``param_gather_groups``), gradients are synchronised in buckets (``GradReducer``: flat buckets per
group of syncs alike, launched during backward, waited once at its end; priced by
``cost_model.grad_sync``), ZeRO-2 parameters are all-gathered in the same buckets before the next
forward, and the optimizer steps every local shard. ``step_time`` prices exactly these, per rank,
with the formulas the ILP's coefficients are made of (its objective is this price of the plan it
chooses):

    step = compute + op overheads + reshard collectives (forward and their backward duals)
         + collectives inside lowered ops (vocabulary-parallel loss) + gradient sums of
           identical-gradient axes (``autopar.cost_model.gradients``) + gradient accumulation
           (``accumulate_s``) + exposed gradient sync + ZeRO-2 parameter gathers + the pages of
           ZeRO-2 buffers its pool does not keep (``zero2_fresh_s``) + optimizer

    exposed sync = max(the last bucket, sync - comm_overlap * backward compute)

(the last bucket is ready only when backward ends, so it is never hidden; ``comm_overlap`` from
the cluster: 1 where a copy engine or a spare core runs collectives beside compute, 0 where ranks
share their cores with gloo's threads).
"""
from __future__ import annotations

import math

from autopar.cost_model.comm import layout_copy_time, mesh_collective_time, packed_gather_bytes
from autopar.cost_model.gradients import backward_reshard_s, backward_route_s, grad_sum_s
from autopar.record.gradients import whole_on
from autopar.cost_model.lowered import lowered_comm_parts
from autopar.cost_model.memory import run_again
from autopar.ir.graph import runs_backward
from autopar.ir.losses import counted_from_inputs
from autopar.cost_model.grad_sync import group_latencies, sync_price
from autopar.record.buckets import DEFAULT_BUCKET_BYTES, assign_buckets, first_reads, zero2_saved_bytes
from autopar.record.gathers import grouped_route, param_gather_groups
from autopar.record.recompute import Recompute, saved_by_selective
from autopar.sharding_spec.reshard import local_bytes
from autopar.sharding_spec.strategy import needs_lowering


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


def graph_overheads_s(graph, cluster) -> float:
    """Framework seconds of every op of ``graph`` run eagerly (``op_overheads_s``), forward and
    backward: the same whatever the plan, so the ILP adds them to its objective as a constant."""
    from autopar.ir.graph import needs_grad

    grad = needs_grad(graph)
    return sum(sum(op_overheads_s(n, grad, cluster)) for n in graph.nodes.values() if n.op == "call_function")


def in_op_comm_parts(node_plan, graph, mesh, identical=()) -> tuple[float, float]:
    """(forward, backward) seconds of the collectives a lowered family runs inside its op
    (``cost_model.lowered``), on a plan whose gradients are whole on the ``identical`` axes; 0 for
    the families run as the plain local op."""
    if not needs_lowering(node_plan.family):
        return 0.0, 0.0
    node = graph.nodes[node_plan.name]
    return lowered_comm_parts(node_plan.target, node_plan.family, node_plan.inputs, node_plan.output, mesh,
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
    """Seconds of ``edges``' reshards, forward and backward, as the runtime runs them
    (``reshard_parts_by_read``), summed."""
    return sum(f + b for f, b in reshard_parts_by_read(graph, edges, mesh, identical).values())


def local_steps_s(steps, costs, backward: bool, mesh, identical=()) -> float:
    """Seconds of reshard ``steps`` each priced ``costs`` forward, and where a gradient flows
    back their backward (``cost_model.gradients.backward_route_s``)."""
    return sum(costs) + (backward_route_s(steps, costs, mesh, identical) if backward else 0.0)


def reshard_parts_by_read(graph, edges, mesh, identical=()) -> dict[tuple[str, int], tuple[float, float]]:
    """(consumer, input position) -> (forward, backward) seconds of ``edges``' reshards there, as
    the runtime runs them: parameters gathered whole in groups (``param_gather_groups``: one
    all-gather per group of a layer, each parameter once, one reduce-scatter back, charged to the
    group's first read; a read's local steps on what its group gathers charged to it), every other
    edge its steps and their duals (``cost_model.gradients.backward_reshard_s``). The step model
    sums them; the stage tables attribute them to layers; a recomputed forward runs the first
    part again."""
    groups, grouped = param_gather_groups(graph, edges, least=1)
    out = {}
    for e in edges:
        if (e.dst, e.position) in grouped:  # the local steps run on what the group gathers
            steps = [e.steps[j] for j in grouped_route(e.steps)[1]]
            costs = [s.cost_s for s in steps]
            out[(e.dst, e.position)] = (sum(costs), backward_route_s(steps, costs, mesh, identical) if e.backward else 0.0)
        else:
            out[(e.dst, e.position)] = (e.forward_s, backward_reshard_s(e, mesh, identical))
    cluster = mesh.resolved_cluster()
    for (_, axes), members in groups.items():  # one gather per group, one reduce-scatter back
        nbytes = sum(e.steps[grouped_route(e.steps)[0]].nbytes for _, e in members)
        # the shards packed into the buffer sent, every full tensor cut out of the one received
        copies = layout_copy_time(packed_gather_bytes(nbytes, math.prod(mesh.shape[a] for a in axes)), cluster)
        forward = mesh_collective_time("all_gather", nbytes, mesh, axes) + copies
        backward = 0.0
        if any(e.backward for _, e in members) and not whole_on(axes, identical):
            backward = mesh_collective_time("reduce_scatter", nbytes, mesh, axes) + copies
        first = members[0][1]
        f, b = out.get((first.dst, first.position), (0.0, 0.0))
        out[(first.dst, first.position)] = (f + forward, b + backward)
    return out


def sync_prices(plan, graph, mesh, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, grad_total_bytes: float) -> list:
    """(parameter plan, its ``SyncPrice`` or None, its local elements the optimizer steps) per
    parameter of ``plan`` (buffers left out)."""
    out = []
    for p in plan.params.values():
        if p.buffer:
            continue
        meta = graph.nodes[p.node].meta
        local = local_bytes(p.storage, mesh.shape, meta.itemsize)  # (a gradient may be synced in a wider dtype)
        price = None
        if p.grad_sync is not None:
            price = sync_price(p.grad_sync, local, meta.dtype, mesh, total_bytes=grad_total_bytes, bucket_bytes=bucket_bytes)
            if p.grad_sync.split:
                local = local / math.prod(mesh.shape[a] for a in p.grad_sync.axes)
        out.append((p, price, local / meta.itemsize))
    return out


def synced_s(prices, cover_s: float) -> tuple[float, float, float, float]:
    """(all the sums, what of them backward does not hide, the gathers after the step, ZeRO-2's
    fresh pages) in seconds of the syncs ``prices`` (``SyncPrice`` s) beside ``cover_s`` seconds
    of backward compute (``comm_overlap`` applied): every group's first calls, once, then

        exposed = max(the last bucket, sync - cover)"""
    if not prices:
        return 0.0, 0.0, 0.0, 0.0
    latencies = group_latencies(prices).values()
    first = sum(s for s, _ in latencies)
    sync = first + sum(q.sum_s for q in prices)
    last = first + sum(q.floor_s for q in prices)  # never hidden: ready only when backward ends
    gathers = sum(a for _, a in latencies) + sum(q.gather_s for q in prices)
    return sync, max(last, sync - cover_s), gathers, sum(q.fresh_s for q in prices)


def step_time(plan, graph, mesh, *, runs: int = 1, overlapped: bool = True, recomputed: Recompute = Recompute.NONE,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, grad_total_bytes: float | None = None) -> dict:
    """Seconds of one training step per rank under ``plan`` (see the module docstring), by part.
    ``mesh``: the mesh the plan was priced on (its cluster gives links, overheads and overlap);
    ``grad_total_bytes``: the model's gradients as the reducer sums them
    (``cost_model.grad_sync.grad_bytes_total``; default: the graph's parameter bytes).

    A pipeline stage's step (its own plan, with the reshards of what it receives:
    ``StagePlan.received``) runs ``runs`` times (its microbatches: per-run work that many times,
    the syncs and the optimizer once), the syncs
    hidden behind the backward of the last run where ``overlapped`` (GPipe and 1F1B launch them
    there), else after every run (interleaved and zero-bubble schedules); ``recomputed``: its
    forward runs again in backward (its compute's third and the ops' forward overheads; under
    selective recomputation, those of the ops it does not save: ``record.recompute``; the
    forward of their collectives either way, reshards and those inside ops: no policy saves them;
    up to each layer's last op that saves a tensor: ``cost_model.memory.run_again``). The
    activations it receives are not in it (``stage_prices.variant_tables``)."""
    from autopar.ir.graph import needs_grad

    cluster = mesh.resolved_cluster()
    grad_total_bytes = graph.param_bytes() if grad_total_bytes is None else grad_total_bytes
    grad = needs_grad(graph)
    rerun = run_again(graph) if recomputed else frozenset()
    compute = overhead = 0.0
    backward_compute = 0.0
    for name, n in plan.nodes.items():
        node = graph.nodes.get(name)
        if node is None or node.op != "call_function":
            continue
        forward_s, backward_s = op_overheads_s(node, grad, cluster)
        again = name in rerun and (recomputed is Recompute.FULL or not saved_by_selective(node.target))
        compute += n.compute_s * (4 / 3 if again else 1)  # node compute is forward + 2x backward
        overhead += forward_s * (2 if again else 1) + backward_s
        if runs_backward(node, grad):
            backward_compute += n.compute_s * 2 / 3  # node compute is forward + backward (x2)
    identical = plan.identical_axes
    reshards = reshard_parts_by_read(graph, plan.edges, mesh, identical)
    in_op_parts = {name: in_op_comm_parts(n, graph, mesh, identical) for name, n in plan.nodes.items()}
    reshard = sum(f + b for f, b in reshards.values())
    in_ops = sum(f + b for f, b in in_op_parts.values()) + grad_sum_s(plan, graph, mesh, identical)
    # the collectives of what runs again, selective or not (no policy keeps a collective's output)
    reshard += sum(f for (dst, _), (f, _) in reshards.items() if dst in rerun)
    in_ops += sum(f for name, (f, _) in in_op_parts.items() if name in rerun)

    # gradient syncs priced per group of the reducer's buckets (``cost_model.grad_sync``)
    priced = sync_prices(plan, graph, mesh, bucket_bytes=bucket_bytes, grad_total_bytes=grad_total_bytes)
    prices = [q for _, q, _ in priced if q is not None]
    accumulate = sum(p.accumulate_s for p, _, _ in priced)
    cover = cluster.comm_overlap * backward_compute if overlapped else 0.0
    sync, exposed, gathers, fresh = synced_s(prices, cover)
    optimizer = optimizer_s(sum(e for _, _, e in priced), len(priced), cluster)
    per_run = compute + overhead + reshard + in_ops + accumulate
    total = runs * per_run + exposed + gathers + fresh + optimizer
    # as many buckets as the reducer makes (``assign_buckets``, in backward's order)
    first_use = first_reads(graph)
    synced = sorted(((first_use.get(p.node, 0), q.group, int(p.grad_sync.nbytes)) for p, q, _ in priced if q is not None),
                    key=lambda x: -x[0])
    return {
        "compute_s": runs * compute,
        "overhead_s": runs * overhead,
        "reshard_s": runs * reshard,
        "op_comm_s": runs * in_ops,
        "grad_sync_s": sync,
        "exposed_sync_s": exposed,
        "param_gather_s": gathers,
        "zero2_fresh_s": fresh,
        "optimizer_s": optimizer,
        "grad_accumulate_s": runs * accumulate,
        "comm_s": runs * (reshard + in_ops) + exposed + gathers + fresh,
        "step_time_s": total,
        "buckets": len(assign_buckets([(key, n) for _, key, n in synced], bucket_bytes)),
    }
