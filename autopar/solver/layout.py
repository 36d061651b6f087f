"""Hand-style layouts: "data parallel 2 x tensor parallel 2, ZeRO-2", as a restriction of the plan space.

A ``Layout`` names what a person configures by hand (Megatron / Colossal-AI's hybrid plugin):

    dp    data-parallel degree: activations split on their batch dim over the dp axis, parameters
          used whole along it. The batch dim is dim 0 where that dim has the inputs' batch size;
          where code moved it (attention written time-first, ``nn.MultiheadAttention``'s
          internal transposes) one dim, the planner's choice, is split over the dp axis;
    tp    tensor-parallel degree: every matmul / embedding inside a repeated block reads its weight
          split over the tp axis (Megatron column/row parallel, or 2D with dp); which dim, and what
          the rest of the graph does along that axis, stays the planner's choice;
    zero  0 (parameters, gradients and optimizer states replicated over dp), 2 (gradients and
          optimizer states sharded over dp: reduce-scatter + all-gather) or 3 (parameters stored
          sharded over dp and gathered before use, FSDP); 1 is priced and run as 2 (autopar has no
          all-reduce-then-shard variant, and ZeRO-2 moves no more bytes than ZeRO-1 does);
    vocab_parallel  True / False forces the loss (and the embedding) to be, or not be,
          vocabulary-parallel; None leaves it to the planner;
    cp    context-parallel degree: attention runs as ring attention over the cp axis (the
          sequence of q, k and v split over it; ``rules/attention.py``), parameters used whole
          along it (their gradients summed over it, as over dp); how the other ops split the
          sequence, or not, stays the planner's choice.

``layout_force(graph, mesh, layout)`` turns it into ``force`` predicates (node -> Strategy test)
for ``autopar.plan``; ``autopar.plan(..., force=Layout(...))`` does that itself. The mesh's active
axes are read as (dp, cp, tp) in order (Megatron's order, tp innermost): a (4,) mesh runs dp=4,
cp=4 or tp=4, a (2, 2) mesh dp=2 x tp=2; axes named in a tuple of ``idle_axes`` are left out (the
ranks along them repeat the work: a (2, 2) mesh with ``idle_axes=(0,)`` runs cp=2 twice). Pipeline degrees come with pipeline stages.
"""
from __future__ import annotations

import dataclasses

from autopar.errors import ConfigError
from autopar.ir.aliasing import write_paths
from autopar.ir.graph import Role, call_arg
from autopar.sharding_spec.rules import has_rule, strategies_for
from autopar.sharding_spec.rules.attention import SDPA, ring_axes
from autopar.sharding_spec.strategy import OpContext, active_axes

