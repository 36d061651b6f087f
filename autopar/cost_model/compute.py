"""Compute time of one op under one sharding strategy, in seconds.

Roofline: an op takes as long as the slower of its arithmetic and its memory traffic,

    forward_time = max(flops / sustained_flops(dtype), bytes_moved / sustained_memory_bandwidth)

with ``flops`` the node's forward FLOPs times the strategy's ``compute_fraction`` (the share one
device does) and ``bytes_moved`` the local (per-device) bytes of every tensor input read plus every
output written, from the strategy's input and output specs. Views move nothing and cost 0.

Backward is ``BACKWARD_FLOP_FACTOR`` times forward for an op with a tensor input that needs a
gradient (see ``ops.needs_grad``), and 0 for an op that reads only constants, inputs and buffers.

A profiled ``OpTable`` (``profile_ops``) replaces the roofline for an op when it holds an entry
for exactly the same key: ATen target, the local shapes of the tensor inputs in argument order,
and the compute dtype. Nothing is interpolated: a key that differs in any dim falls back to the
roofline. The table's backward time is used when it was measured with the same set of inputs
needing gradients; otherwise backward is ``BACKWARD_FLOP_FACTOR`` times the profiled forward.
"""
from __future__ import annotations

import math

from autopar.cluster import resolve_cluster
from autopar.cost_model.ops import is_floating, is_view, itemsize, local_nbytes, tensor_inputs
from autopar.ir.graph import needs_grad
from autopar.sharding_spec.rules.attention import ring_blocks

# A matmul's backward computes two products of the forward's size (dL/dX = dL/dY W^T and
# dL/dW = X^T dL/dY), so it costs twice the forward; elementwise ops read about twice the bytes
# (the saved tensor and the incoming gradient). The same factor is used for every op.
BACKWARD_FLOP_FACTOR = 2.0


def forward_time(flops: float, bytes_moved: float, dtype: str, cluster) -> float:
    """Roofline seconds of one op on one device: ``max(flops / sustained FLOP/s, bytes / sustained
    bytes/s)`` (``ClusterSpec.flops`` and ``sustained_memory_bandwidth``).
    ``cluster``: a ClusterSpec or anything ``resolve_cluster`` accepts."""
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes must be >= 0, got flops={flops}, bytes={bytes_moved}")
    cluster = resolve_cluster(cluster)
    return max(flops / cluster.flops(dtype), bytes_moved / cluster.sustained_memory_bandwidth)


def compute_dtype(node, graph) -> str:
    """The dtype an op computes in: its first floating-point tensor input's, else its output's."""
    for _, name in tensor_inputs(node, graph):
        dtype = graph.nodes[name].tensor_meta.dtype
        if is_floating(dtype):
            return dtype
    meta = node.tensor_meta
    if meta is None and isinstance(node.meta, tuple):
        meta = next((m for m in node.meta if m is not None), None)
    return meta.dtype if meta is not None else "float32"


def input_specs(node, strategy) -> list:
    """The strategy's spec for each entry of ``node.inputs`` (None: replicated or not a tensor)."""
    specs = list(strategy.inputs) if strategy is not None else []
    return specs + [None] * (len(node.inputs) - len(specs))


def local_input_shapes(node, strategy, graph, mesh) -> tuple[tuple[int, ...], ...]:
    """Local shapes of the node's single-tensor inputs, in argument order (the op-table key)."""
    specs = input_specs(node, strategy)
    out = []
    for i, name in tensor_inputs(node, graph):
        meta, spec = graph.nodes[name].tensor_meta, specs[i]
        out.append(tuple(meta.shape) if spec is None else tuple(spec.local_shape(mesh)))
    return tuple(out)


def grad_mask(node, graph) -> tuple[bool, ...]:
    """Per single-tensor input (argument order): whether it needs a gradient."""
    ng = needs_grad(graph)
    return tuple(name in ng for _, name in tensor_inputs(node, graph))


def local_bytes_moved(node, strategy, graph, mesh) -> int:
    """Local bytes the op reads (tensor inputs) plus writes (outputs) on one device."""
    shapes = local_input_shapes(node, strategy, graph, mesh)
    read = sum(
        math.prod(shape) * itemsize(graph.nodes[name].tensor_meta.dtype)
        for shape, (_, name) in zip(shapes, tensor_inputs(node, graph))
    )
    written = local_nbytes(node.meta, None if strategy is None else strategy.output, mesh)
    return read + written


def node_time(node, strategy, graph, mesh, op_table=None) -> tuple[float, float]:
    """(forward s, backward s) of ``node`` run with ``strategy`` on one device of ``mesh``.
    ``strategy`` None means replicated. Placeholders, outputs and views cost (0, 0)."""
    if node.op != "call_function" or is_view(node.target):
        return 0.0, 0.0
    mask = grad_mask(node, graph)
    dtype = compute_dtype(node, graph)
    fwd = bwd = None
    if op_table is not None:
        hit = op_table.lookup(node.target, local_input_shapes(node, strategy, graph, mesh), dtype, mask)
        if hit is not None:
            # ring attention runs the local op's shapes once per block of the ring (n blocks)
            k = mesh.resolved_cluster().in_situ_factor * ring_blocks(strategy, mesh)
            fwd, bwd = hit[0] * k, (None if hit[1] is None else hit[1] * k)
    if fwd is None:
        fraction = 1.0 if strategy is None else strategy.compute_fraction
        flops = node.flops * fraction
        fwd = forward_time(flops, local_bytes_moved(node, strategy, graph, mesh), dtype, mesh.resolved_cluster())
    if not any(mask):
        return fwd, 0.0
    return fwd, (BACKWARD_FLOP_FACTOR * fwd if bwd is None else bwd)
