"""Attention written by hand, and causal masks built as tensors, turned into what they compute.

``fuse_attention``: the decomposed form models write by hand (minGPT, nanoGPT's slow path,
transformers' "eager" attention),

    scores = q @ k^T [* scale | / scale]  [masked_fill(m, fill) | where(m, ., fill) | + mask]
    out = dropout(softmax(scores, -1), p=0) @ v

becomes one ``aten.scaled_dot_product_attention(q, k, v, attn_mask, scale=...)``: the same values
(up to rounding), and an op the planner can split along the sequence (ring attention, the
all-to-all) and runs fused, without the (L, S) scores held for backward. The scale is a number or
a constant one-element tensor; casts to the dtype a value already has are stepped over. A boolean
mask keeps the entries ``masked_fill`` leaves alone (SDPA's mask is its negation) or those
``where`` keeps; the fill must be -inf, or at most ``FINITE_FILL`` with the mask a constant with no
row filled whole (a row filled whole with a finite value comes out uniform, with a gradient SDPA
does not give; one filled whole with -inf is NaN written out, and 0 from SDPA). An additive float mask is SDPA's own float mask where it is a constant with no row
dropped whole, for the same reason (transformers' "eager" attention adds its padding masks, built
from an input: those stay decomposed). Not fused: dropout with p > 0 in training (its random
draws would change), scores that other ops also read (attention weights returned), softmax over
another dim or into another dtype that stays.

``unexpand_kv_heads``: grouped-query attention written as key/value heads repeated before SDPA
(``repeat_kv``) passes SDPA the Hk heads with ``enable_gqa=True``: the repeated copies are neither
made nor held for backward, and what attention moves (ring blocks, all-to-alls) is Hk heads, not
Hq. Tensor parallelism over the heads then splits Hk (as Megatron requires of its query groups).

``fold_causal_masks``: an SDPA whose mask depends on no input (built from aranges, or from a
constant buffer such as minGPT's ``tril`` ``bias``) is evaluated here; if it is the causal mask
(boolean, or 0 / -inf or the dtype's lowest where additive) it becomes ``is_causal=True``, which
ring attention runs without the mask, skipping the blocks above the diagonal and balancing the
causal work. transformers builds such a mask for every causal LM called without a padding mask.
Masks larger than ``FOLD_LIMIT`` elements are left as they are (evaluating them costs memory).
"""
from __future__ import annotations

import math
import operator

import torch
from torch.export.graph_signature import InputKind

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
FOLD_LIMIT = 1 << 26  # elements of the largest tensor evaluated while folding a mask
FINITE_FILL = -1e4  # a finite masked_fill value at or below this drops its entry (exp underflows)

_MATMULS = {aten.matmul.default, aten.bmm.default}
_ASSERT = aten._assert_tensor_metadata.default
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_CASTS = {aten.to.dtype, aten._to_copy.default}


def fuse_attention(exported: torch.export.ExportedProgram) -> int:
    """Replace each decomposed attention (module docstring) by SDPA; returns how many."""
    gm = exported.graph_module
    done = 0
    for softmax in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SOFTMAX]:
        match = _match(softmax, exported)
        if match is not None:
            _replace(gm.graph, *match)
            done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def unexpand_kv_heads(exported: torch.export.ExportedProgram) -> int:
    """Give each SDPA whose key and value heads were repeated for grouped-query attention
    (``x[:, :, None].expand(B, Hk, rep, S, D).reshape(B, Hk * rep, S, D)``, transformers'
    ``repeat_kv``) the Hk heads themselves with ``enable_gqa=True``; returns how many."""
    gm = exported.graph_module
    done = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == SDPA]:
        if _arg(node, 7, "enable_gqa", False) or len(node.args) < 3:
            continue
        k, v = _repeated_heads(node.args[1]), _repeated_heads(node.args[2])
        if k is None or v is None or k[1] != v[1]:
            continue
        args = list(node.args)
        old = args[1:3]
        args[1], args[2] = k[0], v[0]
        kwargs = dict(node.kwargs)
        if len(args) > 7:
            args[7] = True
        else:
            kwargs["enable_gqa"] = True
        node.args, node.kwargs = tuple(args), kwargs
        _erase_unused(gm.graph, old)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _repeated_heads(node) -> tuple[torch.fx.Node, int] | None:
    """(x, rep) where ``node`` is x (B, Hk, S, D) with each head repeated rep times in place,
    head h of the result being head h // rep of x; None otherwise."""
    if not isinstance(node, torch.fx.Node) or node.target not in (aten.reshape.default, aten.view.default):
        return None
    expand = node.args[0]
    if not isinstance(expand, torch.fx.Node) or expand.target != aten.expand.default:
        return None
    unsq = expand.args[0]
    if not isinstance(unsq, torch.fx.Node) or unsq.target != aten.unsqueeze.default or unsq.args[1] not in (2, -3):
        return None
    x, out, big = unsq.args[0], _val(node), _val(expand)
    xv = _val(x)
    if xv is None or out is None or big is None or xv.dim() != 4 or big.dim() != 5:
        return None
    b, hk, s, d = xv.shape
    rep = big.shape[2]
    if tuple(big.shape) != (b, hk, rep, s, d) or tuple(out.shape) != (b, hk * rep, s, d) or rep < 2:
        return None
    return x, rep


