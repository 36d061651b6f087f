"""The alpha-beta communication model, compute and memory models: prices in seconds and bytes.

The hardware they price (``ClusterSpec``, ``Link``, the presets) is described in
``autopar.cluster``, below every layer; its names are re-exported here. Profiling lives in
``profile_ops`` (op timings -> OpTable) and ``profile_comm`` (live collectives -> fitted
ClusterSpec); import those modules directly.
"""
from autopar.cluster import PRESETS, ClusterSpec, Link, resolve_cluster
from autopar.cost_model.comm import collective_time, mesh_collective_time
from autopar.cost_model.compute import BACKWARD_FLOP_FACTOR, forward_time, node_time
from autopar.cost_model.memory import (
    activation_memory,
    node_activation_bytes,
    param_memory,
    saved_for_backward,
    total_param_memory,
)

__all__ = [
    "BACKWARD_FLOP_FACTOR",
    "PRESETS",
    "ClusterSpec",
    "Link",
    "activation_memory",
    "collective_time",
    "forward_time",
    "mesh_collective_time",
    "node_activation_bytes",
    "node_time",
    "param_memory",
    "resolve_cluster",
    "saved_for_backward",
    "total_param_memory",
]
