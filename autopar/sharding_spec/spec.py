"""Placements and sharding specs.

A spec says, for one tensor on one mesh, which mesh axes split which tensor dim and which mesh
axes hold a pending (partial) sum. It is stored per tensor dim, as in Alpa/Colossal-AI:
``dim_axes[d]`` lists the mesh axes that split dim d, most significant first, so ``S01`` splits
the dim over axis 0 and, inside each of those chunks, over axis 1. Partial axes come after a bar:

    [S0, R | P1]     dim 0 split over mesh axis 0, dim 1 whole, pending sum over axis 1

The DTensor view, a placement per mesh axis, is ``spec.placements`` -> ``(S(0), P)``; both forms
parse and print. Splits must be even: a dim of size 10 over 4 ranks is rejected, never padded.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

from autopar.errors import ShardingError


# ---- placements (one per mesh axis) ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclasses.dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclasses.dataclass(frozen=True)
class Partial:
    """A pending sum: the true value is the sum of the ranks' values along this axis."""

    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial


# ---- the spec ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """shape: global shape. dim_axes: mesh axes per tensor dim (major first). partial: mesh axes
    with a pending sum (sorted). mesh_ndim: how many axes the mesh has."""

    shape: tuple[int, ...]
    dim_axes: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...] = ()
    mesh_ndim: int = 1

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dim_axes", tuple(tuple(int(a) for a in ax) for ax in self.dim_axes))
        object.__setattr__(self, "partial", tuple(sorted(int(a) for a in self.partial)))
        if len(self.dim_axes) != len(self.shape):
            raise ShardingError(
                f"spec {self.notation()} has {len(self.dim_axes)} dims but the tensor shape {self.shape} has {len(self.shape)}"
            )
        used = [a for ax in self.dim_axes for a in ax] + list(self.partial)
        for a in used:
            if not 0 <= a < self.mesh_ndim:
                raise ShardingError(f"spec {self.notation()} uses mesh axis {a} but the mesh has axes 0..{self.mesh_ndim - 1}")
        if len(set(used)) != len(used):
            twice = sorted({a for a in used if used.count(a) > 1})
            raise ShardingError(
                f"spec {self.notation()} uses mesh axis {twice[0]} more than once; each mesh axis may split one "
                "dim or hold one pending sum, so drop it from all but one place"
            )
        object.__setattr__(self, "_hash", hash((self.shape, self.dim_axes, self.partial, self.mesh_ndim)))

    def __hash__(self) -> int:
        # Specs key the planner's caches and dicts by the million: hash once.
        return self._hash

    # ---- construction ---------------------------------------------------------------------
    @staticmethod
    def replicate(shape: Sequence[int], mesh_ndim: int) -> "ShardingSpec":
        return ShardingSpec(tuple(shape), tuple(() for _ in shape), (), mesh_ndim)

    @staticmethod
    def from_placements(placements: Sequence[Placement], shape: Sequence[int]) -> "ShardingSpec":
        """DTensor-style: one placement per mesh axis; axes splitting one dim go in mesh order."""
        shape = tuple(shape)
        dim_axes: list[list[int]] = [[] for _ in shape]
        partial = []
        for axis, p in enumerate(placements):
            if isinstance(p, Shard):
                d = p.dim + len(shape) if p.dim < 0 else p.dim
                if not 0 <= d < len(shape):
                    raise ShardingError(f"placement {p} on mesh axis {axis} names dim {p.dim} of a {len(shape)}-d tensor {shape}")
                dim_axes[d].append(axis)
            elif isinstance(p, Partial):
                partial.append(axis)
            elif not isinstance(p, Replicate):
                raise ShardingError(f"unknown placement {p!r}; use Shard(dim), Replicate() or Partial()")
        return ShardingSpec(shape, tuple(map(tuple, dim_axes)), tuple(partial), len(placements))

    @staticmethod
    def parse(text: str, shape: Sequence[int], mesh_ndim: int) -> "ShardingSpec":
        """Parse ``[S0, R, S01 | P1]`` (per tensor dim) or ``(S(0), R, P)`` (per mesh axis)."""
        text = text.strip()
        shape = tuple(shape)
        if text.startswith("("):
            return _parse_placements(text, shape, mesh_ndim)
        m = re.fullmatch(r"\[(.*?)(?:\|\s*P(\d+)\s*)?\]", text)
        if not m:
            raise ShardingError(f"cannot parse spec {text!r}; write it like [S0, R | P1] or (S(0), R, P)")
        body, partial = m.group(1).strip(), m.group(2) or ""
        entries = [e.strip() for e in body.split(",")] if body else []
        if len(entries) != len(shape):
            raise ShardingError(f"spec {text!r} has {len(entries)} dims but the tensor shape {shape} has {len(shape)}")
        dim_axes = []
        for e in entries:
            if e == "R":
                dim_axes.append(())
            elif re.fullmatch(r"S\d+", e):
                dim_axes.append(tuple(int(c) for c in e[1:]))
            else:
                raise ShardingError(f"cannot parse {e!r} in spec {text!r}; each dim is R or S followed by mesh axes, e.g. S01")
        return ShardingSpec(shape, tuple(dim_axes), tuple(int(c) for c in partial), mesh_ndim)

    # ---- views ------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis (DTensor's view; loses the order of axes on one dim)."""
        out: list[Placement] = [Replicate()] * self.mesh_ndim
        for d, axes in enumerate(self.dim_axes):
            for a in axes:
                out[a] = Shard(d)
        for a in self.partial:
            out[a] = Partial()
        return tuple(out)

    def axis_of(self, mesh_axis: int) -> int | None:
        """The tensor dim that ``mesh_axis`` splits, or None."""
        for d, axes in enumerate(self.dim_axes):
            if mesh_axis in axes:
                return d
        return None

    @property
    def used_axes(self) -> frozenset[int]:
        return frozenset(a for ax in self.dim_axes for a in ax) | frozenset(self.partial)

    @property
    def is_replicated(self) -> bool:
        return not self.used_axes

    def notation(self) -> str:
        dims = ", ".join("S" + "".join(map(str, ax)) if ax else "R" for ax in self.dim_axes)
        if self.partial:
            dims += " | P" + "".join(map(str, self.partial))
        return f"[{dims}]"

    def __str__(self) -> str:
        return self.notation()

    def placements_str(self) -> str:
        return "(" + ", ".join(map(str, self.placements)) + ")"

    def with_dim_axes(self, dim_axes, partial=None) -> "ShardingSpec":
        return ShardingSpec(self.shape, tuple(map(tuple, dim_axes)), self.partial if partial is None else tuple(partial), self.mesh_ndim)

    def resolved(self) -> "ShardingSpec":
        """The same splits with every pending sum summed (``P`` -> ``R``)."""
        return ShardingSpec(self.shape, self.dim_axes, (), self.mesh_ndim) if self.partial else self

    # ---- local shards ---------------------------------------------------------------------------
    def check_mesh(self, mesh) -> None:
        if mesh.ndim != self.mesh_ndim:
            raise ShardingError(f"spec {self} is for a {self.mesh_ndim}-axis mesh, not {mesh}")

    def uneven_dims(self, mesh_shape: Sequence[int]) -> list[int]:
        """Dims whose size does not divide by the number of ranks splitting them."""
        return [d for d, ax in enumerate(self.dim_axes) if self.shape[d] % math.prod(mesh_shape[a] for a in ax)]

    def is_even(self, mesh_shape: Sequence[int]) -> bool:
        return not self.uneven_dims(mesh_shape)

    def check_even(self, mesh) -> None:
        self.check_mesh(mesh)
        bad = self.uneven_dims(mesh.shape)
        if bad:
            d = bad[0]
            n = mesh.axes_size(self.dim_axes[d])
            raise ShardingError(
                f"spec {self} splits dim {d} of size {self.shape[d]} over {n} ranks (mesh axes {self.dim_axes[d]} of "
                f"{mesh}); autopar only splits evenly, so choose a size divisible by {n} or another spec"
            )

    def local_shape(self, mesh, rank: int | None = None) -> tuple[int, ...]:
        """The shard's shape (the same on every rank, since splits are even). Kept per mesh shape:
        the planner asks it of the same specs millions of times."""
        known = self.__dict__.get("_local_shapes")
        if known is None:
            known = {}
            object.__setattr__(self, "_local_shapes", known)
        got = known.get(mesh.shape)
        if got is None:
            self.check_even(mesh)
            got = known[mesh.shape] = tuple(s // mesh.axes_size(ax) for s, ax in zip(self.shape, self.dim_axes))
        return got

    def local_offset(self, mesh, rank: int) -> tuple[int, ...]:
        """Where ``rank``'s shard starts in the global tensor, per dim."""
        local = self.local_shape(mesh)
        return tuple(mesh.index_in(rank, ax) * n for ax, n in zip(self.dim_axes, local))

    def local_slices(self, mesh, rank: int) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.local_offset(mesh, rank), self.local_shape(mesh)))

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "spec": self.notation(), "mesh_ndim": self.mesh_ndim}

    @staticmethod
    def from_dict(d: dict) -> "ShardingSpec":
        return ShardingSpec.parse(d["spec"], d["shape"], d["mesh_ndim"])