def fold_causal_masks(exported: torch.export.ExportedProgram) -> int:
    """Turn each SDPA's constant causal mask into ``is_causal=True``; returns how many."""
    gm = exported.graph_module
    done, causal = 0, {}  # mask node -> whether it is causal (transformers shares one by all layers)
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == SDPA]:
        mask = _arg(node, 3, "attn_mask")
        if not isinstance(mask, torch.fx.Node) or _arg(node, 5, "is_causal", False):
            continue
        q, k = (_val(a) for a in node.args[:2])
        if q is None or k is None or q.shape[-2] != k.shape[-2]:
            continue
        if mask not in causal:
            value = _constant_value(mask, exported)
            causal[mask] = value is not None and _is_causal(value, q.shape[-2])
        if not causal[mask]:
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        if len(args) > 3:
            args[3] = None
        kwargs.pop("attn_mask", None)
        if len(args) > 5:
            args[5] = True
        else:
            kwargs["is_causal"] = True
        node.args, node.kwargs = tuple(args), kwargs
        _erase_unused(gm.graph, [mask])
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


# ---- matching ------------------------------------------------------------------------------------
def _match(softmax: torch.fx.Node, exported):
    """(q, k, k_transposed, v, mask, scale, the nodes it replaces, the output node) or None."""
    scores_in = softmax.args[0]
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    in_val = _val(scores_in)
    if in_val is None or dim not in (-1, in_val.dim() - 1) or in_val.dim() < 3:
        return None
    chain = [softmax]
    out_dtype = softmax.args[2] if softmax.target == aten.softmax.int and len(softmax.args) > 2 else None
    if softmax.target == aten._softmax.default and softmax.args[2]:  # half_to_float
        return None
    probs = _sole_user(softmax)
    if probs is not None and probs.target in _CASTS and _cast_dtype(probs) is not None:
        chain.append(probs)
        out_dtype = _cast_dtype(probs)
        probs = _sole_user(probs)
    if out_dtype is not None and out_dtype != in_val.dtype:
        return None  # the probabilities leave in another dtype than the scores came in
    if probs is not None and probs.target == aten.dropout.default:
        p, train = probs.args[1], probs.args[2] if len(probs.args) > 2 else True
        if p and train:
            return None
        chain.append(probs)
        probs = _sole_user(probs)
    if probs is None or probs.target not in _MATMULS or probs.args[0] is not chain[-1]:
        return None
    out, v = probs, probs.args[1]
    # back from the softmax input to the q @ k^T product, through casts that change nothing
    (node, reader), mask, scale = _through_casts(scores_in, softmax, chain), None, 1.0
    if _single_reader(node, reader) and node.target in _MASKS and not node.kwargs:
        mask = _mask_of(node, exported)
        if mask is None:
            return None
        chain.append(node)
        node, reader = _through_casts(_MASKS[node.target](node), node, chain)
    if _single_reader(node, reader) and node.target in (aten.mul.Tensor, aten.div.Tensor):
        c = _scalar(node.args[1], exported)
        if not c:
            return None
        scale = c if node.target == aten.mul.Tensor else 1.0 / c
        chain.append(node)
        node, reader = _through_casts(node.args[0], node, chain)
    if not _single_reader(node, reader) or node.target not in _MATMULS:
        return None
    chain.append(node)
    q, kt = node.args[0], node.args[1]
    qv, ktv, vv = _val(q), _val(kt), _val(v)
    if None in (qv, ktv, vv) or not (qv.dim() == ktv.dim() == vv.dim() == in_val.dim()):
        return None
    if qv.shape[:-2] != ktv.shape[:-2] or qv.shape[:-2] != vv.shape[:-2] or qv.shape[-1] != ktv.shape[-2]:
        return None
    if ktv.shape[-1] != vv.shape[-2] or len({qv.dtype, ktv.dtype, vv.dtype}) != 1 or qv.dtype != in_val.dtype:
        return None
    k = kt.args[0] if _swaps_last_two(kt) else None
    return q, k, kt, v, mask, scale, chain, out


