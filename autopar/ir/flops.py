"""Forward FLOPs per ATen op, from shapes alone.

One table, one line per op, keyed by the op's name without its overload ("aten.mm"); an entry
under the full name ("aten.add.Tensor") would win over it. A rule takes the TensorMetas of the
op's tensor inputs, in argument order, and its output meta. Conventions:

- matmuls count a multiply-add as 2: ``C[m, n] = A[m, k] B[k, n]`` is ``2*m*n*k`` (times batch
  dims); bias adds are ignored, so a Linear is exactly ``2*m*n*k``;
- attention is its two matmuls, ``4*B*H*L*S*E``, plus ``5*B*H*L*S`` for the softmax (no causal
  discount: kernels that skip masked blocks are a cost-model matter);
- elementwise ops are one per output element, reductions one per input element;
- softmax, norms and cross entropy are ``5 * numel``;
- views, copies, indexing, creation and embedding lookups are 0 (they move bytes, which the cost
  model prices separately);
- an op not in the table counts one per output element.
"""
from __future__ import annotations

import math
from typing import Callable

from autopar.ir.graph import Meta, TensorMeta

Rule = Callable[[list[TensorMeta], Meta], int]


def numel(meta: Meta) -> int:
    if isinstance(meta, TensorMeta):
        return meta.numel
    if isinstance(meta, tuple):
        return sum(m.numel for m in meta if m is not None)
    return 0


def _zero(ins, out) -> int:
    return 0


def _per_out(ins, out) -> int:
    return numel(out)


def _per_in(scale: int = 1) -> Rule:
    return lambda ins, out: scale * ins[0].numel


def _matmul(a: int) -> Rule:
    """2 * (output elements) * k, with k the last dim of input ``a`` (the left operand)."""
    return lambda ins, out: 2 * numel(out) * ins[a].shape[-1]


def _sdpa(ins, out) -> int:
    q, k, v = ins[:3]  # (..., L, E), (..., S, E), (..., S, Ev)
    batch, (L, E), S, Ev = math.prod(q.shape[:-2]), q.shape[-2:], k.shape[-2], v.shape[-1]
    return 2 * batch * L * S * E + 2 * batch * L * S * Ev + 5 * batch * L * S


def _conv(ins, out) -> int:
    return 2 * numel(out) * math.prod(ins[1].shape[1:])  # weight (Cout, Cin/groups, *kernel)


_VIEWS_AND_COPIES = """view _unsafe_view reshape transpose t permute expand expand_as squeeze unsqueeze
    slice select split split_with_sizes chunk unbind alias as_strided flatten unflatten narrow
    detach contiguous clone cat stack _to_copy to copy copy_ lift_fresh_copy index index_select
    gather pad constant_pad_nd repeat repeat_interleave movedim diagonal roll flip"""
_CREATION = """arange zeros zeros_like ones ones_like full full_like empty empty_like new_ones
    new_zeros new_empty new_full scalar_tensor rand randn randint rand_like randn_like
    _assert_tensor_metadata sym_size sym_numel sym_stride embedding"""
_REDUCTIONS = """sum mean amax amin max min argmax argmin var std var_mean std_mean norm
    linalg_vector_norm prod any all logsumexp cumsum cumprod"""
_FIVE_PER_ELEMENT = """softmax _softmax _safe_softmax log_softmax _log_softmax layer_norm
    native_layer_norm rms_norm group_norm native_group_norm batch_norm _native_batch_norm_legit
    _native_batch_norm_legit_no_training instance_norm cross_entropy_loss"""

FLOP_RULES: dict[str, Rule] = {
    **{f"aten.{op}": _zero for op in _VIEWS_AND_COPIES.split() + _CREATION.split()},
    **{f"aten.{op}": _per_in() for op in _REDUCTIONS.split()},
    **{f"aten.{op}": _per_in(5) for op in _FIVE_PER_ELEMENT.split()},
    "operator.getitem": _zero,
    "aten.mm": _matmul(0),
    "aten.bmm": _matmul(0),
    "aten.matmul": _matmul(0),
    "aten.linear": _matmul(0),
    "aten.addmm": _matmul(1),
    "aten.baddbmm": _matmul(1),
    "aten.scaled_dot_product_attention": _sdpa,
    "aten.conv1d": _conv,
    "aten.conv2d": _conv,
    "aten.conv3d": _conv,
    "aten.convolution": _conv,
    "aten.mse_loss": _per_in(3),
    "aten.nll_loss": _zero,
    "aten.nll_loss_nd": _zero,
}


# The ops whose FLOPs a model-FLOPs utilization counts (matmuls, attention, convolutions; as
# Megatron and torchtitan count them: not the pointwise ops, norms and reductions)
MODEL_FLOP_OPS = frozenset({"aten.mm", "aten.bmm", "aten.matmul", "aten.linear", "aten.addmm", "aten.baddbmm",
                            "aten.scaled_dot_product_attention", "aten.conv1d", "aten.conv2d", "aten.conv3d",
                            "aten.convolution"})


def counts_as_model_flops(target: str) -> bool:
    """Whether a traced op's FLOPs are model FLOPs (``MODEL_FLOP_OPS``)."""
    return target in MODEL_FLOP_OPS or target.rsplit(".", 1)[0] in MODEL_FLOP_OPS


def model_flops(graph) -> int:
    """A graph's forward FLOPs in matmuls, attention and convolutions (``MODEL_FLOP_OPS``)."""
    return sum(n.flops for n in graph.nodes.values() if n.op == "call_function" and counts_as_model_flops(n.target))


def rule_for(target: str) -> Rule:
    """The rule for ``target`` ("aten.mm.default"): by full name, then without the overload."""
    if target in FLOP_RULES:
        return FLOP_RULES[target]
    return FLOP_RULES.get(target.rsplit(".", 1)[0], _per_out)


def count_flops(target: str, ins: list[TensorMeta], out: Meta) -> int:
    """Forward FLOPs of one op; one per output element when a rule does not fit the inputs."""
    try:
        return int(rule_for(target)(ins, out))
    except (IndexError, TypeError, ValueError):
        return numel(out)
