"""The device mesh: an N-D grid of ranks, immutable and hashable.

Ranks are laid out row-major: the last axis varies fastest, so the last axis' groups are
neighbouring ranks (inside one node on a real cluster). An axis' process groups are the sets of
ranks that differ only in that axis' coordinate; a group over several axes at once differs only in
those axes' coordinates.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Sequence

from autopar.cluster import ClusterSpec, Link, resolve_cluster
from autopar.errors import MeshError

MAX_AXES = 4


@dataclasses.dataclass(frozen=True, init=False)
class Mesh:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster: ClusterSpec | None

    def __init__(self, shape: int | Sequence[int], axis_names: Sequence[str] | None = None, cluster=None):
        if isinstance(shape, int):
            shape = (shape,)
        try:
            shape = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            raise MeshError(f"mesh shape must be a sequence of positive ints, got {shape!r}") from None
        if not 1 <= len(shape) <= MAX_AXES:
            raise MeshError(f"a mesh has 1 to {MAX_AXES} axes, got {len(shape)} in shape {shape}")
        if any(s < 1 for s in shape):
            raise MeshError(f"every mesh axis needs size >= 1, got shape {shape}")
        if axis_names is None:
            axis_names = tuple(f"a{i}" for i in range(len(shape)))
        axis_names = tuple(str(n) for n in axis_names)
        if len(axis_names) != len(shape):
            raise MeshError(f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} axis names {axis_names}")
        if len(set(axis_names)) != len(axis_names):
            raise MeshError(f"mesh axis names must be distinct, got {axis_names}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "cluster", None if cluster is None else resolve_cluster(cluster))
        if self.cluster is not None:
            self.cluster.links_for(shape)  # validates explicit axis_links against the shape

    # ---- sizes and coordinates -------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.size

    def axis(self, name_or_index: str | int) -> int:
        """The index of an axis given by name or index."""
        if isinstance(name_or_index, int):
            if not 0 <= name_or_index < self.ndim:
                raise MeshError(f"mesh {self} has axes 0..{self.ndim - 1}, got axis {name_or_index}")
            return name_or_index
        if name_or_index not in self.axis_names:
            raise MeshError(f"mesh {self} has no axis named {name_or_index!r}; its axes are {self.axis_names}")
        return self.axis_names.index(name_or_index)

    def axes_size(self, axes: Iterable[int | str]) -> int:
        return math.prod(self.shape[self.axis(a)] for a in axes)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} is outside mesh {self} of {self.size} ranks")
        coord = []
        for s in reversed(self.shape):
            coord.append(rank % s)
            rank //= s
        return tuple(reversed(coord))

    def rank(self, coordinate: Sequence[int]) -> int:
        if len(coordinate) != self.ndim or any(not 0 <= c < s for c, s in zip(coordinate, self.shape)):
            raise MeshError(f"coordinate {tuple(coordinate)} is outside mesh shape {self.shape}")
        r = 0
        for c, s in zip(coordinate, self.shape):
            r = r * s + c
        return r

    def groups(self, axes: int | str | Sequence[int | str]) -> list[list[int]]:
        """The process groups over ``axes``: each a list of ranks, ordered with the first listed
        axis as the most significant (so a group's index order equals the shard order when a tensor
        dim is split over ``axes`` major-first)."""
        axes = (axes,) if isinstance(axes, (int, str)) else tuple(axes)
        axes = tuple(self.axis(a) for a in axes)  # validates; axis names become indices
        if len(set(axes)) != len(axes):
            raise MeshError(f"axes {axes} repeat an axis")
        rest = [a for a in range(self.ndim) if a not in axes]
        out = []
        for rest_coord in itertools.product(*(range(self.shape[a]) for a in rest)):
            group = []
            for in_coord in itertools.product(*(range(self.shape[a]) for a in axes)):
                coord = [0] * self.ndim
                for a, c in zip(rest, rest_coord):
                    coord[a] = c
                for a, c in zip(axes, in_coord):
                    coord[a] = c
                group.append(self.rank(coord))
            out.append(group)
        return out

    def group_of(self, rank: int, axes: int | Sequence[int]) -> list[int]:
        """The group over ``axes`` that contains ``rank``."""
        for g in self.groups(axes):
            if rank in g:
                return g
        raise AssertionError("unreachable: every rank is in one group per axis set")

    def index_in(self, rank: int, axes: Sequence[int]) -> int:
        """The rank's position inside its group over ``axes`` (first axis most significant)."""
        coord = self.coordinate(rank)
        i = 0
        for a in map(self.axis, axes):
            i = i * self.shape[a] + coord[a]
        return i

    # ---- topology ----------------------------------------------------------------------------
    def resolved_cluster(self) -> ClusterSpec:
        """The cluster used for pricing: the given one, or the cpu-gloo preset."""
        return self.cluster if self.cluster is not None else resolve_cluster(None)

    def links(self) -> tuple[Link, ...]:
        """alpha-beta link per mesh axis."""
        return self.resolved_cluster().links_for(self.shape)

    def with_cluster(self, cluster) -> "Mesh":
        return Mesh(self.shape, self.axis_names, cluster)

    # ---- torch -------------------------------------------------------------------------------
    def check_world_size(self, world_size: int) -> None:
        if world_size != self.size:
            raise MeshError(
                f"mesh {self} needs {self.size} ranks ({' x '.join(map(str, self.shape))}) but the world "
                f"has {world_size}; start {self.size} ranks or choose a mesh whose sizes multiply to {world_size}"
            )

    def to_device_mesh(self, device_type: str | None = None):
        """A torch DeviceMesh over the default process group (which must exist and match)."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_available() or not dist.is_initialized():
            raise MeshError("Mesh.to_device_mesh needs a default process group; call torch.distributed.init_process_group first")
        self.check_world_size(dist.get_world_size())
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        ranks = torch.arange(self.size).reshape(self.shape)
        return DeviceMesh(device_type, ranks, mesh_dim_names=self.axis_names)

    @staticmethod
    def from_torch(device_mesh, cluster=None) -> "Mesh":
        names = device_mesh.mesh_dim_names
        mesh = device_mesh.mesh
        if not (mesh.flatten() == __import__("torch").arange(mesh.numel())).all():
            raise MeshError("Mesh.from_torch needs a DeviceMesh over ranks 0..N-1 in row-major order")
        return Mesh(tuple(mesh.shape), names, cluster)

    def __str__(self) -> str:
        body = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"Mesh({body})"

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "cluster": None if self.cluster is None else self.cluster.to_dict(),
        }

    @staticmethod
    def from_dict(d: dict) -> "Mesh":
        return Mesh(tuple(d["shape"]), tuple(d["axis_names"]), d.get("cluster"))
