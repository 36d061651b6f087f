"""Process groups for every set of mesh axes, built once per rank.

A resharding step talks over the group of ranks that differ only in a few mesh axes' coordinates.
``MeshGroups(mesh)`` creates, inside each rank after ``init_process_group``, one torch process group
per such set of ranks, so that for any non-empty set of mesh axes this rank can look up:

    groups.group(axes)    the ProcessGroup over ``axes`` that contains this rank
    groups.ranks(axes)    its global ranks in *shard order*: the first listed axis most significant
    groups.index(axes)    this rank's position in that order

Shard order depends on the order of ``axes`` ((0, 1) and (1, 0) list the same ranks in different
orders); the torch group does not. Torch numbers a group's members by its own "group rank" (sorted
global ranks), so code that gathers or scatters must map between the two orders explicitly:
``groups.handle(axes)`` carries both (``ranks`` in shard order, ``pg_ranks`` in group-rank order).
``MeshGroups`` implements ``autopar.codegen.groups.Groups``, what emitted programs run on.

Groups are made eagerly, because ``dist.new_group`` is collective over the whole world: every rank
calls it for every group, in the same order. A size-1 mesh axis changes no group's members, so it
is dropped before caching: one torch group per distinct set of ranks (a frozenset of the axes of
size > 1). The set of all such axes is the whole world and reuses the default group; when the mesh
has size-1 axes, singleton groups are made too so that ``group(axes)`` always answers.

A pipeline stage runs on a sub-mesh: ``MeshGroups(mesh, ranks=[...])`` lays the mesh over those
global ranks (row-major) instead of 0..N-1. ``rank`` and ``coordinate`` are then the position in
the sub-mesh; group handles list global ranks. Every rank of the world makes every stage's groups
(``new_group`` is collective); a rank outside ``ranks`` gets an object with ``member`` False.
"""
from __future__ import annotations

import datetime
import itertools
from typing import Sequence

import torch.distributed as dist

from autopar.codegen.groups import GroupHandle
from autopar.errors import MeshError


def default_group_timeout() -> datetime.timedelta | None:
    """The timeout of the default process group (what ``init_process_group`` was given), or None
    when the backend does not expose it."""
    import torch

    pg = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


class MeshGroups:
    """Torch process groups for every non-empty set of ``mesh`` axes; see the module docstring.

    Call it on every rank, in the same place, after ``dist.init_process_group``.

    ``timeout`` (a timedelta, or seconds) bounds every collective on these groups: a collective
    whose peer is dead or stuck raises after it instead of hanging. None: the default group's
    timeout (``init_process_group(timeout=...)``, ``spawn(timeout_s=...)``), which torch's
    ``new_group`` would otherwise replace by its own backend default (30 minutes for gloo). The
    whole-mesh group is the default group itself, unless ``timeout`` differs from its timeout; then
    a group of every rank is made with ``timeout``. ``.timeout`` is the timeout the groups got."""

    def __init__(self, mesh, *, timeout=None, ranks=None):
        if not dist.is_available() or not dist.is_initialized():
            raise MeshError(
                "MeshGroups needs a default process group; call torch.distributed.init_process_group "
                "(or run under autopar.runtime.launch.spawn / torchrun) first"
            )
        world = dist.get_world_size()
        if ranks is None:
            mesh.check_world_size(world)
            ranks = range(world)
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) != mesh.size or len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
            raise MeshError(f"a sub-mesh {mesh} needs {mesh.size} distinct ranks of the world's {world}; got {list(ranks)}")
        self.mesh = mesh
        self.global_ranks = ranks  # global rank of each mesh position (row-major)
        self.global_rank = dist.get_rank()
        self.member = self.global_rank in ranks
        self.rank = ranks.index(self.global_rank) if self.member else -1  # position in the mesh
        self.coordinate = mesh.coordinate(self.rank) if self.member else None
        self._pgs: dict[frozenset[int], object] = {}
        self._handles: dict[tuple[int, ...], GroupHandle] = {}
        world_timeout = default_group_timeout()
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        self.timeout = timeout if timeout is not None else world_timeout
        self._create(self.timeout, own_world=timeout is not None and timeout != world_timeout)

    # ---- construction -----------------------------------------------------------------------
    def _create(self, timeout, own_world: bool) -> None:
        mesh, g = self.mesh, self.global_ranks
        real = [a for a in range(mesh.ndim) if mesh.shape[a] > 1]
        whole = g == tuple(range(dist.get_world_size()))
        world = dist.group.WORLD if whole and not own_world else dist.new_group(ranks=sorted(g), timeout=timeout)
        # Every rank walks the same subsets in the same order and calls new_group for each group.
        for k in range(1, len(real) + 1):
            for subset in itertools.combinations(real, k):
                key = frozenset(subset)
                if len(subset) == len(real):
                    self._pgs[key] = world
                    continue
                for members in mesh.groups(subset):
                    pg = dist.new_group(ranks=sorted(g[m] for m in members), timeout=timeout)
                    if self.rank in members:
                        self._pgs[key] = pg
        if not real:  # a one-rank mesh
            self._pgs[frozenset()] = world
        elif len(real) < mesh.ndim:
            for r in range(mesh.size):
                pg = dist.new_group(ranks=[g[r]], timeout=timeout)
                if r == self.rank:
                    self._pgs[frozenset()] = pg

    def _key(self, axes: int | str | Sequence[int | str]) -> tuple[int, ...]:
        if isinstance(axes, (int, str)):
            axes = (axes,)
        axes = tuple(self.mesh.axis(a) for a in axes)
        if not axes:
            raise MeshError("a process group needs at least one mesh axis; got an empty axis list")
        if len(set(axes)) != len(axes):
            raise MeshError(f"axes {axes} repeat a mesh axis")
        return axes

    # ---- lookups ----------------------------------------------------------------------------
    def handle(self, axes) -> GroupHandle:
        """Everything about this rank's group over ``axes`` (indices or names, major first)."""
        key = self._key(axes)
        h = self._handles.get(key)
        if h is None:
            if not self.member:
                raise MeshError(f"rank {self.global_rank} is not in the sub-mesh over ranks {list(self.global_ranks)}")
            ranks = tuple(self.global_ranks[m] for m in self.mesh.group_of(self.rank, key))
            pg = self._pgs[frozenset(a for a in key if self.mesh.shape[a] > 1)]
            pg_ranks = tuple(sorted(ranks, key=lambda r: dist.get_group_rank(pg, r)))
            h = GroupHandle(key, ranks, ranks.index(self.global_rank), pg, pg_ranks)
            self._handles[key] = h
        return h

    def group(self, axes):
        """The torch ProcessGroup over ``axes`` that contains this rank."""
        return self.handle(axes).pg

    def ranks(self, axes) -> list[int]:
        """Global ranks of this rank's group over ``axes``, in shard order."""
        return list(self.handle(axes).ranks)

    def index(self, axes) -> int:
        """This rank's position in ``ranks(axes)``."""
        return self.handle(axes).index

    def size(self, axes) -> int:
        return self.handle(axes).size

    def __repr__(self) -> str:
        return f"MeshGroups({self.mesh}, rank={self.rank}, coordinate={self.coordinate})"
