"""The schedule registry: every name resolves, an unknown one is refused with Pipeline's message,
and each record says what the planner and the runtime decided per schedule name before it (the
rules below are those string tests, written out as they were)."""
from __future__ import annotations

import itertools
import math

import pytest

from autopar.errors import ConfigError
from autopar.cost_model.schedules import fill_drain_time, interleaved_time, simulate_shared, step_time
from autopar.record.schedules import SCHEDULES, SEARCHED, Schedule, schedule_named

NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
CASES = [(stage, stages, count) for stages in (1, 2, 3, 4, 8) for stage in range(stages) for count in (1, 2, 3, 4, 8, 16)]


def test_every_name_resolves_to_its_record():
    assert tuple(SCHEDULES) == NAMES  # the order error messages list them in
    for name in NAMES:
        record = schedule_named(name)
        assert isinstance(record, Schedule) and record.name == name and str(record) == name
        assert schedule_named(record) is record
    assert [s.name for s in SEARCHED] == ["1f1b", "gpipe", "zero-bubble", "interleaved-1f1b"]


@pytest.mark.parametrize("name", ["round-robin", "", "GPipe", None, 3])
def test_an_unknown_name_is_refused_with_pipelines_message(name):
    with pytest.raises(ConfigError) as err:
        schedule_named(name)
    assert str(err.value) == f"Pipeline(schedule={name!r}): schedules are ['gpipe', '1f1b', 'interleaved-1f1b', 'zero-bubble']"


def _old_inflight(schedule, stage, stages, count):  # solver.pipeline.inflight_microbatches
    held = {"gpipe": count, "zero-bubble": stages}.get(schedule, stages - stage)
    return min(held, count)


_OLD_DP_INFLIGHT = {"gpipe": lambda s, b: b, "1f1b": lambda s, b: min(s, b)}  # stage_dp.SCHEDULES_INFLIGHT


@pytest.mark.parametrize("name", NAMES)
def test_inflight_counts_are_the_old_ones(name):
    record = schedule_named(name)
    for stage, stages, count in CASES:
        assert record.inflight(stage, stages, count) == _old_inflight(name, stage, stages, count)
    # what the stage DP counts for the stage s from the end: GPipe's and 1F1B's own; the search ran
    # the DP with 1F1B's for zero bubble and interleaved 1F1B
    dp_rule = _OLD_DP_INFLIGHT[name if name in _OLD_DP_INFLIGHT else "1f1b"]
    for s, count in itertools.product(range(1, 9), (1, 2, 4, 16)):
        assert record.inflight(0, s, count) == dp_rule(s, count)


def test_hand_checked_inflight_counts():
    gpipe, f1b, il, zb = (schedule_named(n) for n in NAMES)
    assert [gpipe.inflight(s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [f1b.inflight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [il.inflight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [zb.inflight(s, 4, 8) for s in range(4)] == [4, 4, 4, 4]
    assert [f1b.inflight(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [zb.inflight(s, 4, 2) for s in range(4)] == [2, 2, 2, 2]


@pytest.mark.parametrize("name", NAMES)
def test_warmups_and_count_rules_are_the_old_ones(name):
    record = schedule_named(name)
    for stage, stages, count in CASES:  # schedule_time.schedule_orders
        assert record.warmup(stage, stages, count) == (count if name == "gpipe" else min(stages - stage - 1, count))
    for ranks, count in itertools.product(range(1, 9), range(1, 33)):  # pipeline.search's filters
        if name == "1f1b":
            old = ranks <= count
        elif name == "zero-bubble":
            old = count % max(1, count // ranks) == 0
        elif name == "interleaved-1f1b":
            old = count % max(1, count // ranks) == 0 and 1 < ranks <= count
        else:
            old = True
        assert record.takes(ranks, count) == old, (ranks, count)


def test_the_facts_each_schedule_had_in_its_own_place():
    gpipe, f1b, il, zb = (schedule_named(n) for n in NAMES)
    # runtime.pipeline.MULTI_STAGE_SCHEDULES; Pipeline's virtual-stage rule; zero bubble's split
    assert [s.name for s in SCHEDULES.values() if s.multi_stage] == ["interleaved-1f1b", "zero-bubble"]
    assert [s.virtual_stages for s in (gpipe, f1b, il, zb)] == [1, 1, 2, 1]
    assert [s.stages_per_rank(None) for s in (gpipe, f1b, il, zb)] == [1, 1, 2, 1]
    assert [s.stages_per_rank(3) for s in (gpipe, f1b, il, zb)] == [1, 1, 3, 1]
    assert [s.name for s in SCHEDULES.values() if s.split_backward] == ["zero-bubble"]
    assert [s.name for s in SCHEDULES.values() if not s.recompute] == ["zero-bubble"]
    assert f1b.fallback == "gpipe" and all(s.fallback is None for s in (gpipe, il, zb))


def test_torch_runs_every_schedule_with_its_class():
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    assert {n: s.torch_class for n, s in SCHEDULES.items()} == {  # runtime.pipeline.SCHEDULE_CLASSES
        "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
        "zero-bubble": "ScheduleInterleavedZeroBubble"}
    for s in SCHEDULES.values():
        cls = getattr(pipelining, s.torch_class)
        assert issubclass(cls, PipelineScheduleMulti if s.multi_stage else PipelineScheduleSingle), s.name


def test_step_times_per_schedule():
    times = [1.0, 3.0, 2.0, 2.0]
    for name in ("gpipe", "1f1b"):
        assert step_time(name, times, 4) == fill_drain_time(times, 4) == 8.0 + 3 * 3.0
    assert step_time("interleaved-1f1b", times, 4, 2) == interleaved_time(times, 2, 2, 4)
    zb = schedule_named("zero-bubble")
    assert zb.simulated and not any(schedule_named(n).simulated for n in NAMES[:3])
    assert step_time(zb, times, 4) == simulate_shared(times, [1] * 4, 4, "zero-bubble", math.inf)
    assert step_time(zb, times, 4) < fill_drain_time(times, 4)



def test_only_a_split_backward_defers_weight_halves():
    """Zero bubble's stage s > 0 holds s weight halves back and one more between an input half and
    the weight half it frees; stage 0 runs its whole backward at once (torch's schedule)."""
    for name in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert all(schedule_named(name).deferred(s, p, c) == 0 for s, p, c in CASES), name
    zb = schedule_named("zero-bubble")
    assert [zb.deferred(s, 4, 4) for s in range(4)] == [0, 2, 3, 4]
    assert [zb.deferred(s, 4, 2) for s in range(4)] == [0, 2, 2, 2]


def test_fill_drain_with_fewer_ranks_than_stages_waits_on_the_busiest_rank():
    """A pipelined module's call runs GPipe's order, each rank its stages in turn (stage i on rank
    i mod ranks): fill and drain through every stage, then the busiest rank per microbatch."""
    times = [1.0, 2.0, 3.0, 4.0]
    assert fill_drain_time(times, 3) == 10.0 + 2 * 4.0
    assert fill_drain_time(times, 3, ranks=2) == 10.0 + 2 * (2.0 + 4.0)
    assert fill_drain_time(times, 1, ranks=2) == 10.0