# ops that mask the scores -> the scores they read
_MASKS = {
    aten.masked_fill.Scalar: lambda n: n.args[0],
    aten.add.Tensor: lambda n: n.args[0],
    aten.where.self: lambda n: n.args[1],
    aten.where.ScalarOther: lambda n: n.args[1],
}


def _mask_of(node: torch.fx.Node, exported):
    """The SDPA mask of an op masking the scores: ("drop", a boolean mask to negate: masked_fill),
    ("keep", a boolean mask as it is: where), ("add", a float mask), or None where SDPA would
    compute something else."""
    scores = _MASKS[node.target](node)
    other = node.args[0] if node.target in (aten.where.self, aten.where.ScalarOther) else node.args[1]
    if not isinstance(other, torch.fx.Node) or _val(other) is None or _val(scores) is None:
        return None
    ov, sv = _val(other), _val(scores)
    try:
        if torch.broadcast_shapes(ov.shape, sv.shape) != sv.shape:
            return None
    except RuntimeError:
        return None
    if node.target == aten.add.Tensor:
        if ov.dtype != sv.dtype or ov.dim() > sv.dim():
            return None
        value = _constant_value(other, exported)  # exact only where no row is dropped whole (below)
        return ("add", other) if value is not None and _every_row_kept(value > torch.finfo(ov.dtype).min / 2) else None
    if ov.dtype != torch.bool:
        return None
    kind = "drop" if node.target == aten.masked_fill.Scalar else "keep"
    fill = _scalar(node.args[2], exported)
    if fill is None or fill > FINITE_FILL:
        return None
    if fill == -math.inf:
        return (kind, other)
    value = _constant_value(other, exported)
    return (kind, other) if value is not None and _every_row_kept(~value if kind == "drop" else value) else None


def _every_row_kept(keep: torch.Tensor) -> bool:
    """Whether every query row keeps a key. A row masked whole by a finite fill or an additive
    lowest value comes out uniform (the scores are absorbed) with a gradient SDPA does not give."""
    return bool(keep.any(dim=-1).all())


def _replace(graph: torch.fx.Graph, q, k, kt, v, mask, scale, chain, out) -> None:
    with graph.inserting_before(out):
        if k is None:
            k = graph.call_function(aten.transpose.int, (kt, -2, -1))
            k.meta.update(kt.meta, val=_val(kt).transpose(-2, -1))
        attn_mask = None
        if mask is not None:
            kind, m = mask
            attn_mask = m
            if kind == "drop":
                attn_mask = graph.call_function(aten.logical_not.default, (m,))
                attn_mask.meta.update(m.meta, val=torch.logical_not(_val(m)))
        kwargs = {"attn_mask": attn_mask, "scale": scale} if attn_mask is not None else {"scale": scale}
        sdpa = graph.call_function(SDPA, (q, k, v), kwargs)
        sdpa.meta.update(out.meta)
    out.replace_all_uses_with(sdpa)
    _erase_unused(graph, [kt], consumed=[out, *chain])


def _constant_value(node: torch.fx.Node, exported, buffers: bool = True) -> torch.Tensor | None:
    """``node``'s value if it depends on no input and no random draw (constants, unmutated buffers
    unless ``buffers`` is False, factory ops), evaluated here; None otherwise or where a tensor on
    the way exceeds FOLD_LIMIT."""
    sig = exported.graph_signature
    kinds = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
    mutated = set(sig.buffers_to_mutate.values())
    order, seen, stack = [], set(), [node]
    while stack:  # the node's ancestors, checked on the way
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        val = _val(n)
        if val is not None and (val.numel() > FOLD_LIMIT or val.device.type == "meta"):
            return None
        if n.op == "placeholder":
            spec = kinds.get(n.name)
            kinds_ok = (InputKind.BUFFER, InputKind.CONSTANT_TENSOR) if buffers else (InputKind.CONSTANT_TENSOR,)
            if spec is None or spec.kind not in kinds_ok or spec.target in mutated:
                return None
        elif n.op == "get_attr":
            pass
        elif n.op != "call_function" or not _pure(n.target):
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    env: dict[torch.fx.Node, object] = {}
    for n in sorted(order, key=_position(node.graph)):
        if n.op == "placeholder":
            spec = kinds[n.name]
            value = exported.constants.get(spec.target, exported.state_dict.get(spec.target))
        elif n.op == "get_attr":
            value = getattr(exported.graph_module, n.target)
        else:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            value = n.target(*args, **kwargs)
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            return None
        env[n] = value.detach() if isinstance(value, torch.Tensor) else value
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None


