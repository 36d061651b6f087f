"""What the cost models need to know about ATen ops: which ones are views, which tensors an op
saves for its backward, which values need gradients, and local (per-device) tensor sizes.

Targets are the strings ``autopar.ir`` writes (``"aten.linear.default"``); the tables are keyed by
the op name without its overload (``"aten.linear"``), so every overload shares one entry.

Views (``VIEW_OPS``) alias their source: they cost no time and no memory. ``reshape`` and
``contiguous`` may copy in eager PyTorch; they are treated as views anyway (a copy of an activation
is rare in traced models and short-lived).
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from autopar.ir.graph import NodeRef, per_graph

VIEW_OPS = frozenset(
    f"aten.{op}"
    for op in """view _unsafe_view reshape transpose t permute expand expand_as squeeze unsqueeze
    slice select split split_with_sizes chunk unbind alias as_strided flatten unflatten narrow
    detach detach_ contiguous movedim diagonal broadcast_tensors lift_fresh_copy""".split()
) | {"operator.getitem"}

# Ops whose tuple output is one view per tensor input (getitem i aliases input i).
_PER_INPUT_VIEW_OPS = frozenset({"aten.broadcast_tensors"})

# A saving rule maps (tensor-input indices needing grad, number of tensor inputs, node) to the
# tensor-input indices the op saves and whether it saves its own output. Indices count only the
# node's *tensor* inputs: a Python scalar in an operand's place (``x / 2.0``, ``2 ** x``,
# ``where(c, x, 0.0)``) is no input, so a rule must find its operands by name (``operands``),
# never by position. The op saves nothing when no input needs a gradient (there is no backward).
SaveRule = Callable[[set[int], int, object], tuple[set[int], bool]]


@functools.lru_cache(maxsize=None)
def _schema(target: str):
    """(argument names, names of the Tensor-typed arguments) of an ATen overload, None otherwise."""
    parts = target.split(".")
    if parts[0] != "aten" or len(parts) != 3:
        return None
    try:
        schema = getattr(getattr(torch.ops.aten, parts[1]), parts[2])._schema
    except AttributeError:
        return None
    names = tuple(a.name for a in schema.arguments)
    tensors = frozenset(a.name for a in schema.arguments if "Tensor" in str(a.type))
    return names, tensors


def operands(node, n: int) -> dict[str, list[int]] | None:
    """Which tensor inputs each schema argument of ``node`` holds, as indices among its ``n``
    tensor inputs: ``div.Tensor(a, b)`` -> {"self": [0], "other": [1]}, ``div.Tensor(a, 2.0)`` ->
    {"self": [0]}, ``pow.Scalar(2, x)`` -> {"exponent": [0]}. None when that cannot be told (not an
    ATen overload, or a reference that is not a single tensor)."""
    schema = _schema(str(node.target))
    if schema is None:
        return None
    names = schema[0]
    out: dict[str, list[int]] = {}
    count = 0

    def walk(value, name):
        nonlocal count
        if isinstance(value, NodeRef):
            out.setdefault(name, []).append(count)
            count += 1
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, name)

    for i, a in enumerate(node.args):
        walk(a, names[i] if i < len(names) else f"#{i}")
    for k, v in node.kwargs.items():
        walk(v, k)
    return out if count == n else None


def _reads(**formulas: str) -> SaveRule:
    """A rule written the way torch's derivatives.yaml is: for each differentiable operand (schema
    name), the values its gradient formula reads ("result": the op's output). As torch's autograd
    codegen does, a value read by the formulas of several Tensor operands of the overload is saved
    whenever there is a backward, one read by a single formula only when that operand needs a
    gradient, and the output whenever a formula reads it. A name bound to a Python scalar
    (``x / 2.0``'s ``other``) is no tensor input and saves nothing."""
    table = {op: frozenset(reads.split()) for op, reads in formulas.items()}

    def rule(ng, n, node):
        ops = operands(node, n)
        schema = _schema(str(node.target))
        if ops is None or schema is None:
            return _all_inputs(ng, n, node)
        live = {op: reads for op, reads in table.items() if op in schema[1]}  # this overload's formulas
        grad_ops = {name for name, ks in ops.items() if ng & set(ks)}
        if grad_ops - set(live):  # an operand needing a gradient that the table does not know
            return _all_inputs(ng, n, node)
        saved: set[int] = set()
        for value in {v for reads in live.values() for v in reads} - {"result"}:
            users = {op for op, reads in live.items() if value in reads}
            if len(users) > 1 or users & grad_ops:
                saved.update(ops.get(value, ()))
        return saved, any("result" in reads for reads in live.values())

    rule.__doc__ = f"derivatives: {formulas}"
    return rule


def _others(ng: set[int], n: int, node) -> tuple[set[int], bool]:
    """Bilinear ops (matmul, mul): operand i is needed for the gradient of every other operand.
    A scalar factor (``x * 2.0``) is no tensor input, so ``x`` alone saves nothing."""
    return {i for i in range(n) if ng - {i}}, False


def _first(ng, n, node):
    """Pointwise / normalisation ops whose backward reads their input (always tensor input 0:
    these ops take no scalar in place of it)."""
    return {0}, False


def _first_and_output(ng, n, node):
    """Reductions whose backward reads their input and their (small) result: amax, logsumexp, norm."""
    return {0}, True


def _output(ng, n, node):
    """Ops whose backward reads their result (relu, sigmoid, softmax, exp, ...)."""
    return set(), True


def _all_inputs(ng, n, node):
    """Losses and attention: the backward reads every tensor input."""
    return set(range(n)), False


def _attention(ng, n, node):
    """SDPA saves q, k, v (and the attn mask) and its output (logsumexp is small and ignored)."""
    return set(range(n)), True


def _nothing(ng, n, node):
    return set(), False


def _dropout(ng, n, node):
    """Dropout saves a boolean mask; it is counted as the output (an over-estimate by the dtype's
    size). With p == 0 or train=False nothing is saved."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return set(), bool(train) and p != 0


def _table(rule: SaveRule, names: str) -> dict[str, SaveRule]:
    return {f"aten.{op}": rule for op in names.split()}


_DIV = _reads(self="other", other="self other")  # also Tensor_mode: torch saves the same
_BOTH = _reads(self="self other", other="self other")

SAVE_RULES: dict[str, SaveRule] = {
    **_table(_others, "mm matmul bmm einsum mul"),
    **_table(_first, """gelu silu mish layer_norm native_layer_norm rms_norm group_norm native_group_norm
        batch_norm _native_batch_norm_legit instance_norm log log1p sin cos abs leaky_relu elu
        hardtanh hardswish softplus var square nan_to_num"""),
    **_table(_first_and_output, "amax amin logsumexp norm linalg_vector_norm std max.default min.default"),
    **_table(_output, """relu sigmoid tanh softmax _softmax _safe_softmax log_softmax _log_softmax exp rsqrt
        sqrt reciprocal max.dim min.dim"""),
    **_table(_all_inputs, """mse_loss l1_loss smooth_l1_loss huber_loss cross_entropy_loss nll_loss
        nll_loss_forward binary_cross_entropy binary_cross_entropy_with_logits kl_div"""),
    **_table(_attention, "scaled_dot_product_attention _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention"),
    **_table(_nothing, """add sub rsub neg sum mean cat stack clone _to_copy to copy repeat
        pad constant_pad_nd zeros_like ones_like full_like empty_like arange zeros ones full scalar_tensor
        cumsum flip roll triu tril floor_divide sign sgn floor ceil round trunc fill"""),
    # Operands found by name, so a Python scalar in any operand's place is handled.
    **_table(_DIV, "div true_divide"),
    **_table(_BOTH, "maximum minimum fmax fmin atan2 xlogy max.other min.other"),
    "aten.pow": _reads(self="self exponent", exponent="self exponent result"),
    "aten.fmod": _reads(self="", other="self other"),
    "aten.remainder": _reads(self="", other="self other"),
    "aten.remainder.Scalar_Tensor": _nothing,  # 2.0 % x: torch saves nothing
    "aten.copysign": _reads(self="self result", other=""),
    "aten.hypot": _reads(self="self result", other="other result"),
    "aten.clamp": _reads(self="self min max", min="self min max", max="self min max"),
    "aten.clamp_min": _reads(self="self min", min="self min"),
    "aten.clamp_max": _reads(self="self max", max="self max"),
    "aten.lerp": _reads(self="weight", end="weight", weight="self end weight"),
    "aten.addcmul": _reads(self="", tensor1="tensor2", tensor2="tensor1"),
    "aten.addcdiv": _reads(self="", tensor1="tensor2", tensor2="tensor1 tensor2"),
    "aten.where": _reads(self="condition", other="condition"),
    "aten.masked_fill": _reads(self="mask", value="mask"),
    "aten.gather": _reads(self="self index"),
    "aten.index_select": _reads(self="index"),
    "aten.index": _reads(self="indices"),
    "aten.embedding": _reads(weight="indices"),
    "aten.linear": _reads(input="weight", weight="input", bias=""),
    **_table(_reads(self="", mat1="mat2", mat2="mat1"), "addmm"),
    **_table(_reads(self="", batch1="batch2", batch2="batch1"), "baddbmm addbmm"),
    **_table(_reads(input="input weight", weight="input weight", bias="input weight"),
             "convolution conv1d conv2d conv3d"),
    "aten.dropout": _dropout,
    "aten.native_dropout": _dropout,
}
"""Ops not listed save every tensor input when any input needs a gradient (conservative)."""


def op_name(target: str) -> str:
    """``"aten.linear.default"`` -> ``"aten.linear"``; other strings pass through."""
    parts = target.split(".")
    return ".".join(parts[:2]) if parts[0] == "aten" and len(parts) > 2 else target


def is_view(target: str) -> bool:
    return op_name(target) in VIEW_OPS


# Ops that allocate more than their output while they run, as multiples of an input's bytes: the
# fused cross entropy computes log-probabilities as large as its logits (kept for backward in
# their place while the logits still live).
WORKSPACE_RULES: dict[str, tuple[int, float]] = {"aten.cross_entropy_loss": (0, 1.0)}
# The same for an op's backward, beside the gradients it makes: ATen's cross entropy makes the
# log-probabilities' gradient before the logits' (autopar's fused one neither: memory.step_peak).
BACKWARD_WORKSPACE_RULES: dict[str, tuple[int, float]] = {"aten.cross_entropy_loss": (0, 1.0)}


def workspace_bytes(node, in_metas, in_specs, mesh, rules=WORKSPACE_RULES) -> int:
    """Bytes ``node`` allocates beside its output while it runs (``rules``: ``WORKSPACE_RULES``, or
    ``BACKWARD_WORKSPACE_RULES`` for its backward), its inputs as the strategy reads them
    (``in_specs``: one spec or None per input)."""
    rule = rules.get(op_name(node.target)) if node.op == "call_function" else None
    if rule is None:
        return 0
    k, factor = rule
    if k >= len(in_metas) or in_metas[k] is None or isinstance(in_metas[k], tuple):
        return 0
    spec = in_specs[k] if k < len(in_specs) else None
    return int(factor * local_nbytes(in_metas[k], spec, mesh))


def save_rule(target: str) -> SaveRule:
    """The rule for ``target``: its own overload's entry (``aten.max.dim``) before its op's."""
    parts = target.split(".")
    exact = ".".join(parts[:3]) if parts[0] == "aten" and len(parts) > 2 else None
    return SAVE_RULES.get(exact) or SAVE_RULES.get(op_name(target), _all_inputs)


# ---- dtypes and local sizes ----------------------------------------------------------------------
def itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def is_floating(dtype: str) -> bool:
    return getattr(torch, dtype).is_floating_point


def local_numel(shape, spec, mesh) -> int:
    """Elements of one device's shard (the whole tensor when ``spec`` is None)."""
    return math.prod(shape if spec is None else spec.local_shape(mesh))


def local_nbytes(meta, spec, mesh) -> int:
    """Bytes one device holds of a value: a TensorMeta with its spec, or a tuple of metas with a
    tuple of specs (or None: replicated)."""
    if meta is None:
        return 0
    if isinstance(meta, tuple):
        specs = spec if isinstance(spec, tuple) else (None,) * len(meta)
        return sum(local_nbytes(m, s, mesh) for m, s in zip(meta, specs))
    if isinstance(spec, tuple):  # a single tensor described by a 1-tuple of specs
        spec = spec[0] if spec else None
    return local_numel(meta.shape, spec, mesh) * itemsize(meta.dtype)


def tensor_metas(meta) -> list:
    """The TensorMetas inside a node's meta (one, several or none)."""
    if meta is None:
        return []
    if isinstance(meta, tuple):
        return [m for m in meta if m is not None]
    return [meta]


def tensor_inputs(node, graph) -> list[tuple[int, str]]:
    """(position in ``node.inputs``, name) of the inputs that are single tensors."""
    out = []
    for i, name in enumerate(node.inputs):
        src = graph.nodes.get(name)
        if src is not None and src.tensor_meta is not None:
            out.append((i, name))
    return out


@per_graph
def alias_roots(graph) -> dict[str, frozenset[str]]:
    """For every node, the storage-owning nodes its value aliases: itself for ops that allocate,
    its source's roots for views. A getitem of a multi-output op aliases the whole op (the op's
    outputs live and die together, an over-estimate when only some are read)."""
    roots: dict[str, frozenset[str]] = {}
    for node in graph.nodes.values():
        if node.op != "call_function" or not is_view(node.target):
            roots[node.name] = frozenset({node.name})
            continue
        srcs = [n for n in node.inputs if n in roots]
        if not srcs:
            roots[node.name] = frozenset({node.name})
            continue
        if node.target == "operator.getitem":
            src = graph.nodes[srcs[0]]
            idx = node.args[1] if len(node.args) > 1 else None
            if op_name(src.target) in _PER_INPUT_VIEW_OPS and isinstance(idx, int) and idx < len(src.inputs):
                roots[node.name] = roots[src.inputs[idx]]
            else:
                roots[node.name] = roots[srcs[0]]
        elif op_name(node.target) in _PER_INPUT_VIEW_OPS:
            roots[node.name] = frozenset().union(*(roots[s] for s in srcs))
        else:
            roots[node.name] = roots[srcs[0]]
    return roots
