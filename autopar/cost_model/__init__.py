"""Device and cluster specs, the alpha-beta communication model, compute and memory models."""
from autopar.cost_model.cluster import PRESETS, ClusterSpec, Link, resolve_cluster
from autopar.cost_model.comm import collective_time, mesh_collective_time

__all__ = ["PRESETS", "ClusterSpec", "Link", "collective_time", "mesh_collective_time", "resolve_cluster"]
