"""Sharding strategies of one op, and the registry of rules that produce them.

A rule looks at one traced node (its ATen target, arguments and input shapes) and returns every way
the op can run on the mesh: the spec it needs for each tensor input, the spec of its output, the
fraction of the op's FLOPs each device does, and a family label (see DESIGN.md: dp, 1d-col, 1d-row,
2d, 2.5d, 3d, ...). A pending sum the op leaves behind (a split contraction) is part of its output
spec (``| P1``); whoever reads the output decides how to resolve it.

Rules register with ``@register("aten.mm.default", ...)`` and live in ``rules/`` by op family, which
imports this module for these types; the lookup is ``rules.strategies_for`` (importing ``rules``
registers every rule). An op without a rule runs replicated (said once, as an INFO record of the
``autopar`` logger; ``explain`` counts it under the family "replicate"): never a crash. An in-place
op (``aten.add_.Tensor``, ``aten.copy_.default``) without a rule of its own takes its functional
twin's strategies that leave the written tensor in the spec it is read in (the output *is* that
tensor).

A strategy is exact when every rank runs the same ATen op on its local shards, with the size
arguments of view-like ops and factories rewritten to local sizes (``rules._common.localize_args``);
the families in ``LOWERED_FAMILIES`` are the exceptions, which codegen must lower as documented in
their rule. Families (``Family``: parts joined with "+" in their label, e.g. "dp+1d-col", "dp+heads"):

    replicate                  everything whole on every device
    dp, sp                     a batch / a later (sequence) dim of the activations split
    1d-col, 1d-row, 2d, 2d-mk, 2d-nk, 2.5d, 3d    matmul splits (rules/matmul.py)
    pointwise                  elementwise op on split or pending-sum operands
    reduce, reduce-partial     reduction over whole dims / sum over a split dim (pending sum out)
    norm                       softmax / layer norm with the non-normalized dims split
    view                       shape op (view, transpose, slice, split, cat, getitem, ...)
    index                      indexing / positional op (index, gather, tril, pad, diff)
    constant                   tensor factory building its local shard
    heads                      attention heads split (Megatron attention TP); with dp, sp
    embedding-hidden           embedding table split by columns
    embedding-vocab-parallel   embedding table split by rows: LOWERED (masked lookup)
    loss-batch-split(mean)     mean loss over split samples: LOWERED (sum / global denominator)
    loss-vocab-parallel        cross entropy over split classes: LOWERED (Megatron-style)
    ring, ring(causal)         attention over a sequence split on q, k and v: LOWERED (ring
                               attention, key/value blocks passed around the ranks)
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable, Iterable, Sequence

from autopar.sharding_spec.spec import ShardingSpec


# The parts of families a codegen cannot run as the plain local op; see their rules for the lowering.
VOCAB_EMBEDDING = "embedding-vocab-parallel"
VOCAB_LOSS = "loss-vocab-parallel"
MEAN_SPLIT = "loss-batch-split(mean)"
MEAN_PARTIAL = "reduce-partial(mean)"
RING, RING_CAUSAL = "ring", "ring(causal)"
LOWERED_FAMILIES = frozenset({VOCAB_EMBEDDING, MEAN_SPLIT, VOCAB_LOSS, MEAN_PARTIAL, RING, RING_CAUSAL})
ZERO2 = "zero2"  # a parameter's storage family part: its gradient summed and split (ZeRO-2)


class Family(str):
    """A strategy's family: its label ("dp+1d-col", shown and stored as is, equal to the string)
    and the parts it joins, which code asks about by name (``has``, ``lowered``, ``ring``, ...)
    rather than by matching text. ``Family.of(*parts)`` builds one ("replicate" for none); the
    constructor reads a label (a plan file's, a user's ``force``)."""

    @classmethod
    def of(cls, *parts: str) -> "Family":
        return cls("+".join(p for p in parts if p) or "replicate")

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.split("+"))

    def has(self, part: str) -> bool:
        return part in self.parts

    @property
    def lowered(self) -> frozenset[str]:
        """Its parts codegen lowers (``LOWERED_FAMILIES``)."""
        return frozenset(self.parts) & LOWERED_FAMILIES

    @property
    def ring(self) -> str | None:
        """Its ring-attention part (``RING`` or ``RING_CAUSAL``), or None."""
        return next((p for p in self.parts if p in (RING, RING_CAUSAL)), None)

    @property
    def vocab_parallel(self) -> bool:
        """Whether it splits a vocabulary (an embedding table's rows, a loss's classes)."""
        return self.has(VOCAB_EMBEDDING) or self.has(VOCAB_LOSS)

    @property
    def zero2(self) -> bool:
        """A parameter's storage family: whether its gradient is summed and split (ZeRO-2)."""
        return self.has(ZERO2)

    @property
    def takes_mean(self) -> bool:
        """Whether it computes a mean over split elements (its lowering divides by the global count)."""
        return self.has(MEAN_SPLIT) or self.has(MEAN_PARTIAL)


