"""Choosing between a plain one-stage plan and one with more parts (stages, microbatches,
recomputation): the simpler one unless the other is predicted faster by more than the cluster's
measured spread, said in ``explain``; a one-stage plan is never called a pipeline."""
from __future__ import annotations

import copy
import dataclasses

import pytest

import autopar
from autopar import models
from autopar.cost_model.cluster import PRESETS
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
    (0.0, 0.01, "pipeline"),   # a preset's prices are exact to the planner: strictly faster wins
    (0.0, -0.02, "one"),
    (0.05, 0.03, "one"),       # within the live profile's spread: the simpler plan
    (0.05, 0.08, "pipeline"),  # beyond it
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
        assert "within the live profile's measured spread (5.0%)" in why
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
