"""Choosing between a plain one-stage plan and one with more parts (stages, microbatches,
recomputation): the simpler one unless the other is predicted faster by more than the cluster's
measured spread, said in ``explain``; a one-stage plan is never called a pipeline."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import autopar
from autopar import models
from autopar.cluster import PRESETS
from autopar.solver.api import simpler_unless_faster
from autopar.solver.explain import layout_words


@pytest.fixture(scope="module")
def plans():
    model, inputs = models.build("gpt", layers=4)
    mesh = autopar.Mesh((4,), cluster="cpu-gloo")
    one = autopar.plan(model, mesh, inputs, pipeline=False)
    two = autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(stages=2, microbatches=2, schedule="gpipe"))
    accumulate = autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(stages=1, microbatches=4))
    return one, two, accumulate


def _with_step(plan, seconds):
    out = copy.deepcopy(plan)
    out.predicted["step_time_s"] = seconds
    return out


@pytest.mark.parametrize("spread, gain, keeps", [
    (0.0, 0.01, "pipeline"),    # a preset's prices are exact to the planner: strictly faster wins
    (0.0, -0.02, "one"),
    (0.015, 0.012, "one"),      # within the live profile's spread: the simpler plan
    (0.015, 0.018, "pipeline"),  # beyond it
    (0.05, 0.03, "one"),        # however wide the spread, the rule is the measurement's (no cap)
    (0.05, 0.06, "pipeline"),
])
def test_a_plan_with_more_parts_must_win_by_more_than_the_spread(plans, spread, gain, keeps):
    one, two, _ = plans
    mesh = autopar.Mesh((4,), cluster=dataclasses.replace(PRESETS["cpu-gloo"], measured_spread=spread))
    a, b = _with_step(one, 1.0), _with_step(two, 1.0 - gain)
    chosen = simpler_unless_faster(a, b, mesh)
    assert chosen is (b if keeps == "pipeline" else a)
    why = chosen.solver["decided"]
    assert f"{abs(gain):.1%}" in why and f"chosen: {why}" in chosen.explain()
    if keeps == "one" and gain > 0:
        assert f"within the live profile's measured spread ({spread:.1%})" in why
    if keeps == "pipeline":
        assert why.startswith("a 2-stage pipeline: predicted")


def test_gradient_accumulation_is_not_called_a_pipeline(plans):
    _, two, accumulate = plans
    assert layout_words(two).startswith("pipeline parallel 2 x ")
    words = layout_words(accumulate)
    assert "pipeline parallel" not in words and "gradient accumulation over 4 microbatches" in words
    assert "one stage: gradient accumulation over 4 microbatches" in accumulate.explain()
    assert accumulate.summary()["pp"] == 1


def test_the_default_keeps_one_stage_where_it_fits_and_is_not_slower(plans):
    one, _, _ = plans
    model, inputs = models.build("gpt", layers=4)
    default = autopar.plan(model, autopar.Mesh((4,), cluster="cpu-gloo"), inputs)
    if default.pipeline is not None:  # the search found a faster pipeline: it says by how much
        assert default.predicted["step_time_s"] < one.predicted["step_time_s"]
        assert "faster than one stage" in default.solver["decided"]
    else:
        assert default.predicted["step_time_s"] == pytest.approx(one.predicted["step_time_s"])


class _InputShapedWeight(torch.nn.Module):
    """A per-op harness's shape: a parameter the input's shape (dim 0 is not a batch of samples)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(20, 8, generator=torch.Generator().manual_seed(0)))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        h = x * self.w
        for block in self.blocks:
            h = block(h)
        return h.sum()


def _models():
    """Models users bring whose inputs may or may not split into microbatches: the per-op shape
    above, the zoo, and the fuzz's fixed draw."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import models_zoo
    from fuzz_models import build
    from test_fuzz import draw

    yield "input-shaped weight", _InputShapedWeight(), (torch.randn(20, 8),)
    for name in ("mingpt", "vit", "moe", "in_place"):
        model, inputs = getattr(models_zoo, name)()
        yield name, model, inputs
    for i, case in enumerate(draw(24)):
        model, inputs = build(case)
        yield f"fuzz {i}", model, inputs


def test_every_model_that_plans_in_one_stage_plans_by_default():
    """``pipeline="auto"`` never costs a model its plan: where a microbatch does not trace or the
    samples cannot be proven independent it keeps one microbatch, and says so once."""
    mesh = autopar.Mesh((4,), cluster="cpu-gloo")
    planned = 0
    for name, model, inputs in _models():
        try:
            autopar.plan(model, mesh, inputs, pipeline=False)
        except autopar.AutoparError:
            continue
        plan = autopar.plan(model, mesh, inputs)  # must not raise
        planned += 1
        if name == "input-shaped weight":
            notes = plan.solver["call"]["notes"]
            assert len(notes) == 1 and notes[0].startswith("one microbatch: a microbatch of the inputs does not trace")
            assert "note: one microbatch" in plan.explain()
    assert planned >= 20
