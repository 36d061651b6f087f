"""Rewrites of the exported graph that keep its values and make it easier to split.

``keep_leading_dims``: a linear reads its input's last dim only, so merging the leading dims into
rows before it and splitting them again after it changes nothing:

    reshape(x: (T, B, H, D), [T * B, H * D]) -> linear -> view(., [T, B, E])
    becomes
    reshape(x, [T, B, H * D]) -> linear -> view(., [T, B, E])   (the view now keeps the shape)

``nn.MultiheadAttention`` runs this way time-first inside (``multi_head_attention_forward``'s output
projection). Its merged rows hold the batch strided (time outer), which no sharding spec can split:
data parallelism paid an all-to-all there, and microbatches were refused. With the leading dims
kept, the batch stays a dim of its own.
"""
from __future__ import annotations

import math

import torch

_MERGES = {torch.ops.aten.reshape.default, torch.ops.aten.view.default}
_LINEAR = torch.ops.aten.linear.default


def keep_leading_dims(gm: torch.fx.GraphModule) -> int:
    """Apply the rewrite (module docstring) in place wherever every user of the merge is a linear
    whose every user restores the merged dims; returns how many merges it kept apart."""
    done = 0
    for merge in list(gm.graph.nodes):
        if merge.op != "call_function" or merge.target not in _MERGES:
            continue
        x, val = merge.args[0], merge.meta.get("val")
        if not isinstance(x, torch.fx.Node) or not isinstance(val, torch.Tensor) or val.dim() != 2:
            continue
        if not isinstance(x.meta.get("val"), torch.Tensor):
            continue
        shape = tuple(x.meta["val"].shape)
        lead = _leading(shape, val.shape[0])
        linears = list(merge.users)
        if lead is None or not linears or not all(_restored(u, merge, lead) for u in linears):
            continue
        kept = (*lead, val.shape[1])
        merge.args = (x, list(kept))
        merge.meta["val"] = x.meta["val"].reshape(kept)
        for linear in linears:
            restore = next(iter(linear.users))
            linear.meta["val"] = restore.meta["val"]  # the linear now makes the restored shape itself
        done += 1
    if done:
        gm.recompile()
    return done


def _leading(shape: tuple, rows: int) -> tuple | None:
    """The leading dims of ``shape`` (two or more) whose product is ``rows``, leaving at least one
    dim to merge into the features; None if there are none."""
    for k in range(2, len(shape)):
        if math.prod(shape[:k]) == rows:
            return shape[:k]
    return None


def _restored(linear: torch.fx.Node, merge: torch.fx.Node, lead: tuple) -> bool:
    """``linear`` reads ``merge`` as its input (not its weight), and each of its users views or
    reshapes its output back to ``lead`` plus the features."""
    if linear.target != _LINEAR or linear.args[0] is not merge or merge in linear.args[1:]:
        return False
    out = linear.meta.get("val")
    return isinstance(out, torch.Tensor) and bool(linear.users) and all(
        u.target in _MERGES and u.args[0] is linear and isinstance(u.meta.get("val"), torch.Tensor)
        and tuple(u.meta["val"].shape) == (*lead, out.shape[-1]) for u in linear.users)
