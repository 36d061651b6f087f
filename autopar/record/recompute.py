"""Recomputation: what a stage's backward runs again of its forward, read by the planner (prices
and memory), codegen's plans and the runtime (``runtime.stage_program``). No torch import.

``Recompute.FULL`` keeps only each layer's inputs and runs the layer's forward again in backward
(``torch.utils.checkpoint`` per layer). ``Recompute.SELECTIVE`` keeps, besides them, the outputs of
the ops that are dear to run again and cheap to hold (matmuls, convolutions, attention) and
recomputes the rest (norms, activations, elementwise ops, softmax, collectives): torch's selective
activation checkpointing with the ops of ``SAVED_ATEN_OPS`` saved. ``Recompute.NONE`` keeps what
autograd saves.
"""
from __future__ import annotations

import enum

from autopar.errors import ConfigError


class Recompute(enum.Enum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"

    def __bool__(self) -> bool:  # whether anything is recomputed
        return self is not Recompute.NONE

    @staticmethod
    def of(value) -> "Recompute | None":
        """``value`` as a Recompute: one, its name ("none", "full", "selective"), a bool or 0/1
        (True, 1: full), or None (left to the planner)."""
        if value is None or isinstance(value, Recompute):
            return value
        if isinstance(value, bool) or value in (0, 1, "0", "1"):
            return Recompute.FULL if value in (True, 1, "1") else Recompute.NONE
        if isinstance(value, str) and value.lower() in {r.value for r in Recompute}:
            return Recompute(value.lower())
        raise ConfigError(f"recompute={value!r}: use 'none', 'full', 'selective' (or True/False, or None to let "
                          "the planner choose)")


# The traced ops (``ir.graph.Node.target``, without the overload) whose outputs selective
# recomputation keeps: each lowers at run time to one of SAVED_ATEN_OPS.
_SAVED_TRACED = frozenset({
    "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.linear", "aten.matmul", "aten.einsum",
    "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution", "aten._convolution",
    "aten.conv_transpose1d", "aten.conv_transpose2d", "aten.conv_transpose3d", "aten._grouped_mm",
    "aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
})

# What those ops dispatch to under torch (the runtime's policy saves these ops' outputs):
# ``aten.<name>.<overload>`` names; an op the installed torch lacks is skipped.
SAVED_ATEN_OPS = (
    "mm.default", "bmm.default", "addmm.default", "baddbmm.default", "convolution.default", "_grouped_mm.default",
    "_scaled_dot_product_flash_attention.default", "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default", "_scaled_dot_product_cudnn_attention.default",
)


def attention_dropout(node) -> float:
    """The dropout probability of a traced ``aten.scaled_dot_product_attention`` node (0 for other
    ops). Attention with dropout runs torch's math path on CPU (a matmul of the scores, softmax,
    dropout, a matmul of the values), whose two matmul outputs selective recomputation keeps."""
    if not str(node.target).startswith("aten.scaled_dot_product_attention"):
        return 0.0
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else 0.0


def saved_by_selective(target: str) -> bool:
    """Whether selective recomputation keeps the output of a traced op (``"aten.mm.default"``)."""
    name = target.rsplit(".", 1)[0] if target.count(".") >= 2 else target
    return name in _SAVED_TRACED
