"""autopar: a compiler-style auto-parallel planner for PyTorch.

The subpackages are attributes of the package after a plain ``import autopar`` (``autopar.models
.build("gpt")``); each is imported on first access (PEP 562), so ``import autopar`` stays light and
never loads the runtime (torch.distributed process groups, pipelining) or codegen until asked.
"""
import importlib as _importlib

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
from autopar.solver import Layout, Pipeline, Plan, plan


def parallelize(*args, **kwargs):
    from autopar.compose.parallelize import parallelize as _parallelize

    return _parallelize(*args, **kwargs)


parallelize.__doc__ = "See autopar.compose.parallelize.parallelize."

# Imported on first access as ``autopar.<name>``.
_SUBPACKAGES = ("cli", "codegen", "compose", "cost_model", "ir", "models", "runtime", "sharding_spec", "solver")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        module = _importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r}; its public names are {sorted(__all__)} "
        f"and its subpackages {list(_SUBPACKAGES)}"
    )


def __dir__():
    return sorted(set(globals()) | set(_SUBPACKAGES))

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "ConfigError",
    "Layout",
    "Mesh",
    "MeshError",
    "Partial",
    "Pipeline",
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