# ops whose weight a tensor-parallel layout splits
_WEIGHT_OPS = ("linear", "mm", "addmm", "matmul", "bmm", "embedding", "conv")
_LOSS_OPS = ("cross_entropy", "nll_loss")


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    zero: int = 0
    vocab_parallel: bool | None = None
    cp: int = 1

    def __post_init__(self):
        if self.dp < 1 or self.tp < 1 or self.cp < 1:
            raise ConfigError(f"layout degrees must be >= 1, got dp={self.dp}, tp={self.tp}, cp={self.cp}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"layout zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.zero and self.dp == 1:
            raise ConfigError(f"ZeRO stage {self.zero} shards over the data-parallel axis; it needs dp > 1")

    @property
    def name(self) -> str:
        parts = ([f"dp{self.dp}"] + ([f"cp{self.cp}"] if self.cp > 1 else []) + [f"tp{self.tp}"]
                 + ([f"zero{self.zero}"] if self.zero else []))
        if self.vocab_parallel is not None:
            parts.append("vocab" if self.vocab_parallel else "novocab")
        return "-".join(parts)

    def axes(self, mesh) -> tuple[int | None, int | None, int | None]:
        """(dp axis, cp axis, tp axis) on ``mesh`` (None for a degree of 1)."""
        act = active_axes(mesh)
        degrees = (self.dp, self.cp, self.tp)
        want = [d for d in degrees if d > 1]
        sizes = [mesh.shape[a] for a in act]
        if sizes != want:
            raise ConfigError(
                f"layout {self.name} needs a mesh whose axes of size > 1 are {tuple(want) or '(none)'} "
                f"(dp, cp, tp in that order); got mesh shape {tuple(mesh.shape)}: reshape the mesh, e.g. "
                f"Mesh({tuple(want) or (1,)})"
            )
        it = iter(act)
        return tuple(next(it) if d > 1 else None for d in degrees)


def layout_force(graph, mesh, layout: Layout) -> dict:
    """node name -> predicate on a Strategy, restricting the plan to ``layout`` (module docstring)."""
    dp_axis, cp_axis, tp_axis = layout.axes(mesh)
    batch_sizes = {graph.nodes[name].meta.shape[0] for name in graph.inputs
                   if getattr(graph.nodes[name].meta, "shape", None)}
    batch_nodes = _depends_on_input(graph)
    if dp_axis is not None:
        batch_nodes -= _written_whole(graph, mesh, dp_axis, batch_sizes)
    force = {}
    for node in graph.nodes.values():
        preds = []
        if node.op == "placeholder" and node.role == Role.PARAMETER:
            preds.append(_param_storage(node, mesh, layout, dp_axis))
            if cp_axis is not None:
                preds.append(_stored_not_on(cp_axis))
        elif node.op == "call_function":
            # a parameter read through views; one broadcast to the batch (a ViT's class token
            # expanded and concatenated) is an activation there: it splits with the batch
            weights = [i for i, src in enumerate(node.inputs) if (param := param_source(graph, src)) is not None
                       and graph.nodes[src].meta.numel == param.meta.numel]
            # An op without a sharding rule (in-place buffer updates, ops no rule covers) only runs
            # unsplit; a hand-written layout runs it whole too.
            if dp_axis is not None and node.name in batch_nodes and has_rule(node.target):
                shape = getattr(node.meta, "shape", None)
                preds.append(_batch_split(dp_axis, leading=not shape or shape[0] in batch_sizes))
            for i in weights:
                preds.append(_weight_not_on(i, dp_axis) if tp_axis is not None else _weight_whole(i))
                if cp_axis is not None:
                    preds.append(_weight_not_on(i, cp_axis))
                if tp_axis is not None and node.layer is not None and _is_weight_op(node) and \
                        len(graph.nodes[node.inputs[i]].meta.shape) >= 2:
                    preds.append(_weight_on(i, tp_axis))
            if layout.vocab_parallel is not None and any(k in node.target for k in _LOSS_OPS + ("embedding",)):
                preds.append(_vocab(layout.vocab_parallel))
            if cp_axis is not None and node.target == SDPA:
                preds.append(_ring_on(cp_axis))
        if preds:
            force[node.name] = _all(preds, f"{layout.name} at {node.name}", _why_not(graph, node, mesh, layout,
                                                                                   batch_sizes))
    return force


def _why_not(graph, node, mesh, layout: Layout, batch_sizes) -> str:
    """What would keep ``node`` from running under ``layout``, in numbers (for the error a layout
    that cannot be forced gives): a batch or a weight dim the degree does not divide."""
    shape = tuple(getattr(node.meta, "shape", ()) or ())
    if layout.cp > 1 and node.target == SDPA:
        length = shape[-2] if len(shape) >= 2 else 0
        if length % (2 * layout.cp):
            return (f"its sequence of {length} does not cut into 2 x cp = {2 * layout.cp} equal chunks (ring attention "
                    f"balances the causal work over them): use a sequence length that divides by {2 * layout.cp}")
        if call_arg(node.args, node.kwargs, 4, "dropout_p", 0.0):
            return "it runs dropout inside attention, which ring attention does not: set the attention dropout to 0"
    if layout.dp > 1 and shape and shape[0] in batch_sizes and shape[0] % layout.dp:
        b = shape[0]
        return (f"its batch of {b} does not divide by dp={layout.dp}: use a batch that does (e.g. "
                f"{b + (-b % layout.dp)}) or a data-parallel degree that divides {b}")
    if layout.tp > 1 and _is_weight_op(node):
        for src in node.inputs:
            w = param_source(graph, src)
            if w is not None and len(w.meta.shape) >= 2 and all(d % layout.tp for d in w.meta.shape[:2]):
                return (f"its weight {w.param_name} {tuple(w.meta.shape)} has no dim that divides by tp={layout.tp}: "
                        f"use a tensor-parallel degree that divides one of them")
    return ""


# ---- graph facts ------------------------------------------------------------------------------
def _depends_on_input(graph) -> set[str]:
    """Nodes computed from a user input (they carry the batch dim first)."""
    out = set()
    for node in graph.nodes.values():  # topological order
        if node.op == "placeholder":
            if node.role == Role.INPUT:
                out.add(node.name)
        elif any(i in out for i in node.inputs):
            out.add(node.name)
    return out


def _written_whole(graph, mesh, dp_axis: int, batch_sizes) -> set[str]:
    """Writers into a tensor that cannot split its batch (no rule, or the written positions
    address the batch: ``x[arange(B), i] = y``), and the values they write into with the views
    on the way: the write must land in the memory itself (``ir.aliasing``), so all run whole, as a
    hand-written layout runs such code."""
    out = set()
    for writer, path in write_paths(graph).items():
        node = graph.nodes[writer]
        ctx = OpContext(node, mesh, [graph.nodes[i].meta for i in node.inputs], graph)
        shape = getattr(node.meta, "shape", None)
        split = _batch_split(dp_axis, leading=not shape or shape[0] in batch_sizes)
        if not has_rule(node.target) or not any(split(s) for s in strategies_for(ctx)):
            out.add(writer)
            out.update(graph.nodes[reader].inputs[pos] for reader, pos in path)
    return out


def param_source(graph, name: str):
    """The parameter a value is (through views of one input), or None."""
    from autopar.cost_model.ops import is_view

    node = graph.nodes[name]
    while node.op == "call_function" and is_view(node.target) and len(node.inputs) == 1:
        node = graph.nodes[node.inputs[0]]
    return node if node.op == "placeholder" and node.role == Role.PARAMETER else None


def _is_weight_op(node) -> bool:
    return any(k in node.target for k in _WEIGHT_OPS)


# ---- predicates -------------------------------------------------------------------------------
class _all:
    """All of several predicates (named, for the error a too-tight layout gives)."""

    def __init__(self, preds, what: str, why_not: str = ""):
        self.preds, self.what, self.why_not = preds, what, why_not

    def __call__(self, strategy) -> bool:
        return all(p(strategy) for p in self.preds)

    def __repr__(self) -> str:
        return f"layout {self.what}"


def _first_spec(out):
    return out[0] if isinstance(out, tuple) else out


def _batch_split(dp_axis: int, leading: bool = True):
    """The output split over ``dp_axis`` on dim 0 and nowhere else (``leading``), or on exactly one
    dim (where the batch is not dim 0)."""
    def pred(s) -> bool:
        out = _first_spec(s.output)
        if out is None or out.ndim == 0:
            return True
        split = [d for d, axes in enumerate(out.dim_axes) if dp_axis in axes]
        if leading:
            return out.dim_axes[0][:1] == (dp_axis,) and split == [0]
        return len(split) == 1 and dp_axis not in out.partial
    return pred


def _weight_not_on(i: int, axis: int | None):
    def pred(s) -> bool:
        spec = s.inputs[i] if i < len(s.inputs) else None
        return spec is None or axis is None or (axis not in spec.used_axes and axis not in spec.partial)
    return pred


def _weight_whole(i: int):
    def pred(s) -> bool:
        spec = s.inputs[i] if i < len(s.inputs) else None
        return spec is None or (spec.is_replicated and not spec.partial)
    return pred


def _weight_on(i: int, axis: int):
    def pred(s) -> bool:
        spec = s.inputs[i] if i < len(s.inputs) else None
        return spec is not None and axis in spec.used_axes
    return pred


def _stored_not_on(axis: int):
    def pred(s) -> bool:
        return s.output is None or axis not in s.output.used_axes
    return pred


def _ring_on(axis: int):
    """Ring attention whose sequence runs over ``axis``."""
    def pred(s) -> bool:
        return s.family.ring is not None and axis in ring_axes(s.output)
    return pred


def _vocab(want: bool):
    def pred(s) -> bool:
        return s.family.vocab_parallel == want
    return pred


def _param_storage(node, mesh, layout: Layout, dp_axis):
    """ZeRO 0: stored whole over dp; 1/2: the ZeRO-2 variant; 3: stored split over dp where a dim
    divides (else whole, as FSDP keeps a tiny odd tensor replicated)."""
    splittable = dp_axis is not None and any(d % mesh.shape[dp_axis] == 0 for d in node.meta.shape)

    def pred(s) -> bool:
        on_dp = dp_axis is not None and dp_axis in s.output.used_axes
        zero2 = s.family.zero2
        if layout.zero == 3 and splittable:
            return on_dp and not zero2
        if layout.zero in (1, 2) and dp_axis is not None:
            return zero2 and not on_dp
        return not zero2 and not on_dp
    return pred
