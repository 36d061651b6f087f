"""How a parameter's gradient is synchronised over the ranks that hold the parameter alike.

Data parallel sums it whole on every rank (an all-reduce). ZeRO-2 sums it and splits it: each rank
keeps the chunk it updates, and the updated chunk is all-gathered into every rank's working copy
after the step. Three collectives sum-and-split: a reduce-scatter; an all-reduce of which each rank
keeps its chunk; an all-to-all that brings each rank every rank's part of its chunk, which it then
adds up itself. The planner takes the cheapest on the group's links (gloo's reduce-scatter moves a
byte ~4x slower than its all-reduce and its all-to-all ~1.5x faster; NCCL's reduce-scatter needs
no sum of its own).

One typed value names this for the planner, the cost model, codegen and the runtime alike, and a
plan file stores it as such (``to_json``/``from_json``; schema-4 files spelt it as a string).
"""
from __future__ import annotations

import dataclasses

from autopar.errors import PlanError

SUMS = ("all_reduce", "reduce_scatter", "all_to_all")
# ZeRO-2's sum-and-split collectives, in the order a tie keeps (the first)
ZERO2_SUMS = ("reduce_scatter", "all_reduce", "all_to_all")


@dataclasses.dataclass(frozen=True)
class GradSync:
    """``sum_by``: the collective that sums (one of ``SUMS``); ``split``: ZeRO-2 (each rank keeps
    its chunk of the sum; the updated chunk all-gathered after the step); ``axes``: the mesh axes
    of the group; ``nbytes``: the gradient's local bytes, as the alpha-beta formulas count them."""

    sum_by: str
    split: bool
    axes: tuple[int, ...]
    nbytes: int

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(int(a) for a in self.axes))
        if self.sum_by not in SUMS:
            raise PlanError(f"gradient sync by {self.sum_by!r}: expected one of {list(SUMS)}")
        if not self.split and self.sum_by != "all_reduce":
            raise PlanError(f"a gradient summed whole is summed by an all_reduce, not by {self.sum_by!r}")

    @staticmethod
    def all_reduce(axes, nbytes: int) -> "GradSync":
        return GradSync("all_reduce", False, tuple(axes), int(nbytes))

    @staticmethod
    def zero2(sum_by: str, axes, nbytes: int) -> "GradSync":
        return GradSync(sum_by, True, tuple(axes), int(nbytes))

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collectives one step runs for it, in order: the sum, and ZeRO-2's gather after."""
        return (self.sum_by, "all_gather") if self.split else (self.sum_by,)

    @property
    def name(self) -> str:
        """How explain says it: its collectives, ``all_reduce`` or ``all_to_all+all_gather``."""
        return "+".join(self.collectives)

    def on(self, axes) -> "GradSync":
        """The same sync over other axes."""
        return dataclasses.replace(self, axes=tuple(axes))

    def to_json(self) -> dict:
        return {"sum_by": self.sum_by, "split": self.split, "axes": list(self.axes), "nbytes": int(self.nbytes)}

    @staticmethod
    def from_json(d) -> "GradSync | None":
        """A plan file's entry: the schema-5 object, or a schema-4 ``[kind, axes, bytes]`` whose kind
        is ``"all_reduce"`` or ZeRO-2's ``"<sum>+all_gather"``."""
        if d is None:
            return None
        if isinstance(d, dict):
            return GradSync(str(d["sum_by"]), bool(d["split"]), tuple(d["axes"]), int(d["nbytes"]))
        kind, axes, nbytes = d
        if kind not in _SCHEMA4_KINDS:
            raise PlanError(f"gradient sync {kind!r} is not one this autopar runs")
        return GradSync(*_SCHEMA4_KINDS[kind], tuple(axes), int(nbytes))


# a schema-4 plan file's sync kinds: (sum_by, split)
_SCHEMA4_KINDS = {"all_reduce": ("all_reduce", False), **{f"{k}+all_gather": (k, True) for k in ZERO2_SUMS}}
