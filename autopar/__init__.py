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


def parallelize(*args, **kwargs):
    from autopar.runtime.parallelize import parallelize as _parallelize

    return _parallelize(*args, **kwargs)


parallelize.__doc__ = "See autopar.runtime.parallelize.parallelize."

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
    "parallelize",
    "plan",
    "plan_reshard",
]
