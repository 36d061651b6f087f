"""Global-norm gradient clipping over every shard of a ParallelModule.

Each rank's ``.grad`` is its part of the true gradient: the storage shard's gradient (identical on
the mesh axes the storage does not split, once the reducer has synchronised it) or, for ZeRO-2,
its chunk of it. torch's ``clip_grad_norm_`` over those would take a different norm on each rank.
Here the norm is taken over the whole model: every distinct part is counted once (by the rank at
coordinate 0 on the axes where it is replicated), the per-rank sums of ``|norm|^p`` are summed
over the mesh (max / min for the infinity norms), and torch's own ``clip_grads_with_norm_`` scales
each part by the global factor, so every rank clips alike.

``torch.nn.utils.clip_grad_norm_`` is routed here for parameters of a ParallelModule (FSDP2 gets
the same from DTensor gradients): building one wraps torch's function so that a call whose
parameters all belong to one ParallelModule computes the global norm, any other call runs
torch's code unchanged, and a call mixing them raises a ConfigError. A reference bound before
autopar was imported (``from torch.nn.utils import clip_grad_norm_`` in user code that runs first)
keeps torch's function: call ``pmodel.clip_grad_norm_`` to be sure.
"""
from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.distributed as dist

from autopar.errors import ConfigError

_OWNER = "_autopar_owner"  # attribute on each parameter: weakref to its module's clip info
_TORCH_CLIP = None


class ClipInfo:
    """Per ParallelModule: which parameters' gradients this rank counts in the norm, and the group
    of every rank."""

    def __init__(self, counted: set[int], world_pg, synchronize, device):
        self.counted, self.world_pg, self.synchronize, self.device = counted, world_pg, synchronize, device
        # Pipeline stages hold different parameters: a numbering of every stage's parameters
        # (id -> index, and how many) lines up their per-parameter counts in one all-reduce.
        self.index: dict[int, int] | None = None
        self.n_index = 0


def counts_in_norm(split_axes, coordinate, mesh_shape) -> bool:
    """Whether this rank counts a gradient split over ``split_axes``: it is at coordinate 0 on every
    other (replicated) axis of size > 1."""
    return all(c == 0 for a, (c, s) in enumerate(zip(coordinate, mesh_shape)) if s > 1 and a not in split_axes)


def attach(params, info: ClipInfo) -> None:
    ref = weakref.ref(info)
    for p in params:
        setattr(p, _OWNER, ref)
    install()


@torch.no_grad()
def clip_grad_norm_(info: ClipInfo, parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (all of one ParallelModule) by their global norm and
    return it, the same on every rank. A collective: every rank calls it alike."""
    info.synchronize()
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    dtype = grads[0].dtype if grads else torch.get_default_dtype()
    device = grads[0].device if grads else (info.device or torch.device("cpu"))
    f64 = dict(dtype=torch.float64, device=device)
    # the gradients this rank counts (None where another rank counts that part), in the same order
    # on every rank
    mine = [p.grad if (p.grad is not None and id(p) in info.counted) else None for p in params]
    # one SUM all-reduce carries: [sum of |norm|^p (p-norms), NaN seen, gradients, per-parameter nonzero counts]
    if info.index is None:
        slot, n_slots = list(range(len(params))), len(params)
    else:
        slot, n_slots = [info.index[id(p)] for p in params], info.n_index
    counts = torch.zeros(3 + n_slots, **f64)
    counts[2] = sum(g is not None for g in mine)
    present = [g for g in mine if g is not None and g.numel()]
    if present and math.isinf(norm_type):  # a max or min all-reduce may drop a NaN (a p-norm's sum keeps it)
        counts[1] = torch.stack([torch.isnan(g).any() for g in present]).any().double()
    if norm_type == 0:  # torch: how many gradients have a nonzero element
        for i, g in enumerate(mine):
            if g is not None:
                counts[3 + slot[i]] = torch.count_nonzero(g).double()
    elif not math.isinf(norm_type) and present:
        norms = torch._foreach_norm(present, norm_type)
        counts[0] = torch.stack([n.double() for n in norms]).pow(norm_type).sum()
    dist.all_reduce(counts, group=info.world_pg)
    if math.isinf(norm_type):
        if norm_type > 0:
            local = torch.stack([g.abs().amax().double() for g in present]).amax() if present else torch.zeros((), **f64)
            op = dist.ReduceOp.MAX
        else:
            local = torch.stack([g.abs().amin().double() for g in present]).amin() if present else torch.full((), math.inf, **f64)
            op = dist.ReduceOp.MIN
        total = local.clone().reshape(())
        dist.all_reduce(total, op=op, group=info.world_pg)
        if counts[2] == 0:  # no gradient anywhere: torch's norm of nothing
            total = torch.zeros((), **f64)
    elif norm_type == 0:
        total = (counts[3:] > 0).sum().double()
    else:
        total = counts[0] ** (1.0 / norm_type)
    if counts[1] > 0:
        total = torch.full((), math.nan, **f64)
    total = total.to(dtype)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _routed(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {getattr(p, _OWNER, None) for p in params}
    if owners <= {None}:
        return _TORCH_CLIP(params if not isinstance(parameters, torch.Tensor) else parameters,
                           max_norm, norm_type, error_if_nonfinite, foreach)
    infos = {o() for o in owners if o is not None}
    if None in owners or len(infos) != 1 or None in infos:
        raise ConfigError(
            "clip_grad_norm_ got parameters of a ParallelModule mixed with others (or of two ParallelModules); "
            "the global norm of such a set is undefined here: clip each ParallelModule's parameters in their own call"
        )
    return clip_grad_norm_(infos.pop(), params, max_norm, norm_type, error_if_nonfinite, foreach)


def install() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` through ``_routed`` (once)."""
    global _TORCH_CLIP
    if _TORCH_CLIP is not None:
        return
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad

    _TORCH_CLIP = clip_grad.clip_grad_norm_
    routed = functools.wraps(_TORCH_CLIP)(_routed)
    nn_utils.clip_grad_norm_ = routed
    clip_grad.clip_grad_norm_ = routed