def needs_lowering(family: str) -> bool:
    """Whether a strategy of this family needs codegen's special lowering (any part does)."""
    return bool(Family(family).lowered)


# A spec per output: one spec for a single tensor, a tuple for ops returning several, None for none.
OutSpec = ShardingSpec | tuple[ShardingSpec | None, ...] | None


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run an op. ``inputs`` is aligned with ``node.inputs`` (None: not a tensor)."""

    inputs: tuple[ShardingSpec | None, ...]
    output: OutSpec
    family: Family
    compute_fraction: float = 1.0

    def __post_init__(self):
        if type(self.family) is not Family:
            object.__setattr__(self, "family", Family(self.family))

    def __str__(self) -> str:
        ins = ", ".join("-" if s is None else s.notation() for s in self.inputs)
        return f"({ins}) -> {_out_str(self.output)} [{self.family}]"


def _out_str(out: OutSpec) -> str:
    if out is None:
        return "-"
    if isinstance(out, ShardingSpec):
        return out.notation()
    return "(" + ", ".join(_out_str(o) for o in out) + ")"


@dataclasses.dataclass
class OpContext:
    """What a rule may look at: the node, the mesh and the metadata of each input."""

    node: object  # autopar.ir.Node
    mesh: object  # autopar.Mesh
    input_metas: list  # aligned with node.inputs: TensorMeta, tuple of them, or None
    graph: object = None  # autopar.ir.Graph, for rules that need to look further

    @property
    def out_meta(self):
        return self.node.meta

    def arg(self, i: int, name: str | None = None, default=None):
        """The i-th positional argument, or keyword ``name`` when it was passed by keyword."""
        args = self.node.args
        if i < len(args):
            return args[i]
        return self.node.kwargs.get(name, default) if name else default

    def kwarg(self, name: str, default=None):
        return self.node.kwargs.get(name, default)

    def shape_of(self, i: int) -> tuple[int, ...]:
        """Shape of the i-th tensor input (in ``node.inputs`` order)."""
        return tuple(self.input_metas[i].shape)

    def index_of(self, ref) -> int:
        """Position in node.inputs of an argument that is a node reference."""
        return self.node.inputs.index(ref.name)

    def replicated(self) -> Strategy:
        return replicate_strategy(self)


Rule = Callable[[OpContext], list[Strategy]]
_RULES: dict[str, Rule] = {}


def register(*targets: str):
    """Register a rule for ATen targets written like ``"aten.mm.default"``."""

    def deco(fn: Rule) -> Rule:
        for t in targets:
            if t in _RULES:
                raise ValueError(f"two rules registered for {t}")
            _RULES[t] = fn
        return fn

    return deco


def functional_twin(target: str) -> str | None:
    """``aten.add.Tensor`` for ``aten.add_.Tensor``; None for targets that are not in-place."""
    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten" or not parts[1].endswith("_") or parts[1].startswith("_"):
        return None
    return f"aten.{parts[1][:-1]}.{parts[2]}"


def rule_of(target: str) -> Rule | None:
    """The rule registered for ``target``, or for an in-place target without one its functional
    twin's, restricted to the strategies that write where they read; None when neither has one."""
    rule = _RULES.get(target)
    twin = functional_twin(target) if rule is None else None
    if twin is not None and twin in _RULES:
        return functools.partial(_in_place_rule, _RULES[twin], twin)
    return rule


