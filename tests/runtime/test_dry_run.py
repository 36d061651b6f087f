"""``autopar.dry_run``: sampled ranks' programs on meta tensors over a fake process group.

What a dry run reports is what a real job runs: the same plans run for real on 4 gloo ranks (the
same recorder around the same two steps, on CPU tensors) issue the same collectives per rank and
hold the same bytes. A rank whose program is altered (one collective's shape, one call missing, one
send's shape) is named with its group and call. The agreement check is tested on hand-made calls,
the sampling on a pipelined plan's stages, bad arguments by type and message.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.compose.dry_run import dry_run, run_rank, sample_ranks
from autopar.errors import ConfigError
from autopar.runtime.dry_run import Collective, ObjectCalls, Recorder, check
from autopar.runtime.launch import spawn

MODEL = dict(size="bench", layers=4)
# name -> (mesh, plan keywords): one-stage layouts with every collective kind autopar issues, a
# pipeline with sends, the default plan as a user gets it
CASES = {
    "dp2 x tp2 zero3": ((2, 2), dict(force=autopar.Layout(dp=2, tp=2, zero=3), pipeline=False)),
    "dp4 zero2": ((4,), dict(force=autopar.Layout(dp=4, zero=2), pipeline=False)),
    "pp2 x dp2 1f1b": ((4,), dict(force=autopar.Layout(dp=2), pipeline=autopar.Pipeline(stages=2, microbatches=4,
                                                                                          schedule="1f1b"))),
    # ZeRO-2's gradients add up over the microbatches in whole buckets; two stages a rank, in torch's order
    "pp2 x dp2 zero2 gpipe": ((4,), dict(force=autopar.Layout(dp=2, zero=2),
                                         pipeline=autopar.Pipeline(stages=2, microbatches=4, schedule="gpipe"))),
    "pp2 x 2 interleaved": ((4,), dict(force=autopar.Layout(dp=2), pipeline=autopar.Pipeline(
        stages=2, virtual_stages=2, microbatches=4, schedule="interleaved-1f1b"))),
    # bf16 over fp32 masters, the loss split by vocabulary (its logits upcast as autocast would)
    "tp4 bf16 vocab-parallel": ((4,), dict(force=autopar.Layout(tp=4, vocab_parallel=True), pipeline=False,
                                          precision="bf16")),
    "default": ((4,), dict()),
}


def _model():
    return models.build("gpt", device="meta", **MODEL)


@pytest.fixture(scope="module")
def plans():
    model, inputs = _model()
    return {name: autopar.plan(model, autopar.Mesh(shape), inputs, **kw) for name, (shape, kw) in CASES.items()}


def _real_rank(rank, world, plans):
    """Inside each of 4 gloo ranks: every plan's two steps under the recorder, on CPU."""
    from autopar.codegen import collectives

    out = {}
    for name, plan in plans.items():
        model, inputs = _model()
        inputs = tuple(torch.zeros(t.shape, dtype=t.dtype) for t in inputs)  # token ids a real run reads
        recorder = Recorder("cpu")
        with recorder, ObjectCalls(recorder):
            run = run_rank(plan, model, inputs, {}, recorder, device="cpu")
        out[name] = dict(collectives=run.collectives, step_from=run.step_from, ops=run.ops, held=run.held_bytes,
                         peak=run.peak_bytes, emulated=set(collectives.EMULATE))
    return out


@pytest.fixture(scope="module")
def real(plans):
    return spawn(_real_rank, 4, args=(plans,), timeout_s=600)


