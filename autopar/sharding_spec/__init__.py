"""Meshes, placements, sharding specs, resharding steps and strategy rules (nothing priced: the
cheapest resharding route is ``autopar.solver.plan_reshard``)."""
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.reshard import ReshardPlan, Step, naive_plan
from autopar.sharding_spec.spec import Partial, Placement, Replicate, Shard, ShardingSpec

__all__ = ["Mesh", "Partial", "Placement", "Replicate", "ReshardPlan", "Shard", "ShardingSpec", "Step", "naive_plan"]
