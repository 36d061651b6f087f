"""The schedule records against torch's own schedules: the microbatches an interleaved 1F1B stage
holds at its rank's peak, replayed from torch's order (``ScheduleInterleaved1F1B``)."""
from __future__ import annotations

import types

import pytest

from autopar.record.schedules import INTERLEAVED_1F1B, ONE_F_ONE_B, interleaved_inflight


def _torch_peak(rank: int, ranks: int, local_stages: int, count: int) -> list[int]:
    """The held microbatches per local stage when the rank's total is highest, from torch's own
    action list for the rank (its order, without stages or process groups)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    rounds = max(1, count // ranks)
    ns = types.SimpleNamespace(n_local_stages=local_stages, pp_group_size=ranks, _n_microbatches=count,
                               microbatches_per_round=count // rounds)
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, rank)
    held, best, at_best = [0] * local_stages, -1, None
    for a in actions:
        if a is None:
            continue
        local = a.stage_index // ranks
        if a.computation_type == _ComputationType.FORWARD:
            held[local] += 1
            if sum(held) > best:
                best, at_best = sum(held), list(held)
        else:
            held[local] -= 1
    assert held == [0] * local_stages
    return at_best


@pytest.mark.parametrize("ranks,local_stages,count", [(16, 2, 96), (4, 2, 8), (4, 3, 8), (2, 2, 4), (8, 4, 16),
                                                       (4, 2, 6), (3, 2, 3)])
def test_interleaved_inflight_is_torchs_order_replayed(ranks, local_stages, count):
    for rank in range(ranks):
        assert interleaved_inflight(rank, ranks, local_stages, count) == _torch_peak(rank, ranks, local_stages, count)


def test_a_stage_of_an_interleaved_pipeline_holds_its_place_among_its_ranks_stages():
    # rank 0 of 16 with 2 stages each and 96 microbatches: its first stage holds 31 (30 warm-up
    # forwards of it and the first steady one), its second 16 (hand count: rounds of 16)
    assert INTERLEAVED_1F1B.held_inflight(0, 16, 96, virtual=2) == 31
    assert INTERLEAVED_1F1B.held_inflight(16, 16, 96, virtual=2) == 16
    assert INTERLEAVED_1F1B.held_inflight(31, 16, 96, virtual=2) == 1
    # one stage per rank: the schedule's own count
    assert ONE_F_ONE_B.held_inflight(1, 4, 8) == ONE_F_ONE_B.inflight(1, 4, 8) == 3
