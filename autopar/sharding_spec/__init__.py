"""Meshes, placements, sharding specs, the resharding planner and strategy rules."""
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.reshard import ReshardPlan, Step, naive_plan, plan_reshard
from autopar.sharding_spec.spec import Partial, Placement, Replicate, Shard, ShardingSpec

__all__ = ["Mesh", "Partial", "Placement", "Replicate", "ReshardPlan", "Shard", "ShardingSpec", "Step", "naive_plan", "plan_reshard"]
