"""Profiled op times: run each ATen op on random tensors of its local shard shapes and time it.

    table = profile_ops(graph, mesh, strategies)        # {node name: [Strategy, ...]} or [(node, s)]
    fwd_s, bwd_s = node_time(node, strategy, graph, mesh, op_table=table)

Every distinct key (ATen target, local shapes of the tensor inputs, compute dtype) is timed once:
the forward (``torch.ops.aten.<op>``) and, separately, its backward (``torch.autograd.grad`` of
the op's outputs with random output gradients, for the inputs that need gradients in the graph),
each the median of the fastest half of ``repeats`` runs after ``warmup`` runs (a run the OS
preempted, or that ranks sharing cores slowed, is 10-100x the others: one such run of three must
not become the op's price; shared cores are priced separately, by ``rank_contention``), less what the same timing measures
for a trivial op (calling one op, and one ``autograd.grad`` call, cost more alone than inside a
model's forward and backward; the step model adds a per-op overhead instead). Skipped: views (they cost ~0), ops
without tensor inputs (constants), non-ATen targets, and ops that fail on the local shapes (their
reason is kept in ``table.skipped``; the roofline prices them).

Inputs: floating tensors are ``randn``; integer tensors are zeros (always valid indices and
targets); boolean tensors are all True (attention masks that mask nothing); made once and reused
by every run, as a training step reuses its memory. Non-tensor arguments
are passed as traced, so ops whose arguments name sizes (views, ``expand``) are not profiled.

The table is cached as JSON in ``cache_dir()/ops-<device>-torch<version>.json`` and extended, not
replaced, by later runs; ``profile_ops`` only times keys the cached table lacks.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Iterable, Mapping

import torch

from autopar.cost_model.cache import cache_dir, device_name, read_json, slug, synchronizer, write_json
from autopar.cost_model.compute import compute_dtype, grad_mask, local_input_shapes
from autopar.cost_model.ops import is_floating, is_view, tensor_inputs
from autopar.errors import AutoparError
from autopar.ir.graph import NodeRef

# 2: the call overheads of timing one op alone are subtracted; 3: fastest-half medians; 4: inputs
# reused across runs (no page faults in the timing); 5: live tables scaled by the slowest rank's
# contention
TABLE_VERSION = 5
# An op whose first run takes longer than LONG_RUN_S is timed in one warm-up and as many runs as fit
# LONG_BUDGET_S (two at least): the LM head of a 50k vocabulary took 0.7 s a run, 5 s in all.
LONG_RUN_S = 0.05
LONG_BUDGET_S = 0.3


def _mask_str(mask) -> str:
    return "".join("1" if m else "0" for m in mask)


@dataclasses.dataclass
class OpTiming:
    """forward_s: median forward seconds. backward_s: median backward seconds per grad mask (one
    character per tensor input, "1" when it needs a gradient, e.g. "110" for linear(x, w, b) with
    a trainable x and w and a frozen bias)."""

    forward_s: float
    backward_s: dict[str, float] = dataclasses.field(default_factory=dict)


class OpTable:
    """Profiled op times keyed by (target, local input shapes, dtype); see the module docstring."""

    def __init__(self, device: str = "", torch_version: str = torch.__version__, entries=None):
        self.device = device
        self.torch_version = torch_version
        self.entries: dict[str, OpTiming] = dict(entries or {})
        self.skipped: dict[str, str] = {}  # key -> why it was not timed (not saved)

    @staticmethod
    def key(target: str, shapes, dtype: str) -> str:
        """``aten.mm.default [[8,32],[32,64]] float32``."""
        return f"{target} {json.dumps([list(s) for s in shapes], separators=(',', ':'))} {dtype}"

    def lookup(self, target: str, shapes, dtype: str, mask=None) -> tuple[float, float | None] | None:
        """(forward s, backward s or None) for an exact key, or None. Backward is None when it was
        not measured with this grad ``mask``."""
        entry = self.entries.get(self.key(target, shapes, dtype))
        if entry is None:
            return None
        bwd = None if mask is None else entry.backward_s.get(_mask_str(mask))
        return entry.forward_s, bwd

    def add(self, target: str, shapes, dtype: str, forward_s: float, backward_s: float | None = None, mask=None) -> None:
        entry = self.entries.setdefault(self.key(target, shapes, dtype), OpTiming(float(forward_s)))
        entry.forward_s = float(forward_s)
        if backward_s is not None:
            entry.backward_s[_mask_str(mask)] = float(backward_s)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    # ---- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": TABLE_VERSION,
            "device": self.device,
            "torch_version": self.torch_version,
            "entries": {k: dataclasses.asdict(v) for k, v in sorted(self.entries.items())},
        }

    @staticmethod
    def from_dict(d: dict) -> "OpTable":
        entries = {k: OpTiming(float(v["forward_s"]), {m: float(t) for m, t in v.get("backward_s", {}).items()})
                   for k, v in d.get("entries", {}).items()}
        return OpTable(d.get("device", ""), d.get("torch_version", ""), entries)

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path is not None else default_table_path(self.device, self.torch_version)
        write_json(path, self.to_dict())
        return path

    @staticmethod
    def load(path: str | Path) -> "OpTable":
        data = read_json(Path(path))
        if data is None:
            raise FileNotFoundError(f"no readable op table at {str(path)!r}")
        return OpTable.from_dict(data)


def default_table_path(device: str, torch_version: str = torch.__version__, directory=None) -> Path:
    """``cache_dir()/ops-<device>-torch<version>.json``."""
    return cache_dir(directory) / f"ops-{slug(device)}-torch{slug(torch_version)}.json"


def load_op_table(device: str | torch.device = "cpu", directory=None, label: str | None = None) -> OpTable:
    """The cached table for this device and torch version (empty when there is none). ``label``
    names the device instead (e.g. with the number of ranks sharing it)."""
    name = label or device_name(device)
    data = read_json(default_table_path(name, directory=directory))
    if data is None or data.get("version") != TABLE_VERSION:
        return OpTable(name)
    return OpTable.from_dict(data)


# ---- profiling --------------------------------------------------------------------------------------
def profile_ops(
    graph,
    mesh,
    strategies=None,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    *,
    warmup: int = 2,
    cache: bool = True,
    directory=None,
    select=None,
    label: str | None = None,
    scale_above: float | None = None,
) -> OpTable:
    """Time every distinct (target, local shapes, dtype) of ``graph`` under ``strategies``.

    strategies: ``{node name: Strategy | [Strategy, ...]}``, an iterable of ``(node or name,
    Strategy)`` or ``(node or name, Strategy, mesh)`` (a mesh of its own: another view of the
    devices), or None (every node replicated). ``cache``: start from the cached table and write
    the result back (``directory`` overrides the cache dir). ``select(key)``: time only the keys
    it accepts (e.g. those another table lacks). ``label``: the table's device name (default
    ``device_name(device)``). ``scale_above``: a strategy doing at least this many times the work of
    its node's least-work strategy (``Strategy.compute_fraction``: the replicated run of an op the
    others split) is not timed but priced as the timed one scaled by the work (a 4x larger matmul
    is at most 4x slower; timing the whole LM head on one rank took seconds of a first call)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    table = load_op_table(device, directory, label) if cache else OpTable(label or device_name(device))
    added = 0
    base = None
    todo = []
    for node, strategy, on in _pairs(graph, strategies, mesh):
        if node.op != "call_function" or is_view(node.target) or not tensor_inputs(node, graph):
            continue
        try:
            shapes = local_input_shapes(node, strategy, graph, on)
        except AutoparError:  # an uneven or mismatched spec: nothing to time
            continue
        todo.append((node, shapes, getattr(strategy, "compute_fraction", 1.0) if strategy is not None else 1.0))
    least = {}
    for node, shapes, work in todo:
        if node.name not in least or work < least[node.name][1]:
            least[node.name] = (shapes, work)
    scaled = []
    for node, shapes, work in sorted(todo, key=lambda t: t[2]):  # the least work first: the others scale it
        dtype = compute_dtype(node, graph)
        mask = grad_mask(node, graph)
        key = OpTable.key(node.target, shapes, dtype)
        hit = table.lookup(node.target, shapes, dtype, mask)
        if key in table.skipped or (hit is not None and hit[1] is not None) or (select is not None and not select(key)):
            continue
        small, small_work = least[node.name]
        if scale_above is not None and work >= scale_above * small_work:
            scaled.append((node, shapes, dtype, mask, small, work / small_work))
            continue
        base = base or call_overheads(device, repeats)
        try:
            fwd, bwd = _time_op(node, shapes, mask, graph, device, repeats, warmup)
            fwd, bwd = max(fwd - base[0], 0.0), max(bwd - base[1], 0.0)
        except Exception as err:  # the op cannot run on these shapes: the roofline prices it
            table.skipped[key] = f"{type(err).__name__}: {err}"
            continue
        table.add(node.target, shapes, dtype, fwd, bwd, mask)
        added += 1
    for node, shapes, dtype, mask, small, ratio in scaled:
        hit = table.lookup(node.target, small, dtype, mask)
        if hit is None or hit[1] is None:  # the small one could not run: the roofline prices both
            continue
        table.add(node.target, shapes, dtype, hit[0] * ratio, hit[1] * ratio, mask)
        added += 1
    if cache and added:
        table.save(default_table_path(table.device, table.torch_version, directory))
    return table


