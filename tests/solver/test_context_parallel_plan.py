"""Planning attention over a split sequence: ring attention (``rules/attention.py``'s ring families)
beside the all-to-all form (attention split by heads, the sequence exchanged for heads around it),
chosen by their prices; explain names the form."""
from __future__ import annotations

import pytest

import autopar
from autopar import models
from autopar.ir import trace



def _llama(seq: int):
    return models.build("llama", device="meta", layers=2, width=1024, heads=16, kv_heads=16, hidden=2048, seq=seq,
                        batch=1, vocab=1024)


def _attention_forms(plan) -> set[str]:
    """The forms the plan's attention ops run in."""
    fams = [n.family for n in plan.nodes.values() if "scaled_dot_product" in n.target]
    return {"ring" if f.ring else "all-to-all" if f.has("heads") else "other" for f in fams}


def _forced(model, inputs, mesh, form: str):
    """The plan with every attention op forced to ``form`` (the rest free)."""
    graph = trace(model, inputs)
    want = (lambda s: bool(s.family.ring)) if form == "ring" else \
        (lambda s: s.family.has("heads") and not s.family.ring)
    force = {n.name: want for n in graph.nodes.values() if n.target == "aten.scaled_dot_product_attention.default"}
    return autopar.plan(model, mesh, inputs, pipeline=False, force=force, idle_axes=())


@pytest.mark.parametrize("cluster,seq", [("cpu-gloo", 4096), ("a100-80g", 8192)])
def test_the_attention_form_follows_the_prices(cluster, seq):
    """Both forms fit (16 heads over 8 devices); the free plan runs the one whose plan is priced
    cheaper (alone, or beside the other where mixing them is cheaper still; explain then says how
    many ops run each). On the CPU preset the ring's point-to-point passes (gloo's latency and
    bandwidth) cost more than the all-to-alls; on A100s a long sequence hides them behind the
    blocks' attention."""
    model, inputs = _llama(seq)
    mesh = autopar.Mesh((8,), cluster=cluster)
    free = autopar.plan(model, mesh, inputs, pipeline=False, idle_axes=())
    priced = {form: _forced(model, inputs, mesh, form).predicted["step_time_s"] for form in ("ring", "all-to-all")}
    cheaper = min(priced, key=priced.get)
    forms = _attention_forms(free)
    layout = free.explain().split("\n")[2]
    assert cheaper in forms, (priced, layout)
    assert free.predicted["step_time_s"] <= priced[cheaper] * (1 + 1e-9)
    if forms == {cheaper}:
        assert f"context parallel 8 ({cheaper})" in layout
    else:  # mixed: each form with its count of attention ops
        assert "context parallel 8 (all-to-all in 1 attention op, ring in 1)" in layout, layout
    # each shape is one where its form wins (the pair covers both)
    assert cheaper == {"cpu-gloo": "all-to-all", "a100-80g": "ring"}[cluster], priced


def test_a_layout_leaves_the_axes_named_idle_to_repeat_its_work():
    """``Layout(cp=2)`` on a (2, 2) mesh with ``idle_axes=(0,)``: the ring over axis 1, axis 0 idle;
    without the idle axis the layout does not fit the mesh (a typed error naming the shape)."""
    model, inputs = models.build("llama", layers=1, width=64, heads=4, kv_heads=2, hidden=96, seq=64, batch=2, vocab=64)
    mesh = autopar.Mesh((2, 2))
    plan = autopar.plan(model, mesh, inputs, pipeline=False, force=autopar.Layout(cp=2), idle_axes=(0,))
    assert plan.idle_axes == (0,)
    rings = [n for n in plan.nodes.values() if n.family.ring]
    assert rings and all(tuple(n.output.dim_axes[2]) == (1,) for n in rings)
    with pytest.raises(autopar.ConfigError, match="needs a mesh"):
        autopar.plan(model, mesh, inputs, pipeline=False, force=autopar.Layout(cp=2))
