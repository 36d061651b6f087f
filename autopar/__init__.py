"""autopar: a compiler-style auto-parallel planner for PyTorch."""
from autopar.errors import (
    AutoparError,
    ConfigError,
    MeshError,
    PlanError,
    RankError,
    ReshardError,
    ShardingError,
    TraceError,
)
from autopar.sharding_spec import Mesh, Partial, Replicate, Shard, ShardingSpec, plan_reshard
from autopar.solver import Plan, plan

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "ConfigError",
    "Mesh",
    "MeshError",
    "Partial",
    "Plan",
    "PlanError",
    "RankError",
    "ReshardError",
    "Replicate",
    "Shard",
    "ShardingError",
    "ShardingSpec",
    "TraceError",
    "plan",
    "plan_reshard",
]
