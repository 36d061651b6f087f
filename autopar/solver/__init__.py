"""The resharding search, intra-op ILP, graph simplification, the pipeline search, the Plan and ``autopar.plan()``.

torch.distributed is never needed here: plans are made without processes.
"""
from autopar.solver.api import plan
from autopar.solver.layout import Layout
from autopar.solver.config import Pipeline, PlanConfig
from autopar.solver.plan import Plan
from autopar.solver.reshard_search import plan_reshard

__all__ = ["Layout", "Pipeline", "Plan", "PlanConfig", "plan", "plan_reshard"]