def _is_causal(mask: torch.Tensor, length: int) -> bool:
    """Whether ``mask`` (boolean keep-mask, or additive float) is the causal mask of a square
    (length, length) attention in every leading slice."""
    if mask.shape[-2:] != (length, length):
        return False
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        dropped = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((dropped | (mask == 0)).all()):
            return False  # a bias (ALiBi, relative positions), not only a mask
        keep = ~dropped
    else:
        return False
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return bool((keep == causal).all())


# ---- small helpers -------------------------------------------------------------------------------
def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _arg(node: torch.fx.Node, pos: int, name: str, default=None):
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _scalar(x, exported) -> float | None:
    """A number, or the value of a constant one-element tensor node (``torch.full([], c)``; not a
    buffer, which a user may load or schedule: a scale read from one stays decomposed)."""
    if _number(x):
        return float(x)
    val = _val(x)
    if val is None or val.numel() != 1:
        return None
    value = _constant_value(x, exported, buffers=False)
    return None if value is None else float(value.reshape(()))


def _through_casts(node, reader, chain: list) -> tuple:
    """(node, its reader) after stepping up through casts to the dtype they read (added to ``chain``)."""
    while (_single_reader(node, reader) and node.target in _CASTS and _val(node) is not None
           and _val(node.args[0]) is not None and _cast_dtype(node) == _val(node.args[0]).dtype == _val(node).dtype):
        chain.append(node)
        node, reader = node.args[0], node
    return node, reader


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of ``node`` other than torch.export's dtype/device asserts."""
    return [u for u in node.users if u.target != _ASSERT]


def _sole_user(node: torch.fx.Node) -> torch.fx.Node | None:
    readers = _readers(node)
    return readers[0] if len(readers) == 1 else None


def _single_reader(node, reader) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and _readers(node) == [reader]


def _cast_dtype(node: torch.fx.Node):
    """The dtype a cast node casts to, if it changes nothing else (no device or layout change)."""
    if node.target == aten.to.dtype:
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    if node.target == aten._to_copy.default and set(node.kwargs) <= {"dtype"}:
        return node.kwargs.get("dtype")
    return None


def _swaps_last_two(node: torch.fx.Node) -> bool:
    val = _val(node)
    if val is None or node.op != "call_function":
        return False
    nd = val.dim()
    if node.target == aten.transpose.int:
        return {d % nd for d in node.args[1:3]} == {nd - 2, nd - 1}
    if node.target == aten.permute.default:
        return [d % nd for d in node.args[1]] == [*range(nd - 2), nd - 1, nd - 2]
    return False


def _pure(target) -> bool:
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable


def _position(graph: torch.fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _erase_unused(graph: torch.fx.Graph, nodes, consumed=()) -> None:
    """Erase the ``consumed`` nodes (their readers replaced) and, going up from them and from
    ``nodes``, every pure op left read by nothing but asserts; placeholders stay."""
    consumed = list(consumed)
    stack = [n for n in nodes if isinstance(n, torch.fx.Node)]
    while consumed:  # readers first: a node goes once nothing but asserts reads it
        n = next(n for n in consumed if not _readers(n))
        consumed.remove(n)
        stack.extend(_drop(graph, n))
    while stack:
        n = stack.pop()
        if n._erased or n.op != "call_function" or _readers(n) or n.target == _ASSERT or not _pure(n.target):
            continue
        stack.extend(_drop(graph, n))


def _drop(graph: torch.fx.Graph, node: torch.fx.Node) -> list[torch.fx.Node]:
    """Erase ``node`` and its asserts; returns its inputs."""
    inputs = node.all_input_nodes
    for a in list(node.users):
        graph.erase_node(a)
    graph.erase_node(node)
    return inputs