def _unnamed(calls):
    """Calls without their group's name (a process makes its groups' names by counting them)."""
    return [dataclasses.replace(c, group="") for c in calls]


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CASES))
def test_a_dry_run_issues_and_holds_what_a_real_gloo_run_does(name, plans, real, monkeypatch):
    from autopar.codegen import collectives

    # the same program: what gloo lacks (and autopar emulates) emulated in the dry run too
    monkeypatch.setattr(collectives, "EMULATE", set(real[0][name]["emulated"]))
    model, inputs = _model()
    result = dry_run(plans[name], model, inputs, ranks="all")
    assert result.mismatches == []
    for run in result.runs:
        mine = real[run.rank][name]
        assert _unnamed(run.collectives) == _unnamed(mine["collectives"]), f"rank {run.rank}"
        assert run.step_from == mine["step_from"]
        # the same ops but where torch's gloo reduce-scatter splits and copies in Python (the fake group's does not)
        assert abs(run.ops / mine["ops"] - 1) <= 0.01
        # host scalars (AdamW's step counts, a split output's read check) are the CPU run's alone: a few bytes
        assert abs(run.held_bytes - mine["held"]) <= 1024, f"rank {run.rank}: {run.held_bytes} vs {mine['held']}"
        # a send's buffer lives until gloo is done with it, a fake group's not a moment: the sends in
        # flight between them (interleaved: a few microbatches' activations)
        assert abs(run.peak_bytes / mine["peak"] - 1) <= 0.03, f"rank {run.rank}: {run.peak_bytes} vs {mine['peak']}"
        assert len(run.step_collectives) > 0
    assert {r.rank for r in result.runs} == {0, 1, 2, 3}


@pytest.mark.parametrize("name", list(CASES))
def test_a_dry_run_of_the_sample_passes_within_the_memory_tolerance(name, plans):
    model, inputs = _model()
    result = dry_run(plans[name], model, inputs)
    assert result.ok, result.report()
    for run in result.runs:
        assert abs(run.memory_ratio - 1) <= 0.10
        assert run.ops > 0
    text = result.report()
    assert text.splitlines()[-1] == "OK" and "every collective matched" in text


def _planted(monkeypatch, name, rank, alter):
    """``torch.distributed.<name>`` altered on ``rank`` by ``alter(call index, args) -> args or None``
    (None: the call is skipped, as a rank whose program lost it)."""
    original = getattr(dist, name)
    count = {"n": 0}

    def planted(*args, **kwargs):
        if dist.get_rank() == rank:
            count["n"] += 1
            args = alter(count["n"], args)
            if args is None:
                return None
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, name, planted)


def test_a_rank_reducing_another_shape_is_named(plans, monkeypatch):
    _planted(monkeypatch, "all_reduce", 3, lambda n, args: (args[0][:1], *args[1:]) if n == 2 else args)
    model, inputs = _model()
    result = dry_run(plans["dp2 x tp2 zero3"], model, inputs, ranks="all")
    assert not result.ok
    assert any("rank 3 issues all_reduce of float32[1" in m for m in result.mismatches), result.mismatches
    first = next(m for m in result.mismatches if "rank 3" in m)
    assert first.startswith("call ") and "on group" in first and "rank 2 issues all_reduce" in first
    assert "FAILED" in result.report()


def test_a_rank_missing_a_collective_is_named(plans, monkeypatch):
    _planted(monkeypatch, "all_reduce", 1, lambda n, args: None if n == 3 else args)
    model, inputs = _model()
    result = dry_run(plans["dp2 x tp2 zero3"], model, inputs, ranks="all")
    assert not result.ok
    # rank 1's tensor-parallel peer is rank 0: from the missing call on, their calls on the group disagree
    first = next(m for m in result.mismatches if "rank 1" in m)
    assert "ranks [0, 1]" in first and "rank 0 issues all_reduce" in first, result.mismatches


def test_a_send_of_another_shape_is_named(plans, monkeypatch):
    def shorter_first_send(n, args):
        if n > 1:
            return args
        ops = [dist.P2POp(op.op, op.tensor[..., :1].contiguous(), op.peer, op.group, op.tag) if op.op is dist.isend else op
               for op in args[0]]
        return (ops,)

    _planted(monkeypatch, "batch_isend_irecv", 0, shorter_first_send)
    model, inputs = _model()
    result = dry_run(plans["pp2 x dp2 1f1b"], model, inputs)
    assert not result.ok
    # (sends counted from the schedule's warm-up vote on: the first batch's sends are not send 0)
    said = [m for m in result.mismatches if m.startswith("send ") and "from rank 0 to rank 2" in m]
    assert said and ", 1], rank 2 receives" in said[0], result.mismatches


