"""autopar: a compiler-style auto-parallel planner for PyTorch.

``autopar.plan`` and ``autopar.parallelize`` are the functions themselves; both take the planning
options of ``autopar.PlanConfig`` (``help(autopar.PlanConfig)`` lists them). The subpackages are attributes of the package after a plain ``import autopar``
(``autopar.models.build("gpt")``); each is imported on first access (PEP 562), so ``import
autopar`` stays light and never loads the runtime (process groups, pipelining) or codegen until a
model is parallelized.
"""
import importlib as _importlib

from autopar.cluster import ClusterSpec, Link
from autopar.errors import (
    AutoparError,
    CheckpointError,
    ConfigError,
    MeshError,
    PlanError,
    RankError,
    ReshardError,
    ShardingError,
    TraceError,
)
from autopar.compose.parallelize import parallelize
from autopar.ir.precision import MixedPrecision
from autopar.sharding_spec import Mesh, Partial, Replicate, Shard, ShardingSpec
from autopar.solver import Layout, Pipeline, Plan, PlanConfig, plan, plan_reshard
from autopar.solver.compare import compare_plan as compare


def init(backend=None, device=None, timeout=None):
    """Start the process group from the launcher's variables (torchrun, SLURM's srun, OpenMPI's
    mpirun; one process without them) and say where this process stands: rank, world size, local
    rank and the device to build on (``cuda:LOCAL_RANK`` on GPU nodes). See ``autopar.runtime.world``."""
    from autopar.runtime.world import init as _init

    return _init(backend, device, timeout)


def save(path, pmodel, optimizer=None, extra=None, **kwargs):
    """Checkpoint ``pmodel`` (and ``optimizer``, ``extra``) under ``path``, each rank writing its
    shards; see ``autopar.runtime.checkpoint``."""
    from autopar.runtime.checkpoint import save as _save

    return _save(path, pmodel, optimizer, extra, **kwargs)


def load(path, module, optimizer=None):
    """Load the checkpoint under ``path`` into ``module`` (any plan or mesh, or a plain module in
    one process) and ``optimizer``; returns the saved ``extra``. See ``autopar.runtime.checkpoint``."""
    from autopar.runtime.checkpoint import load as _load

    return _load(path, module, optimizer)


def load_full(path):
    """The checkpoint's full model state dict (original keys), in this process."""
    from autopar.runtime.checkpoint import load_full as _load_full

    return _load_full(path)


def export(path, pmodel, dtype=None):
    """One safetensors file of ``pmodel``'s full state under the original keys (rank 0 writes), in
    ``dtype`` (default: the dtype it computes in)."""
    from autopar.runtime.checkpoint import export as _export

    return _export(path, pmodel, dtype)


def dry_run(plan, model, example_inputs=(), **kwargs):
    """Build and run ``plan``'s programs for sampled ranks in this process, on meta tensors over a
    fake process group: every collective checked against its peers, each rank's peak memory
    against the plan's (``ranks=None|"all"|[...]``, ``example_kwargs``, ``optimizer``). Returns a
    ``DryRun`` (``.ok``, ``.report()``, ``.mismatches``, ``.runs``); see ``autopar.compose.dry_run``."""
    from autopar.compose.dry_run import dry_run as _dry_run

    return _dry_run(plan, model, example_inputs, **kwargs)


# Imported on first access as ``autopar.<name>``.
_SUBPACKAGES = ("cli", "codegen", "compose", "cost_model", "ir", "models", "runtime", "sharding_spec", "solver")


def __getattr__(name: str):
    if name == "GradScaler":  # (in the runtime, which ``import autopar`` does not load)
        from autopar.runtime.grad_scaler import GradScaler

        globals()[name] = GradScaler
        return GradScaler
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
    "CheckpointError",
    "ClusterSpec",
    "GradScaler",
    "ConfigError",
    "Layout",
    "Link",
    "Mesh",
    "MeshError",
    "MixedPrecision",
    "Partial",
    "Pipeline",
    "Plan",
    "PlanConfig",
    "PlanError",
    "RankError",
    "ReshardError",
    "Replicate",
    "Shard",
    "ShardingError",
    "ShardingSpec",
    "TraceError",
    "compare",
    "dry_run",
    "export",
    "load",
    "load_full",
    "parallelize",
    "plan",
    "plan_reshard",
    "save",
]
