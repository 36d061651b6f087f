"""The functions an emitted per-rank graph calls: one per resharding step kind, the input shard,
the backward seed, and the process groups they run on.

A lowered graph (``autopar.codegen.lower``) is the same Python on every rank: it names mesh axes,
never ranks. The process groups are bound when the graph runs (``bind(groups)``, which
``ParallelModule.forward`` does), so ``pmodel.code`` reads like

    linear = torch.ops.aten.linear.default(layer_norm, p_c_attn_weight, p_c_attn_bias)
    autopar_all_gather = autopar_all_gather(linear, axes=(0, 1), dim=2)

Each step is differentiable with the dual-layout convention of ``autopar.codegen.collectives``:
its backward is the dual step, so gradients come back in the dual layout of the forward specs.
Backward needs no binding: the autograd nodes keep the group they ran on.

The functions are registered as fx "custom builtins" so generated code prints their short names.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from autopar.codegen import collectives as C
from autopar.record.gradients import whole_on
from autopar.errors import AutoparError

_GROUPS: contextvars.ContextVar = contextvars.ContextVar("autopar_mesh_groups", default=None)


@contextlib.contextmanager
def bind(groups):
    """Run emitted graphs inside this block on ``groups`` (``autopar.codegen.groups.Groups``, which
    the runtime's ``MeshGroups`` implements)."""
    token = _GROUPS.set(groups)
    try:
        yield groups
    finally:
        _GROUPS.reset(token)


def current_groups():
    groups = _GROUPS.get()
    if groups is None:
        raise AutoparError(
            "an autopar graph ran outside autopar.codegen.ops.bind(groups); call the ParallelModule, "
            "not its graph_module, or wrap the call in `with bind(groups):`"
        )
    return groups


def handle(axes):
    return current_groups().handle(tuple(axes))


# ---- resharding steps (see autopar.sharding_spec.reshard for their meaning) ----------------------
# ``whole=True``: the step runs over identical-gradient axes (see collectives.py): gradients of
# replicated values are whole there, and the step's backward follows that convention.
def autopar_all_gather(x: torch.Tensor, axes, dim: int, whole: bool = False) -> torch.Tensor:
    g = handle(axes)
    return x if g.size == 1 else (C.AllGatherWhole if whole else C.AllGather).apply(x, dim, g)


def autopar_all_gather_group(*xs, axes, dims, whole: bool = False):
    """``autopar_all_gather(x, axes, dim)`` of several shards in one collective; a tuple."""
    g = handle(axes)
    return tuple(xs) if g.size == 1 else (C.AllGatherGroupWhole if whole else C.AllGatherGroup).apply(g, tuple(dims), *xs)


def autopar_reduce_scatter(x: torch.Tensor, axes, dim: int) -> torch.Tensor:
    g = handle(axes)
    return x if g.size == 1 else C.ReduceScatter.apply(x, dim, g)


def autopar_all_reduce(x: torch.Tensor, axes, whole: bool = False) -> torch.Tensor:
    g = handle(axes)
    return x if g.size == 1 else (C.AllReduceWhole if whole else C.AllReduce).apply(x, g)


def autopar_all_to_all(x: torch.Tensor, axes, src_dim: int, dst_dim: int) -> torch.Tensor:
    g = handle(axes)
    return x if g.size == 1 else C.AllToAll.apply(x, src_dim, dst_dim, g)


def autopar_slice(x: torch.Tensor, axes, dim: int, whole: bool = False) -> torch.Tensor:
    g = handle(axes)
    if g.size == 1:
        return x
    return C.SliceWhole.apply(x, dim, g) if whole else C.Slice.apply(x, dim, g.index, g.size)


def autopar_to_partial(x: torch.Tensor, axes, whole: bool = False) -> torch.Tensor:
    g = handle(axes)
    return x if g.size == 1 else (C.ToPartialWhole if whole else C.ToPartial).apply(x, g.index == 0)


def autopar_grad_share(x: torch.Tensor, axes) -> torch.Tensor:
    """Identity forward; backward turns a whole gradient into a pending share over ``axes`` (kept
    at index 0): for a parameter whose reducer sums over axes its program leaves it whole on."""
    g = handle(axes)
    if g.size == 1 or not (isinstance(x, torch.Tensor) and x.requires_grad):
        return x
    return C.GradShare.apply(x, g.index == 0)


def autopar_grad_sum(x: torch.Tensor, axes) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over ``axes`` (identical axes an op
    splits while reading ``x`` whole)."""
    g = handle(axes)
    if g.size == 1 or not (isinstance(x, torch.Tensor) and x.requires_grad):
        return x
    return C.GradSum.apply(x, g)


STEP_FUNCTIONS = {
    "all_gather": autopar_all_gather,
    "reduce_scatter": autopar_reduce_scatter,
    "all_reduce": autopar_all_reduce,
    "all_to_all": autopar_all_to_all,
    "slice": autopar_slice,
    "to_partial": autopar_to_partial,
}


# The kinds whose backward differs under whole gradients (reduce_scatter's and all_to_all's do not).
WHOLE_KINDS = ("all_gather", "all_reduce", "slice", "to_partial")


def step_kwargs(step, identical=()) -> dict:
    """The keyword arguments of a step's function, from a ``Step`` or a plan's ``StepPlan``, on a
    plan whose gradients are whole on the ``identical`` axes."""
    kw = {"axes": tuple(step.axes)}
    if step.kind in WHOLE_KINDS and whole_on(step.axes, identical):
        kw["whole"] = True
    if step.kind == "all_gather":
        kw["dim"] = step.src_dim
    elif step.kind in ("reduce_scatter", "slice"):
        kw["dim"] = step.dst_dim
    elif step.kind == "all_to_all":
        kw["src_dim"], kw["dst_dim"] = step.src_dim, step.dst_dim
    return kw


# ---- graph inputs and outputs ------------------------------------------------------------------
def autopar_shard_input(x, shape, dim_axes):
    """This rank's shard of a full user input: dim d split over ``dim_axes[d]`` (major first).
    ``shape`` is the traced global shape; an input of another shape is an error, not a guess."""
    if not isinstance(x, torch.Tensor):
        return x
    if tuple(x.shape) != tuple(shape):
        raise AutoparError(
            f"an input has shape {tuple(x.shape)} but the plan was made for {tuple(shape)}; autopar plans "
            "are for fixed shapes, so call the model with inputs shaped like example_inputs or parallelize again"
        )
    for d, axes in enumerate(dim_axes):
        for a in axes:
            x = autopar_slice(x, (a,), d)
    return x


def autopar_backward_seed(x, idle_axes=()):
    """A replicated graph output. Every rank calls ``backward`` on it with the same seed, but in
    the dual layout the gradient of a replicated value is a pending sum: only the rank at
    coordinate 0 on every mesh axis keeps its seed, the others start from zeros. On the plan's
    idle axes (every rank computes the same thing) and identical-gradient axes every rank keeps
    its seed: gradients are whole there (``idle_axes`` names both)."""
    if not isinstance(x, torch.Tensor) or not (x.requires_grad and x.is_floating_point()):
        return x
    keep = all(c == 0 for a, c in enumerate(current_groups().coordinate) if a not in idle_axes)
    return C.GradShare.apply(x, keep)


# ---- no-autograd helpers for the runtime (gradient sync, unsharding) -------------------------------
@torch.no_grad()
def gather_full(x: torch.Tensor, spec, groups) -> torch.Tensor:
    """The full tensor from this rank's shard under ``spec`` (pending sums summed), on every rank:
    the pending sums resolved, then every split gathered (``naive_plan``: a fixed route, since this
    is no planned edge; every route gives the same tensor, a pending sum up to the order of its terms)."""
    from autopar.sharding_spec.reshard import naive_plan
    from autopar.sharding_spec.spec import ShardingSpec

    target = ShardingSpec.replicate(spec.shape, spec.mesh_ndim)
    with bind(groups):
        for step in naive_plan(spec, target, groups.mesh, x.element_size()).steps:
            x = STEP_FUNCTIONS[step.kind](x, **step_kwargs(step))
    return x


def _register_builtins() -> None:
    try:
        from torch.fx.graph import _register_custom_builtin
    except ImportError:  # older/newer torch: generated code prints qualified names instead
        return
    for fn in (*STEP_FUNCTIONS.values(), autopar_all_gather_group, autopar_grad_share, autopar_grad_sum, autopar_shard_input,
               autopar_backward_seed):
        _register_custom_builtin(fn.__name__, f"from {__name__} import {fn.__name__}", fn)


_register_builtins()
