"""The tracing IR: ``trace(model, example_inputs)`` -> Graph of ATen ops with shapes, FLOPs,
roles, module paths, layer ids and repeated blocks. See graph.py for the data model."""
from autopar.ir.flops import FLOP_RULES, count_flops
from autopar.ir.graph import OUTSIDE, Graph, Node, NodeRef, Role, TensorMeta
from autopar.ir.trace import from_exported, trace

__all__ = ["FLOP_RULES", "OUTSIDE", "Graph", "Node", "NodeRef", "Role", "TensorMeta", "count_flops", "from_exported", "trace"]
