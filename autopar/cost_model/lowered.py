"""Collectives that run inside an op: the lowered loss families (autopar/codegen/lowerings.py) talk
across ranks inside the op itself, not on a resharding edge, so their price lives here.

    loss-vocab-parallel     forward: an all-reduce (max) of one value per sample and one (sum) of
                            two values per sample over the class axes; backward: one of one value
                            per sample; a mean adds an all-reduce of the valid-target count over the
                            batch axes
    loss-batch-split(mean)  a class-index loss with its denominator unknown until run time: an
                            all-reduce of the valid-target count over the batch axes
    ring                    ring attention (codegen/ring_attention.py) over the sequence axes, n
                            ranks: forward n - 1 passes of the key/value block, each overlapped
                            with a block's attention (1 / n of the op's forward); backward n - 1
                            steps whose key/value pass and fp32 key/value-gradient pass overlap
                            a block's backward, and the last gradient pass; under a causal mask
                            the balanced cut's exchanges of the queries and the output (forward)
                            and of their gradients (backward), one pass each

A count the ranks can make from the whole user inputs (``ir.losses.counted_from_inputs``:
``counted_locally``) needs no all-reduce: the program recomputes the targets whole and counts them.
"""
from __future__ import annotations

import math

from autopar.cost_model.comm import mesh_collective_time, ring_pass_time
from autopar.record.gradients import whole_on
from autopar.sharding_spec.rules.attention import ring_axes
from autopar.sharding_spec.strategy import MEAN_SPLIT, RING_CAUSAL, VOCAB_LOSS, Family

_CLASS_LOSSES = ("cross_entropy", "nll_loss")


def lowered_comm_s(target: str, family: str, inputs, output, mesh, itemsize: int = 4, identical=(),
                   counted_locally: bool = False, compute_s: float = 0.0, value_itemsize: int = 4) -> float:
    """Seconds of the collectives ``family`` runs inside the op (forward and backward) that its
    compute does not hide; on ``identical`` gradient axes the loss gradient arrives whole and
    backward's all-reduce is not run; ``counted_locally``: a mean's denominator needs no
    all-reduce (see the module docstring). Ring attention: ``compute_s`` its compute (forward and
    backward, a third forward), ``value_itemsize`` its tensors' element size."""
    return sum(lowered_comm_parts(target, family, inputs, output, mesh, itemsize, identical, counted_locally,
                                  compute_s, value_itemsize))


def lowered_comm_parts(target: str, family: str, inputs, output, mesh, itemsize: int = 4, identical=(),
                       counted_locally: bool = False, compute_s: float = 0.0, value_itemsize: int = 4) -> tuple[float, float]:
    """``lowered_comm_s`` as (forward, backward): a recomputed forward runs the first again."""
    family = Family(family)
    forward = backward = 0.0
    ring = family.ring
    if ring is not None:
        return ring_attention_parts(inputs, output, mesh, compute_s, value_itemsize, ring == RING_CAUSAL)
    if family.has(VOCAB_LOSS) and inputs and inputs[0] is not None:
        x = inputs[0]
        cdim = 1 if x.ndim >= 2 else 0
        class_axes = tuple(x.dim_axes[cdim])
        batch_axes = tuple(a for d, ax in enumerate(x.dim_axes) if d != cdim for a in ax)
        local = x.local_shape(mesh)
        samples = math.prod(local) // max(local[cdim], 1)
        if class_axes:
            the_max = mesh_collective_time("all_reduce", samples * itemsize, mesh, class_axes)
            forward += the_max + mesh_collective_time("all_reduce", 2 * samples * itemsize, mesh, class_axes)  # sum exp, target
            if not whole_on(class_axes, identical):
                backward += the_max
        if batch_axes and not counted_locally:
            forward += mesh_collective_time("all_reduce", itemsize, mesh, batch_axes)
    elif family.has(MEAN_SPLIT) and any(k in target for k in _CLASS_LOSSES) and not counted_locally:
        out = output[0] if isinstance(output, tuple) else output
        if out is not None and out.partial:
            forward += mesh_collective_time("all_reduce", itemsize, mesh, tuple(out.partial))
    return forward, backward


def ring_attention_parts(inputs, output, mesh, compute_s: float, itemsize: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) exposed seconds of ring attention's passes (see the module docstring);
    ``inputs``: the q, k, v specs first."""
    axes = ring_axes(output)
    n = math.prod(mesh.shape[a] for a in axes)
    if n <= 1:
        return 0.0, 0.0
    q, k, v = inputs[:3]
    q_bytes, k_bytes, v_bytes = (math.prod(s.local_shape(mesh)) * itemsize for s in (q, k, v))
    out_bytes = math.prod(output.local_shape(mesh)) * itemsize
    step_f, step_b = compute_s / 3 / n, compute_s * 2 / 3 / n
    grad_bytes = (k_bytes + v_bytes) * 4 / itemsize  # fp32 sums
    forward = (n - 1) * max(0.0, ring_pass_time(k_bytes + v_bytes, mesh, axes) - step_f)
    backward = ((n - 1) * max(0.0, ring_pass_time(k_bytes + v_bytes + grad_bytes, mesh, axes) - step_b)
                + ring_pass_time(grad_bytes, mesh, axes))
    if causal:  # the balanced cut: the queries and the output there and back, and their gradients
        there_and_back = ring_pass_time(q_bytes, mesh, axes) + ring_pass_time(out_bytes, mesh, axes)
        forward += there_and_back
        backward += there_and_back
    return forward, backward
