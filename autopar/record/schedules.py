"""Pipeline schedules: one record per schedule, what the planner, codegen and runtime read of it.

A ``Schedule`` holds what is decided per schedule: the torch class that runs it
(``torch.distributed.pipelining``) and whether that class takes a list of stages, the stages per
rank, whether the backward splits into an input and a weight half (and so whether recomputation is
allowed), the microbatches a stage holds in flight, the microbatch counts torch's class takes and
each stage's task order (``schedule_orders``). Its step is priced by ``autopar.cost_model.schedules``
(a formula, or an event simulation of the task order, named by ``Schedule.timing``).

Plans store a schedule's name; ``schedule_named`` finds its record. No torch import.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from autopar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One pipeline schedule. The functions take a stage's place ``stage`` (0 first) among
    ``stages`` stages (one per rank, or per block of ranks) and the microbatch ``count``."""

    name: str
    torch_class: str  # the class in torch.distributed.pipelining that runs it
    multi_stage: bool  # torch's class takes the list of a rank's stages (else the one stage)
    virtual_stages: int  # stages per rank unless given; > 1: it interleaves (and takes any count > 1)
    split_backward: bool  # each backward is an input half and a deferred weight half (zero bubble)
    # forwards a stage runs before its first backward
    warmup: Callable[[int, int, int], int] = dataclasses.field(repr=False)
    # microbatches whose activations a stage holds at its peak
    inflight: Callable[[int, int, int], int] = dataclasses.field(repr=False)
    # (ranks, count) -> whether torch's class runs ``count`` microbatches over ``ranks`` ranks
    takes: Callable[[int, int], bool] = dataclasses.field(repr=False)
    # how its step is priced (``autopar.cost_model.schedules.step_time``): "fill-drain" (a formula),
    # "interleaved" (a formula) or "simulated" (the event simulation of its task order)
    timing: str
    fallback: str | None = None  # what the runtime runs where torch's class does not take the count

    def deferred(self, stage: int, stages: int, count: int) -> int:
        """Microbatches whose weight half a stage holds back at its peak, each keeping its
        activations and the gradients the weight half reads (torch's input half runs with
        ``retain_graph``): none unless the backward splits; under zero bubble stage s > 0 defers s
        and holds one more between an input half and the weight half it frees (torch runs stage
        0's whole backward at once)."""
        if not self.split_backward or stage == 0:
            return 0
        return min(stage + 1, count)

    def held_inflight(self, stage: int, stages: int, count: int, virtual: int = 1) -> int:
        """Microbatches whose activations stage ``stage`` (in pipeline order, of ``stages * virtual``:
        stage s runs on the block s mod ``stages``) holds at its rank's peak: ``inflight`` with one
        stage per rank; interleaved, the count of ``interleaved_inflight`` for the stage's place
        among its rank's stages."""
        if virtual == 1 or not self.interleaved:
            return self.inflight(stage % stages, stages, count)
        return interleaved_inflight(stage % stages, stages, virtual, count)[stage // stages]

    def forwards_first(self, stage: int, stages: int, count: int, virtual: int = 1) -> bool:
        """Whether the rank of stage ``stage`` (in pipeline order, of ``stages * virtual``) holds
        its peak before any backward: its only stage runs all ``count`` forwards first (GPipe, or
        no more microbatches than 1F1B's warm-up holds). Otherwise a later forward reaches the
        same peak after a backward, beside what that backward left (ZeRO-2's accumulating buckets:
        ``cost_model.memory.accumulation_overlap``)."""
        return virtual == 1 and self.held_inflight(stage, stages, count) >= count

    def __str__(self) -> str:
        return self.name

    @property
    def interleaved(self) -> bool:
        """Whether it runs several stages per rank."""
        return self.virtual_stages > 1

    @property
    def overlaps_sync(self) -> bool:
        """Whether a stage's gradient sync starts in its last microbatch's backward, beside it
        (``runtime.pipeline``: one stage per rank under GPipe and 1F1B), rather than after the
        schedule."""
        return not self.multi_stage

    @property
    def simulated(self) -> bool:
        """Whether its step is the event simulation of its task order (no formula gives it)."""
        return self.timing == "simulated"

    @property
    def recompute(self) -> bool:
        """Whether a stage may recompute its activations: not under a split backward, whose weight
        half is one autograd call per group of weights (a recomputed layer would run its forward
        again in each)."""
        return not self.split_backward

    def stages_per_rank(self, given: int | None) -> int:
        """The stages each rank runs: ``given`` (``Pipeline.virtual_stages``) or this schedule's
        default where it interleaves; one otherwise."""
        return (given or self.virtual_stages) if self.interleaved else 1


# ---- task orders ----------------------------------------------------------------------------------
def schedule_orders(p: int, count: int, schedule) -> list[list[tuple[str, int]]]:
    """Each stage's tasks in the order torch's schedule runs them (one stage per rank): ("F", k)
    forward of microbatch k, ("B", k) its backward (under a split backward: the input-gradient half),
    ("W", k) the weight-gradient half (split backward only). Each stage runs its warm-up forwards
    (``Schedule.warmup``: GPipe every one, 1F1B ``p - s - 1`` on stage s), then one forward and one
    backward in turn, then the remaining backwards. Zero bubble (ZB-H1, torch's
    ``ScheduleInterleavedZeroBubble`` with one stage per rank): 1F1B's order, each backward
    followed by a weight half once stage s has ``s`` weight halves deferred; the deferred ones run
    at the end, in the drain the other stages leave."""
    schedule = schedule_named(schedule)
    orders = []
    for st in range(p):
        warm = schedule.warmup(st, p, count)
        order = [("F", k) for k in range(warm)]
        backwards = 0
        weights = 0

        def backward(k):
            nonlocal backwards, weights
            order.append(("B", k))
            if schedule.split_backward and backwards >= st:
                order.append(("W", weights))
                weights += 1
            backwards += 1

        for k in range(count - warm):
            order.append(("F", warm + k))
            backward(k)
        for k in range(count - warm, count):
            backward(k)
        if schedule.split_backward:
            order += [("W", k) for k in range(weights, count)]
        orders.append(order)
    return orders


def interleaved_inflight(rank: int, ranks: int, local_stages: int, count: int) -> list[int]:
    """Under torch's interleaved 1F1B (``ScheduleInterleaved1F1B``, torch 2.13), the microbatches
    each of ``rank``'s ``local_stages`` stages holds (forward run, backward not yet) at the moment the
    rank holds the most: its order replayed. Microbatches go in rounds of ``count / rounds``
    (``rounds = max(1, count // ranks)``), forwards cycling over the local stages round by round;
    ``(local_stages - 1) * per_round + 2 * (ranks - 1 - rank)`` warm-up forwards, then a forward
    and a backward (last local stage first) each step. Rank 0 of 16 with 2 stages and 96
    microbatches: 31 and 16 (a one-stage-per-rank 1F1B count would say 16 and 16)."""
    rounds = max(1, count // ranks)
    per_round = count // rounds
    total = count * local_stages
    warmup = min((local_stages - 1) * per_round + 2 * (ranks - 1 - rank), total)
    held = [0] * local_stages
    best, at_best = -1, list(held)

    def note():
        nonlocal best, at_best
        if sum(held) > best:
            best, at_best = sum(held), list(held)

    for op in range(total + warmup):  # torch's steps: a forward (all but the cool-down), then a backward (past the warm-up)
        if op < total:
            held[(op // per_round) % local_stages] += 1
            note()
        if op >= warmup:
            held[local_stages - 1 - ((op - warmup) // per_round) % local_stages] -= 1
    return at_best


# ---- the registry ------------------------------------------------------------------------------------
def _warmup_all(stage, stages, count):  # every forward first
    return count


def _warmup_1f1b(stage, stages, count):  # until its first microbatch's backward can start
    return min(stages - stage - 1, count)


def _inflight_all(stage, stages, count):
    return count


def _inflight_1f1b(stage, stages, count):  # what its warm-up forwards start, and the one in turn
    return min(stages - stage, count)


def _inflight_zero_bubble(stage, stages, count):  # 1F1B's, and those whose weight half it defers (stage)
    return min(stages, count)


def _takes_any(ranks, count):
    return True


def _takes_1f1b(ranks, count):  # torch's 1F1B runs at least one microbatch per stage
    return ranks <= count


def _takes_rounds(ranks, count):  # torch's run equal rounds of >= ranks microbatches
    return count % max(1, count // ranks) == 0


def _takes_interleaved(ranks, count):  # equal rounds; interleaving: 2+ ranks, a microbatch each
    return _takes_rounds(ranks, count) and 1 < ranks <= count


GPIPE = Schedule("gpipe", "ScheduleGPipe", multi_stage=False, virtual_stages=1, split_backward=False,
                 warmup=_warmup_all, inflight=_inflight_all, takes=_takes_any, timing="fill-drain")
ONE_F_ONE_B = Schedule("1f1b", "Schedule1F1B", multi_stage=False, virtual_stages=1, split_backward=False,
                       warmup=_warmup_1f1b, inflight=_inflight_1f1b, takes=_takes_1f1b, timing="fill-drain",
                       fallback="gpipe")
INTERLEAVED_1F1B = Schedule("interleaved-1f1b", "ScheduleInterleaved1F1B", multi_stage=True, virtual_stages=2,
                            split_backward=False, warmup=_warmup_1f1b, inflight=_inflight_1f1b,
                            takes=_takes_interleaved, timing="interleaved")
ZERO_BUBBLE = Schedule("zero-bubble", "ScheduleInterleavedZeroBubble", multi_stage=True, virtual_stages=1,
                       split_backward=True, warmup=_warmup_1f1b, inflight=_inflight_zero_bubble,
                       takes=_takes_rounds, timing="simulated")

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, ZERO_BUBBLE)}
SEARCHED = (ONE_F_ONE_B, GPIPE, ZERO_BUBBLE, INTERLEAVED_1F1B)  # what "auto" tries, in this order (ties keep the first)


def schedule_named(name: str | Schedule) -> Schedule:
    """The record of schedule ``name`` (a record is returned as is)."""
    if isinstance(name, Schedule):
        return name
    found = SCHEDULES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"Pipeline(schedule={name!r}): schedules are {list(SCHEDULES)}")
    return found


def listed(schedules) -> str:
    """Names as a sentence says them: 'a', 'b' or 'c'."""
    names = [repr(s.name) for s in schedules]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