def _in_place_rule(functional: Rule, twin: str, ctx: OpContext) -> list[Strategy]:
    """The strategies of ``twin`` (the functional op) whose output spec is the spec its first
    input (the written tensor) is read in: the op writes its result there, in place."""
    node = dataclasses.replace(ctx.node, target=twin)
    out = []
    for s in functional(dataclasses.replace(ctx, node=node)):
        if s.inputs and s.inputs[0] is not None and s.inputs[0] == s.output:
            out.append(s)
    return out


def registered_targets() -> list[str]:
    """The targets rules are registered for (every rule, once ``autopar.sharding_spec.rules`` is imported)."""
    return sorted(_RULES)


# ---- helpers for rules ----------------------------------------------------------------------
def rep(shape: Sequence[int], mesh) -> ShardingSpec:
    return ShardingSpec.replicate(tuple(shape), mesh.ndim)


def _rep_meta(meta, mesh):
    if meta is None:
        return None
    if isinstance(meta, tuple):
        return tuple(_rep_meta(m, mesh) for m in meta)
    return rep(meta.shape, mesh)


def replicate_strategy(ctx: OpContext) -> Strategy:
    """Every input whole on every device, the output too: valid for any op."""
    ins = tuple(None if m is None or isinstance(m, tuple) else rep(m.shape, ctx.mesh) for m in ctx.input_metas)
    if ctx.node.target == "operator.getitem" and ins and isinstance(ctx.input_metas[0], tuple):
        # getitem reads one element of its tuple input: its input spec is that element's spec.
        i = ctx.node.args[1] if len(ctx.node.args) > 1 else None
        elem = ctx.input_metas[0][i] if isinstance(i, int) and -len(ctx.input_metas[0]) <= i < len(ctx.input_metas[0]) else None
        ins = (_rep_meta(elem, ctx.mesh),) + ins[1:]
    return Strategy(ins, _rep_meta(ctx.out_meta, ctx.mesh), "replicate", 1.0)


def active_axes(mesh) -> list[int]:
    """Mesh axes of size > 1: size-1 axes never split anything."""
    return [a for a, s in enumerate(mesh.shape) if s > 1]


def axis_assignments(mesh, n_options: int) -> Iterable[tuple[int | None, ...]]:
    """Every map from active mesh axes to one of ``n_options`` slots or None (one tuple entry per
    mesh axis; inactive axes map to None)."""
    act = active_axes(mesh)
    for choice in itertools.product([None, *range(n_options)], repeat=len(act)):
        full: list[int | None] = [None] * mesh.ndim
        for a, c in zip(act, choice):
            full[a] = c
        yield tuple(full)


def enumerate_specs(shape: Sequence[int], mesh, *, partial: bool = False) -> list[ShardingSpec]:
    """Every even spec of a tensor: each active axis splits one dim (axes on one dim in mesh order)
    or nothing, or, with ``partial``, holds a pending sum."""
    shape = tuple(shape)
    n = len(shape) + (1 if partial else 0)
    out = []
    for assign in axis_assignments(mesh, n):
        dims = tuple(tuple(a for a in range(mesh.ndim) if assign[a] == d) for d in range(len(shape)))
        part = tuple(a for a in range(mesh.ndim) if partial and assign[a] == len(shape))
        spec = ShardingSpec(shape, dims, part, mesh.ndim)
        if spec.is_even(mesh.shape):
            out.append(spec)
    return out


def compute_fraction(spec: ShardingSpec, mesh) -> float:
    """Fraction of an elementwise op's work one device does when its output has ``spec``."""
    return 1.0 / math.prod(mesh.shape[a] for ax in spec.dim_axes for a in ax)
