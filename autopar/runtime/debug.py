"""Node-by-node comparison against one process: where a parallel program first computes a
different value.

``pmodel.compare_nodes(*inputs)`` (a collective: every rank calls it with the same inputs) runs this
rank's program once without gradients, keeps every traced node's local value (and, after an in-place
write, the value of the tensor written into), gathers each whole over the mesh (pending sums
summed), runs the traced single-device graph on the full state and the same inputs, and compares
them in graph order. The first row that differs names the node whose lowering or strategy is at
fault: a wrong number becomes one node, its op, the spec it ran in and the spec it read.

One-stage plans only; compare with dropout off (``model.eval()`` or p=0): random ops draw
differently in the two runs.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind
from torch.fx import _pytree as fx_pytree

from autopar.codegen import ops
from autopar.errors import ConfigError
from autopar.ir.aliasing import written_bases
from autopar.sharding_spec.spec import ShardingSpec

DEFAULT_TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class NodeDiff:
    """One traced node: its op, the spec this plan holds it in, and max|par - ref| / max|ref|
    (inf for a shape, dtype or integer mismatch). ``node`` reads ``"copy_ -> new_zeros"`` for the
    tensor an in-place op wrote into, checked right after the write."""

    node: str
    target: str
    spec: str
    error: float


@dataclasses.dataclass
class NodeComparison:
    rows: list[NodeDiff]
    tol: float = DEFAULT_TOL

    @property
    def first(self) -> NodeDiff | None:
        """The first node (in program order) whose value differs by more than ``tol``."""
        return next((r for r in self.rows if not r.error <= self.tol), None)

    def __str__(self) -> str:
        first = self.first
        head = (f"first difference: {first.node} ({first.target}, held as {first.spec}): {first.error:.3g}"
                if first else f"every one of {len(self.rows)} nodes within {self.tol:g} of one process")
        width = max([len(r.node) for r in self.rows] + [4])
        lines = [head, f"{'node':<{width}}  {'error':>9}  spec  op"]
        lines += [f"{r.node:<{width}}  {r.error:9.2e}  {r.spec}  {r.target}" for r in self.rows]
        return "\n".join(lines)


def compare_nodes(pmodel, args, kwargs, tol: float = DEFAULT_TOL) -> NodeComparison:
    """See the module docstring. ``pmodel``: a one-stage ``ParallelModule``."""
    ap = pmodel._ap
    if ap.pipeline is not None:
        raise ConfigError("compare_nodes runs one-stage plans; parallelize with pipeline=False to compare node by node")
    args, kwargs = pmodel._normalize(tuple(args), dict(kwargs))
    with torch.no_grad():
        program, flat = pmodel._program(args, kwargs)
        flat = ap.placed(flat)
        state = ap.program_state()
        captured = _run_capturing(program, state, flat, ap.groups)
        full_state = pmodel.full_state_dict()
        reference = _reference_values(program.graph, full_state, args, kwargs, ap.device)
    rows = []
    for name, target, spec, value in captured:
        want = reference.get(name)
        rows.append(NodeDiff(name, target, spec, _error(value, want)))
    return NodeComparison(rows, tol)


def _run_capturing(program, state, flat, groups) -> list[tuple[str, str, str, object]]:
    """(traced node, target, spec notation, whole value) of each traced node the program computes,
    in program order, each gathered whole (collectives in the same order on every rank)."""
    graph = program.graph
    bases = written_bases(graph)
    gm = program.lowered.gm
    by_name = {n.name: n for n in gm.graph.nodes}
    kept: list = []

    class Capture(fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            traced = graph.nodes.get(n.name)
            if n.op == "call_function" and traced is not None and traced.op == "call_function":
                kept.append((n.name, traced.target, n.meta.get("autopar_spec"), _clone(value)))
                base = bases.get(n.name)
                held = _holder(by_name, base)
                if held is not None and held in self.env:
                    kept.append((f"{n.name} -> {base}", traced.target, held.meta.get("autopar_spec"), _clone(self.env[held])))
            return value

    with ops.bind(groups):
        Capture(gm).run(*program.state_inputs(state), *flat)
    out = []
    for name, target, spec, value in kept:
        if isinstance(spec, ShardingSpec) and isinstance(value, torch.Tensor):
            out.append((name, target, spec.notation(), ops.gather_full(value, spec, groups)))
        else:
            out.append((name, target, "-" if spec is None else str(spec), None))
    return out


def _holder(by_name: dict, base: str | None):
    """The program node holding traced value ``base`` as the program reads it (a user input's
    shard where it takes one)."""
    if base is None:
        return None
    return by_name.get(f"{base}_shard") or by_name.get(base)


def _reference_values(graph, full_state: dict, args, kwargs, device) -> dict[str, torch.Tensor]:
    """Every traced node's value (and each written tensor right after its write) in one process."""
    exported = graph.exported
    user = iter(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), exported.call_spec.in_spec))
    feed = {}
    for spec in exported.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            feed[name] = next(user)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            feed[name] = full_state[spec.target].clone() if spec.target in full_state else _state_of(graph, spec.target, full_state)
        else:
            feed[name] = exported.constants[spec.target]
    bases = written_bases(graph)
    gm = exported.graph_module
    by_name = {n.name: n for n in gm.graph.nodes}
    values: dict[str, object] = {}

    class Reference(fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            values[n.name] = _clone(value)
            base = bases.get(n.name)
            if base is not None:
                values[f"{n.name} -> {base}"] = _clone(self.env[by_name[base]])
            return value

    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    Reference(gm).run(*[_to(feed[p], device) for p in placeholders])
    return values


def _state_of(graph, target: str, full_state: dict):
    """A tied parameter's value under any of its names."""
    for canon, names in graph.param_aliases.items():
        if target in names:
            for n in names:
                if n in full_state:
                    return full_state[n].clone()
    raise ConfigError(f"compare_nodes: no full value for {target}")


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) and device is not None else x


def _clone(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else None


def _error(got, want) -> float:
    if not isinstance(want, torch.Tensor):
        return 0.0 if got is None else float("inf")
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    if not want.is_floating_point():
        return 0.0 if torch.equal(got, want) else float("inf")
    a, b = got.double(), want.double()
    if not b.numel():
        return 0.0
    same = (a == b) | (a.isnan() & b.isnan())  # equal infinities (log 0) and NaNs agree
    if same.all():
        return 0.0
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs()).nan_to_num(nan=float("inf"))
    scale = torch.where(b.isfinite(), b.abs(), torch.zeros_like(b)).max().clamp_min(1e-30)
    return (diff.max() / scale).item()
