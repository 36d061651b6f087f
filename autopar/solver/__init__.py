"""Intra-op ILP, graph simplification, the Plan and `autopar.plan()`.

Imports lazily so that `import autopar` stays light and torch.distributed is never needed here.
"""
from autopar.solver.layout import Layout
from autopar.solver.pipeline import Pipeline
from autopar.solver.plan import Plan

__all__ = ["Layout", "Pipeline", "Plan", "plan"]


def plan(*args, **kwargs):
    from autopar.solver.api import plan as _plan

    return _plan(*args, **kwargs)


plan.__doc__ = "See autopar.solver.api.plan."
