"""What an emitted program needs of the process groups it runs on, and nothing more.

Codegen names mesh axes, never ranks; the groups are made and bound by the runtime
(``autopar.runtime.process_groups.MeshGroups``, bound by ``ops.bind``). A step over a set of mesh
axes runs on this rank's ``GroupHandle`` for them: the ranks in *shard order* (the first axis most
significant) next to torch's own group-rank order, which every gather, scatter and exchange maps
between explicitly. ``Groups`` is the interface the runtime implements.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class GroupHandle:
    """One rank's view of its group over ``axes``.

    ranks: global ranks in shard order (first axis most significant); index: this rank's position
    in ``ranks``; pg: the torch ProcessGroup; pg_ranks: the same ranks in the group's own rank order
    (``pg_ranks[k]`` is group rank ``k``); shard_of_pg[k]: shard index of group rank ``k``;
    pg_of_shard[i]: group rank of shard index ``i``."""

    axes: tuple[int, ...]
    ranks: tuple[int, ...]
    index: int
    pg: object
    pg_ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @functools.cached_property
    def shard_of_pg(self) -> tuple[int, ...]:
        return tuple(self.ranks.index(r) for r in self.pg_ranks)

    @functools.cached_property
    def pg_of_shard(self) -> tuple[int, ...]:
        return tuple(self.pg_ranks.index(r) for r in self.ranks)

    @property
    def same_order(self) -> bool:
        """Whether shard order equals the torch group's rank order (no reordering needed)."""
        return self.ranks == self.pg_ranks


class Groups(Protocol):
    """This rank's process groups over a mesh: ``mesh``, this rank's ``coordinate`` on it, and
    ``handle(axes)``, its group over those mesh axes (indices, major first)."""

    mesh: object
    coordinate: tuple[int, ...] | None

    def handle(self, axes) -> GroupHandle: ...