def _parse_placements(text: str, shape: tuple[int, ...], mesh_ndim: int) -> ShardingSpec:
    inner = text.strip()[1:-1] if text.strip().endswith(")") else None
    if inner is None:
        raise ShardingError(f"cannot parse placements {text!r}; write them like (S(0), R, P)")
    items = re.findall(r"S\(\s*-?\d+\s*\)|R|P", inner)
    if re.sub(r"S\(\s*-?\d+\s*\)|R|P|,|\s", "", inner):
        raise ShardingError(f"cannot parse placements {text!r}; each is S(dim), R or P")
    if len(items) != mesh_ndim:
        raise ShardingError(f"placements {text!r} give {len(items)} entries for a {mesh_ndim}-axis mesh; give one per mesh axis")
    placements: list[Placement] = []
    for it in items:
        if it == "R":
            placements.append(Replicate())
        elif it == "P":
            placements.append(Partial())
        else:
            placements.append(Shard(int(it[2:-1])))
    return ShardingSpec.from_placements(placements, shape)


def spec_str(spec) -> str:
    """The notation of a spec, of a tuple of them (an op with several outputs), or "-" for none."""
    if spec is None:
        return "-"
    if isinstance(spec, tuple):
        return "(" + ", ".join(spec_str(s) for s in spec) + ")"
    return spec.notation()
