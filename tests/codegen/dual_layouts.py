"""Global tensor <-> per-rank locals, for a spec's value layout or its dual (gradient) layout.

``kind="value"``: the forward layout. Shard axes split, Partial axes hold a pending sum, the other
(free) axes replicate. ``kind="grad"``: the dual layout of a gradient (see
``autopar.codegen.collectives``): Shard axes split, the spec's free axes hold a pending sum, its
Partial axes replicate. ``to_locals`` lays a global tensor out; ``from_locals`` puts it back together
and checks that replicas agree.
"""
from __future__ import annotations

import torch

from autopar.sharding_spec.spec import ShardingSpec


def _sum_and_replica_axes(spec: ShardingSpec, mesh, kind: str):
    free = tuple(a for a in range(mesh.ndim) if a not in spec.used_axes)
    if kind == "value":
        return spec.partial, free
    if kind == "grad":
        return free, spec.partial
    raise ValueError(f"kind must be 'value' or 'grad', got {kind!r}")


def to_locals(t: torch.Tensor, spec: ShardingSpec, mesh, kind: str = "value", *, split: str = "first",
              seed: int = 0) -> dict[int, torch.Tensor]:
    """Every rank's local tensor. A pending sum is split with ``split``: "first" puts the whole value
    on group index 0 and zeros elsewhere; "random" splits it into small random integer parts."""
    assert tuple(t.shape) == spec.shape, (tuple(t.shape), spec.shape)
    sum_axes, _ = _sum_and_replica_axes(spec, mesh, kind)
    n = mesh.axes_size(sum_axes)
    if split == "random" and n > 1:
        gen = torch.Generator().manual_seed(seed)
        noise = [torch.randint(-3, 4, t.shape, generator=gen).to(t.dtype) for _ in range(n - 1)]
        parts = noise + [t - sum(noise)]
    else:
        parts = [t] + [torch.zeros_like(t)] * (n - 1)
    return {r: parts[mesh.index_in(r, sum_axes)][spec.local_slices(mesh, r)].clone() for r in range(mesh.size)}


def from_locals(locals_: dict[int, torch.Tensor], spec: ShardingSpec, mesh, kind: str = "value") -> torch.Tensor:
    """The global tensor that ``locals_`` stand for; AssertionError if two replicas differ."""
    sum_axes, replica_axes = _sum_and_replica_axes(spec, mesh, kind)
    full = torch.zeros(spec.shape, dtype=locals_[0].dtype)
    want = spec.local_shape(mesh)
    for r in range(mesh.size):
        local = locals_[r]
        assert tuple(local.shape) == want, f"rank {r} holds shape {tuple(local.shape)}, {kind} layout of {spec} needs {want}"
        coord = list(mesh.coordinate(r))
        if any(coord[a] for a in replica_axes):
            for a in replica_axes:
                coord[a] = 0
            ref = mesh.rank(coord)
            assert torch.equal(local, locals_[ref]), f"replicas differ in the {kind} layout of {spec}: rank {r} vs rank {ref}"
            continue
        full[spec.local_slices(mesh, r)] += local
    return full
