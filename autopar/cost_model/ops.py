"""What the cost models need to know about ATen ops: which ones are views, which tensors an op
saves for its backward, which values need gradients, and local (per-device) tensor sizes.

Targets are the strings ``autopar.ir`` writes (``"aten.linear.default"``); the tables are keyed by
the op name without its overload (``"aten.linear"``), so every overload shares one entry.

Views (``VIEW_OPS``) alias their source: they cost no time and no memory. ``reshape`` and
``contiguous`` may copy in eager PyTorch; they are treated as views anyway (a copy of an activation
is rare in traced models and short-lived).
"""
from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

VIEW_OPS = frozenset(
    f"aten.{op}"
    for op in """view _unsafe_view reshape transpose t permute expand expand_as squeeze unsqueeze
    slice select split split_with_sizes chunk unbind alias as_strided flatten unflatten narrow
    detach contiguous movedim diagonal broadcast_tensors lift_fresh_copy""".split()
) | {"operator.getitem"}

# Ops whose tuple output is one view per tensor input (getitem i aliases input i).
_PER_INPUT_VIEW_OPS = frozenset({"aten.broadcast_tensors"})

# A saving rule maps (tensor-input indices needing grad, number of tensor inputs, node) to the
# tensor-input indices the op saves and whether it saves its own output. The op saves nothing
# when no input needs a gradient (there is no backward to run).
SaveRule = Callable[[set[int], int, object], tuple[set[int], bool]]


def _others(ng: set[int], n: int, node) -> tuple[set[int], bool]:
    """Bilinear ops (matmul, mul): operand i is needed for the gradient of every other operand."""
    return {i for i in range(n) if ng - {i}}, False


def _first(ng, n, node):
    """Pointwise / normalisation ops whose backward reads their input."""
    return {0}, False


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


def _embedding(ng, n, node):
    """The weight's gradient scatters by the indices (tensor input 1)."""
    return ({1} if 0 in ng and n > 1 else set()), False


def _div(ng, n, node):
    """a / b: da needs b; db needs a and b."""
    return ({1} if 0 in ng else set()) | ({0, 1} if 1 in ng else set()), False


def _dropout(ng, n, node):
    """Dropout saves a boolean mask; it is counted as the output (an over-estimate by the dtype's
    size). With p == 0 or train=False nothing is saved."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return set(), bool(train) and p != 0


def _table(rule: SaveRule, names: str) -> dict[str, SaveRule]:
    return {f"aten.{op}": rule for op in names.split()}


SAVE_RULES: dict[str, SaveRule] = {
    **_table(_others, "mm matmul bmm linear addmm baddbmm addbmm einsum mul convolution conv1d conv2d conv3d"),
    **_table(_first, """gelu silu mish layer_norm native_layer_norm rms_norm group_norm native_group_norm
        batch_norm _native_batch_norm_legit instance_norm pow log log1p sin cos abs leaky_relu elu
        hardtanh hardswish softplus amax amin max min logsumexp norm linalg_vector_norm var std where"""),
    **_table(_output, "relu sigmoid tanh softmax _softmax _safe_softmax log_softmax _log_softmax exp rsqrt sqrt reciprocal"),
    **_table(_all_inputs, """mse_loss l1_loss smooth_l1_loss huber_loss cross_entropy_loss nll_loss
        nll_loss_forward binary_cross_entropy binary_cross_entropy_with_logits kl_div"""),
    **_table(_attention, "scaled_dot_product_attention _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention"),
    **_table(_nothing, """add sub rsub neg sum mean cat stack clone _to_copy to copy repeat
        pad constant_pad_nd zeros_like ones_like full_like empty_like arange zeros ones full scalar_tensor
        masked_fill index_select gather index cumsum flip roll triu tril"""),
    "aten.embedding": _embedding,
    "aten.div": _div,
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


def save_rule(target: str) -> SaveRule:
    return SAVE_RULES.get(op_name(target), _all_inputs)


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


# ---- gradient flow ---------------------------------------------------------------------------------
_NEEDS_GRAD: "weakref.WeakKeyDictionary[object, frozenset[str]]" = weakref.WeakKeyDictionary()


def needs_grad(graph) -> frozenset[str]:
    """Names of the nodes whose value needs a gradient in backward: every floating-point parameter
    (all parameters are assumed trainable), and every floating-point value computed from one.
    User inputs, buffers and constants need none. Cached per graph (graphs are read-only)."""
    try:
        return _NEEDS_GRAD[graph]
    except (KeyError, TypeError):
        pass
    out: set[str] = set()
    for node in graph.nodes.values():
        floating = any(is_floating(m.dtype) for m in tensor_metas(node.meta))
        if node.op == "placeholder":
            if str(node.role) == "parameter" and floating:
                out.add(node.name)
        elif node.op == "call_function" and floating and any(i in out for i in node.inputs):
            out.add(node.name)
    result = frozenset(out)
    try:
        _NEEDS_GRAD[graph] = result
    except TypeError:
        pass
    return result


def tensor_inputs(node, graph) -> list[tuple[int, str]]:
    """(position in ``node.inputs``, name) of the inputs that are single tensors."""
    out = []
    for i, name in enumerate(node.inputs):
        src = graph.nodes.get(name)
        if src is not None and src.tensor_meta is not None:
            out.append((i, name))
    return out


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
