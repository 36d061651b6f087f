"""Test harness for strategy rules: run an ATen op per rank on local shards, in one process, and
check that the shards stand for the op's output on the full tensors.

A strategy passes when, on every rank, the sum of the local outputs over the rank's pending-sum group
(itself alone without pending sums) equals the rank's slice of the single-device output, and has the
local shape the output spec promises. That is stricter than unsharding: replicas must agree too.
"""
from __future__ import annotations

import operator

import torch

from autopar.ir import Node, NodeRef, Role, TensorMeta
from autopar.sharding_spec import Mesh, ShardingSpec, simulator
from autopar.sharding_spec.rules import strategies_for
from autopar.sharding_spec.rules._common import localize_args
from autopar.sharding_spec.strategy import OpContext, Strategy, needs_lowering

MESHES_2D = [Mesh((2,)), Mesh((2, 2))]
MESH_3D = Mesh((2, 2, 2))
NO_VALUES = {"aten.empty.memory_format", "aten.new_empty.default", "aten.empty_like.default"}


def aten_op(target: str):
    if target == "operator.getitem":
        return operator.getitem
    _, name, overload = target.split(".")
    return getattr(getattr(torch.ops.aten, name), overload)


def meta_of(v):
    if isinstance(v, torch.Tensor):
        return TensorMeta.of(v)
    if isinstance(v, (list, tuple)):
        return tuple(TensorMeta.of(x) if isinstance(x, torch.Tensor) else None for x in v)
    return None


def _refs(value, out: list[str]):
    if isinstance(value, NodeRef):
        out.append(value.name)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _refs(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _refs(v, out)


def _subst(value, feed):
    """Replace NodeRefs, in reading order, by the next value of the iterator ``feed``."""
    if isinstance(value, NodeRef):
        return next(feed)
    if isinstance(value, list):
        return [_subst(v, feed) for v in value]
    if isinstance(value, tuple):
        return tuple(_subst(v, feed) for v in value)
    if isinstance(value, dict):
        return {k: _subst(v, feed) for k, v in value.items()}
    return value


def run(target, args, kwargs, per_input: list):
    feed = iter(per_input)
    a = _subst(tuple(args), feed)
    k = _subst(dict(kwargs), feed)
    return aten_op(target)(*a, **k)


def make_node(target: str, args: tuple, kwargs: dict | None, values: dict, name: str = "n"):
    """A Node for ``target(*args, **kwargs)`` whose NodeRefs name entries of ``values``, and the
    op's output on the full values."""
    kwargs = kwargs or {}
    inputs: list[str] = []
    _refs(tuple(args), inputs)
    _refs(kwargs, inputs)
    out = run(target, args, kwargs, [values[n] for n in inputs])
    node = Node(name=name, op="call_function", target=target, inputs=inputs, args=tuple(args), kwargs=kwargs,
                meta=meta_of(out), flops=0, role=Role.ACTIVATION, module_path="", module_type="")
    return node, out


def context(node: Node, values: dict, mesh) -> OpContext:
    return OpContext(node, mesh, [meta_of(values[n]) for n in node.inputs])


def _shard_input(value, spec: ShardingSpec | None, node: Node, mesh):
    """Per-rank local value of one input under ``spec`` (a tuple input: its getitem element)."""
    if spec is None:
        return {r: value for r in range(mesh.size)}
    if isinstance(value, (list, tuple)):
        i = node.args[1]
        parts = simulator.shard(value[i], spec, mesh, partial_split=_split_kind(value[i]))
        return {r: tuple(parts[r] if j == i else v for j, v in enumerate(value)) for r in range(mesh.size)}
    return simulator.shard(value, spec, mesh, partial_split=_split_kind(value))


def _split_kind(t: torch.Tensor) -> str:
    """Random integer parts where they add up exactly (float64, integers); float32 and narrower
    get the whole value on one rank and zeros elsewhere, which their rounding cannot blur."""
    return "first" if t.is_floating_point() and t.dtype != torch.float64 else "random"


def run_local(node: Node, strategy: Strategy, values: dict, mesh) -> dict[int, object]:
    shards = [_shard_input(values[n], s, node, mesh) for n, s in zip(node.inputs, strategy.inputs)]
    out = {}
    for r in range(mesh.size):
        args, kwargs = tuple(node.args), dict(node.kwargs)
        if isinstance(strategy.output, ShardingSpec):
            args, kwargs = localize_args(node.target, args, kwargs, strategy.output, mesh)
        out[r] = run(node.target, args, kwargs, [sh[r] for sh in shards])
    return out


def assert_shards(local: dict[int, torch.Tensor], spec: ShardingSpec, expected: torch.Tensor, mesh, *, values=True, what="", exact64=True):
    for r in range(mesh.size):
        group = mesh.group_of(r, spec.partial) if spec.partial else [r]
        assert tuple(local[r].shape) == spec.local_shape(mesh), f"{what}: rank {r} local shape {tuple(local[r].shape)} != {spec.local_shape(mesh)}"
        if not values:
            continue
        total = local[group[0]].clone()
        for g in group[1:]:
            total = total + local[g]
        want = expected[spec.local_slices(mesh, r)]
        if expected.dtype.is_floating_point:
            tol = 1e-8 if expected.dtype == torch.float64 and exact64 else 1e-5
            if total.dtype != want.dtype or not torch.allclose(total, want, rtol=tol * 100, atol=tol, equal_nan=True):
                torch.testing.assert_close(total, want, rtol=tol * 100, atol=tol, msg=lambda m: f"{what}: rank {r}: {m}")
        else:
            assert torch.equal(total, want), f"{what}: rank {r}: {total} != {want}"


def check_strategy(node: Node, strategy: Strategy, values: dict, expected, mesh) -> None:
    local = run_local(node, strategy, values, mesh)
    what = f"{node.target} {strategy} on {mesh}"
    floats = [v for n in node.inputs for v in _tensors(values[n]) if v.is_floating_point()]
    exact64 = all(v.dtype == torch.float64 for v in floats)
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    exp = expected if isinstance(expected, (tuple, list)) else (expected,)
    for j, (spec, e) in enumerate(zip(outs, exp)):
        if spec is None:
            continue
        lj = {r: (v[j] if isinstance(v, (tuple, list)) else v) for r, v in local.items()}
        assert_shards(lj, spec, e, mesh, values=node.target not in NO_VALUES, what=f"{what} output {j}", exact64=exact64)


def _tensors(v):
    return [x for x in v if isinstance(x, torch.Tensor)] if isinstance(v, (list, tuple)) else [v] if isinstance(v, torch.Tensor) else []


def check_op(target, args, kwargs=None, values=None, meshes=MESHES_2D, *, min_strategies=2, families=None):
    """Check every strategy of ``target(*args, **kwargs)`` numerically on each mesh; strategies whose
    family needs codegen lowering are skipped (tested on their own). Returns the strategies seen."""
    node, expected = make_node(target, args, kwargs, values)
    seen = []
    for mesh in meshes:
        strategies = strategies_for(context(node, values, mesh))
        assert len(strategies) >= min_strategies, f"{target} on {mesh}: {[str(s) for s in strategies]}"
        for s in strategies:
            if families is not None:
                assert all(p in families for p in s.family.parts), f"unexpected family {s.family} in {s}"
            if needs_lowering(s.family):
                continue
            check_strategy(node, s, values, expected, mesh)
        seen += strategies
    return seen


def ints(*shape, lo=-4, hi=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def rand(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + 7 * sum(shape))
    return torch.randn(shape, generator=g, dtype=dtype)