def _pairs(graph, strategies, mesh) -> Iterable[tuple[object, object, object]]:
    """(node, strategy, mesh) for each pair to time."""
    if strategies is None:
        return [(n, None, mesh) for n in graph.nodes.values()]
    if isinstance(strategies, Mapping):
        out = []
        for name, s in strategies.items():
            for one in (s if isinstance(s, (list, tuple)) else [s]):
                out.append((graph.nodes[name], one, mesh))
        return out
    return [(graph.nodes[p[0]] if isinstance(p[0], str) else p[0], p[1], p[2] if len(p) > 2 else mesh) for p in strategies]


def aten_op(target: str):
    """``"aten.linear.default"`` -> ``torch.ops.aten.linear.default``."""
    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        raise ValueError(f"{target} is not an ATen op overload")
    return getattr(getattr(torch.ops.aten, parts[1]), parts[2])


def _time_op(node, shapes, mask, graph, device, repeats: int, warmup: int) -> tuple[float, float]:
    op = aten_op(node.target)
    tin = tensor_inputs(node, graph)
    slots = {i: k for k, (i, _) in enumerate(tin)}  # position in node.inputs -> tensor-input index

    def make_inputs():
        tensors = []
        for (_, name), shape, needs in zip(tin, shapes, mask):
            meta = graph.nodes[name].tensor_meta
            tensors.append(_random(shape, meta.dtype, device, needs))
        return tensors

    def call(tensors):
        counter = iter(range(len(node.inputs)))

        def fill(v):
            if isinstance(v, NodeRef):
                k = slots.get(next(counter))
                if k is None:
                    raise ValueError(f"argument {v} of {node.name} is not a single tensor")
                return tensors[k]
            if isinstance(v, (list, tuple)):
                return type(v)(fill(x) for x in v)
            return v

        args = fill(tuple(node.args))
        kwargs = {k: fill(v) for k, v in node.kwargs.items()}
        return op(*args, **kwargs)

    sync = synchronizer(device)
    forward, backward = [], []
    # One set of inputs (and output gradients) for every run, as a training step reuses its memory:
    # fresh multi-MB inputs each run made every run pay first-touch page faults (cross-entropy over
    # 512 x 8192 logits timed 25 ms backward instead of 2.7, and drove plans to vocabulary-parallel
    # losses); the allocator settles after a run or two, hence the warm-up.
    tensors = make_inputs()
    grads = None
    runs, it = warmup + repeats, 0
    while it < runs:
        sync()
        t0 = time.perf_counter()
        out = call(tensors)
        sync()
        t1 = time.perf_counter()
        leaves = [t for t in tensors if t.requires_grad]
        outs = [o for o in _flat(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        bwd = 0.0
        if leaves and outs:
            grads = grads or [torch.rand_like(o) for o in outs]
            sync()
            t2 = time.perf_counter()
            torch.autograd.grad(outs, leaves, grads, allow_unused=True)
            sync()
            bwd = time.perf_counter() - t2
        if it == 0 and t1 - t0 + bwd > LONG_RUN_S:  # a long op varies little run to run: fewer runs
            warmup = 1
            runs = warmup + max(2, min(repeats, math.ceil(LONG_BUDGET_S / (t1 - t0 + bwd))))
        if it >= warmup:
            forward.append(t1 - t0)
            backward.append(bwd)
        it += 1
    return fastest_half_median(forward), fastest_half_median(backward)


def fastest_half_median(samples: list[float]) -> float:
    """The median of the fastest ceil(n/2) samples: robust to up to half the runs slowed by
    interference (interference only ever adds time)."""
    fast = sorted(samples)[: (len(samples) + 1) // 2]
    return statistics.median(fast)


def call_overheads(device, repeats: int = 5) -> tuple[float, float]:
    """(forward, backward) seconds that ``_time_op`` measures for a one-element multiply: the
    fixed cost of timing an op alone (Python call, dispatch, ``autograd.grad`` set-up)."""
    x = torch.ones(1, device=device, requires_grad=True)
    s = torch.ones(1, device=device)
    sync = synchronizer(device)
    fwd, bwd = [], []
    for _ in range(max(repeats, 5) + 2):
        sync()
        t0 = time.perf_counter()
        y = torch.ops.aten.mul.Tensor(x, s)
        sync()
        t1 = time.perf_counter()
        torch.autograd.grad([y], [x], [s])
        sync()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd[2:]), statistics.median(bwd[2:])


def _random(shape, dtype: str, device, requires_grad: bool) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if is_floating(dtype):
        return torch.randn(shape, dtype=dt, device=device).requires_grad_(requires_grad)
    if dt is torch.bool:
        return torch.ones(shape, dtype=dt, device=device)
    return torch.zeros(shape, dtype=dt, device=device)


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]