def _call(kind, group="g", ranks=(0, 1), shape=(4,), dtype="float32", peer=None):
    return Collective(kind, group, ranks, (shape,), (dtype,), peer)


def test_check_compares_every_group_call_by_call_and_every_send_with_its_receive():
    same = [_call("all_reduce"), _call("all_gather", shape=(2, 3))]
    assert check({0: same, 1: list(same)}) == []
    assert check({0: same}) == []  # one member sampled: nothing to compare with
    out = check({0: same, 1: [_call("all_reduce"), _call("all_gather", shape=(2, 3), dtype="bfloat16")]})
    assert out == ["call 1 on group g (ranks [0, 1]): rank 0 issues all_gather of float32[2, 3], rank 1 issues all_gather "
                   "of bfloat16[2, 3]"]
    out = check({0: same, 1: same[:1]})
    assert out and "rank 0 issues all_gather" in out[0] and "rank 1 issues nothing more" in out[0]
    swapped = check({0: same, 1: same[::-1]})
    assert swapped and swapped[0].startswith("call 0 on group g")
    send = _call("send", group="p", peer=1)
    recv = _call("recv", group="p", peer=0)
    assert check({0: [send], 1: [recv]}) == []
    assert check({0: [send], 1: [_call("recv", group="p", peer=0, shape=(5,))]}) == [
        "send 0 from rank 0 to rank 1: rank 0 sends float32[4], rank 1 receives float32[5]"]
    assert "sends 2 messages to rank 1, which receives 1" in check({0: [send, send], 1: [recv]})[0]
    # broadcasts agree on their root too
    assert check({0: [_call("broadcast", peer=0)], 1: [_call("broadcast", peer=1)]})


def test_the_sample_is_every_stages_first_and_last_rank_and_the_mesh_corners():
    model, inputs = _model()
    plan = autopar.plan(model, autopar.Mesh((4, 2)), inputs, force=autopar.Layout(dp=2, tp=2),
                        pipeline=autopar.Pipeline(stages=2, microbatches=2))
    assert [s.ranks for s in plan.pipeline.stages] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # stages: 0, 3, 4, 7; corners of 4 x 2: (0, 0) = 0, (0, 1) = 1, (3, 0) = 6, (3, 1) = 7
    assert sample_ranks(plan) == [0, 1, 3, 4, 6, 7]


def test_a_plan_whose_stages_on_one_block_view_it_differently_is_refused(plans):
    """A rank's stages run on one set of process groups: a plan file viewing a block's ranks as two
    meshes (the planner makes none: its DP picks one view per block) is refused, naming the stage."""
    model, inputs = _model()
    plan = autopar.Plan.from_json(plans["pp2 x 2 interleaved"].to_json())
    plan.pipeline.stages[2].mesh_shape = (1, 2)
    with pytest.raises(ConfigError, match=r"stage 2 views its ranks as a \(1, 2\) mesh and stage 0"):
        dry_run(plan, model, inputs, ranks=[0])


def test_bad_arguments_are_refused_by_type_and_message(plans):
    model, inputs = _model()
    plan = plans["dp4 zero2"]
    with pytest.raises(ConfigError, match=r"ranks \[4\] are not ranks of the plan's mesh of 4"):
        dry_run(plan, model, inputs, ranks=[0, 4])
    with pytest.raises(ConfigError, match="give 'all', a list of ranks"):
        dry_run(plan, model, inputs, ranks="some")
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
        dry_run(plan, model, inputs, optimizer="lion")
    other, other_inputs = models.build("gpt", device="meta", size="bench", layers=3)
    with pytest.raises(autopar.PlanError, match="this plan was made for model"):
        dry_run(plan, other, other_inputs)
    assert not dist.is_initialized()  # a failed rank leaves no fake world behind


def test_a_dry_run_inside_a_process_group_is_refused(plans):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, inputs = _model()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="needs it without a process group"):
            dry_run(plans["dp4 zero2"], model, inputs)
    finally:
        dist.destroy_process_group()
