"""A single-process mesh: one local shard per rank, and each resharding step applied exactly as
the collective would apply it, so plans can be checked without processes."""
from __future__ import annotations

import torch

from autopar.errors import ShardingError
from autopar.sharding_spec.reshard import ReshardPlan, Step
from autopar.sharding_spec.spec import ShardingSpec


def shard(tensor: torch.Tensor, spec: ShardingSpec, mesh, *, partial_split: str = "first") -> dict[int, torch.Tensor]:
    """Every rank's local shard of ``tensor`` under ``spec``. A pending sum over axes P is laid out
    with ``partial_split``: "first" puts the whole value on the first rank of each P-group and zeros
    elsewhere; "random" splits it into random integer parts that sum to it (for exact tests use
    integer-valued tensors)."""
    spec.check_even(mesh)
    if tuple(tensor.shape) != spec.shape:
        raise ShardingError(f"tensor of shape {tuple(tensor.shape)} does not match spec shape {spec.shape}")
    out = {}
    gen = torch.Generator().manual_seed(0)
    parts = None
    if spec.partial and partial_split == "random":
        n = mesh.axes_size(spec.partial)
        noise = [torch.randint(-3, 4, tensor.shape, generator=gen).to(tensor.dtype) for _ in range(n - 1)]
        parts = noise + [tensor - sum(noise)]
    for rank in range(mesh.size):
        local = tensor[spec.local_slices(mesh, rank)].clone()
        if spec.partial:
            i = mesh.index_in(rank, spec.partial)
            if parts is not None:
                local = parts[i][spec.local_slices(mesh, rank)].clone()
            elif i != 0:
                local = torch.zeros_like(local)
        out[rank] = local
    return out


def unshard(locals_: dict[int, torch.Tensor], spec: ShardingSpec, mesh) -> torch.Tensor:
    """The global tensor the shards stand for: pending sums added, splits put back in place."""
    spec.check_even(mesh)
    first = locals_[0]
    full = torch.zeros(spec.shape, dtype=first.dtype)
    # Each distinct shard position appears once per non-splitting rank; sum over partial axes only.
    replica_axes = [a for a in range(mesh.ndim) if a not in spec.used_axes]
    for rank in range(mesh.size):
        coord = mesh.coordinate(rank)
        if any(coord[a] != 0 for a in replica_axes):
            continue
        full[spec.local_slices(mesh, rank)] += locals_[rank]
    return full


def apply_step(locals_: dict[int, torch.Tensor], step: Step, mesh) -> dict[int, torch.Tensor]:
    """The shards after ``step``, computed group by group like the collective."""
    out = dict(locals_)
    for group in mesh.groups(step.axes):
        xs = [locals_[r] for r in group]
        n = len(group)
        if step.kind == "all_gather":
            full = torch.cat(xs, dim=step.src_dim)
            news = [full.clone() for _ in group]
        elif step.kind == "all_reduce":
            total = _sum(xs)
            news = [total.clone() for _ in group]
        elif step.kind == "reduce_scatter":
            news = [c.clone() for c in torch.chunk(_sum(xs), n, dim=step.dst_dim)]
        elif step.kind == "all_to_all":
            pieces = [torch.chunk(x, n, dim=step.dst_dim) for x in xs]  # pieces[i][j]: i sends to j
            news = [torch.cat([pieces[i][j] for i in range(n)], dim=step.src_dim) for j in range(n)]
        elif step.kind == "slice":
            news = [torch.chunk(x, n, dim=step.dst_dim)[i].clone() for i, x in enumerate(xs)]
        elif step.kind == "to_partial":
            news = [x.clone() if i == 0 else torch.zeros_like(x) for i, x in enumerate(xs)]
        else:
            raise ValueError(f"unknown step kind {step.kind!r}")
        for r, x in zip(group, news):
            out[r] = x
    return out


def _sum(xs):
    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    return total


def apply_plan(locals_: dict[int, torch.Tensor], plan: ReshardPlan, mesh) -> dict[int, torch.Tensor]:
    for step in plan.steps:
        locals_ = apply_step(locals_, step, mesh)
    return locals_
