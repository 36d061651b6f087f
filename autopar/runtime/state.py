"""A ParallelModule's state in torch's conventions: DTensor values, original keys.

``pmodel.state_dict()`` returns, under every key of the original model's ``state_dict()`` (tied
aliases included), a ``torch.distributed.tensor.DTensor`` over a DeviceMesh built on the plan's own
process groups: its local tensor is this rank's storage shard, its placements say how the full
tensor is split (``Shard(d)`` on every mesh axis that splits dim d, ``Replicate()`` elsewhere), so
``full_tensor()``, ``torch.distributed.checkpoint`` and FSDP2-style tools see the global value.
This is FSDP2's convention, so nothing can mistake a shard for the full tensor.

``load_state_dict`` takes the same form (DTensors of this plan: each rank copies its local part),
DTensors of another plan or mesh (gathered to full, then sliced: a collective), or plain full
tensors (each rank keeps its slice). Shapes and keys are checked like torch's.

A dim split over several mesh axes in the order of increasing axis index is a DTensor with
``Shard(d)`` on each (mesh dim 0 splits first, as autopar's major-first order); the reverse order
has no DTensor placement and such a state raises a ConfigError that points at ``full_state_dict``.
"""
from __future__ import annotations

import math

import torch

from autopar.errors import ConfigError
from autopar.runtime.materialize import shard_of


def device_mesh(groups, device: torch.device | None):
    """A torch DeviceMesh over the mesh's ranks whose dimension groups are ``groups``' own process
    groups (no new groups are created). Cached on ``groups``."""
    cached = getattr(groups, "_device_mesh", None)
    if cached is not None:
        return cached
    from torch.distributed.device_mesh import DeviceMesh

    mesh = groups.mesh
    device_type = device.type if device is not None else "cpu"
    ranks = torch.tensor(groups.global_ranks).reshape(mesh.shape)
    pgs = [groups.handle(a).pg for a in range(mesh.ndim)]
    dm = DeviceMesh.from_group(pgs[0] if mesh.ndim == 1 else pgs, device_type, mesh=ranks,
                               mesh_dim_names=tuple(mesh.axis_names))
    groups._device_mesh = dm
    return dm


def placements(spec, key: str = ""):
    """DTensor placements of a storage spec (one per mesh axis)."""
    from torch.distributed.tensor import Replicate, Shard

    out = [Replicate()] * spec.mesh_ndim
    for d, axes in enumerate(spec.dim_axes):
        if list(axes) != sorted(axes):
            raise ConfigError(
                f"{key or 'a tensor'} is stored as {spec}: dim {d} is split over mesh axes {axes} minor-first, which "
                "no DTensor placement expresses; use pmodel.full_state_dict() / load_state_dict of full tensors"
            )
        for a in axes:
            out[a] = Shard(d)
    return out


def to_dtensor(local: torch.Tensor, spec, dm, key: str = ""):
    """The DTensor whose local part on this rank is ``local`` (the storage shard under ``spec``)."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size(spec.shape)
    stride = tuple(math.prod(spec.shape[d + 1:]) for d in range(len(spec.shape)))
    return DTensor.from_local(local, dm, placements(spec, key), run_check=False, shape=shape, stride=stride)


def local_part(value, spec, dm, mesh, rank: int, key: str) -> torch.Tensor:
    """This rank's storage shard of ``value`` (a DTensor or a full tensor) under ``spec``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
    if tuple(value.shape) != tuple(spec.shape):
        raise ConfigError(
            f"size mismatch for {key}: the checkpoint's has shape {tuple(value.shape)}, the model's is {tuple(spec.shape)}"
        )
    if isinstance(value, DTensor):
        if value.device_mesh == dm and list(value.placements) == placements(spec, key):
            return value.to_local()
        value = value.full_tensor()  # another plan or mesh: every rank loads together
    return shard_of(value, spec, mesh, rank)


class ParamLayout:
    """How one parameter as the optimizer sees it sits in the whole tensor: its storage shard
    (``spec``), or for a ZeRO-2 parameter the dim-0 chunk of that shard over ``zero_axes`` (ceil-
    sized, as DTensor's ``Shard(0)`` chunks). ``wrap(local)`` makes a DTensor of a tensor laid out
    like the parameter (its optimizer states)."""

    def __init__(self, spec, dm, key: str, zero_axes: tuple[int, ...] = ()):
        from torch.distributed.tensor import Shard

        self.spec, self.dm, self.key = spec, dm, key
        self.global_shape = tuple(spec.shape)
        self.placements = list(placements(spec, key))
        # DTensor splits a dim by mesh axes in mesh order; the chunk splits the shard's dim 0 after
        # the storage split of it: both orders must agree.
        order = list(spec.dim_axes[0] if spec.dim_axes else ()) + list(zero_axes)
        if order != sorted(order):
            raise ConfigError(f"{key}: its ZeRO-2 chunk over mesh axes {zero_axes} does not follow its storage split "
                              f"{spec} in mesh order, which no DTensor placement expresses")
        for a in zero_axes:
            self.placements[a] = Shard(0)

    def wrap(self, local: torch.Tensor):
        from torch.distributed.tensor import DTensor

        stride = tuple(math.prod(self.global_shape[d + 1:]) for d in range(len(self.global_shape)))
        return DTensor.from_local(local, self.dm, self.placements, run_check=False, shape=torch.Size(self.global_shape),
                                  stride=stride)
