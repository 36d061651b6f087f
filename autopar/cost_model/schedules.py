"""Pipeline schedules: one record per schedule, and the step time each gives.

A ``Schedule`` holds everything the planner, codegen and runtime decide per schedule: the torch
class that runs it (``torch.distributed.pipelining``) and whether that class takes a list of
stages, the stages per rank, whether the backward splits into an input and a weight half (and so
whether recomputation is allowed), the microbatches a stage holds in flight, the microbatch counts
torch's class takes, each stage's task order, and the step with a device per rank from the stages'
times per microbatch (a formula, or an event simulation of the task order). The simulation also
prices ranks that share CPU cores (``simulate_shared``).

Plans store a schedule's name; ``schedule_named`` finds its record. No torch import: the solver,
codegen and runtime all read this module.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from autopar.errors import ConfigError, PlanError

# A backward split into an input and a weight half costs more than the whole one: the weight half
# runs one autograd call per group of weights from the saved intermediates. Measured on CPU (torch
# 2.13's stage_backward_input + stage_backward_weight against one backward, transformer layers of
# width 64-256, 2-4 layers): 3.5-7.5% of forward + backward, about a tenth of the backward.
SPLIT_BACKWARD_EXTRA = 0.1


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
    # (schedule, stage times, count, stages per rank) -> the step with a device per rank
    timing: Callable[["Schedule", Sequence[float], int, int], float] = dataclasses.field(repr=False)
    fallback: str | None = None  # what the runtime runs where torch's class does not take the count

    def __str__(self) -> str:
        return self.name

    @property
    def interleaved(self) -> bool:
        """Whether it runs several stages per rank."""
        return self.virtual_stages > 1

    @property
    def simulated(self) -> bool:
        """Whether its step is the event simulation of its task order (no formula gives it)."""
        return self.timing is _simulated

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

    def step_time(self, stage_times: Sequence[float], count: int, virtual: int = 1) -> float:
        """Seconds of a step of ``count`` microbatches with a device per rank, from the stages'
        times per microbatch (``virtual`` stages per rank)."""
        return self.timing(self, stage_times, count, virtual)


# ---- step times --------------------------------------------------------------------------------------
def fill_drain_time(stage_times, microbatches: int) -> float:
    """GPipe / 1F1B step time from per-microbatch stage times: the pipeline fill and drain, then the
    slowest stage once per remaining microbatch (Alpa's objective, Zheng et al., OSDI'22)."""
    return float(sum(stage_times) + (microbatches - 1) * max(stage_times))


def interleaved_time(stage_times, ranks: int, virtual: int, count: int) -> float:
    """Interleaved 1F1B's step: each rank runs ``virtual`` stages (stage i on rank i mod ``ranks``);
    with T the busiest rank's time per microbatch, ``count`` microbatches take count x T plus a
    bubble of (ranks - 1) x T / virtual (Narayanan et al., SC'21); never less than one
    microbatch's way through every stage (the formula assumes count >= ranks)."""
    per_rank = [sum(stage_times[b::ranks]) for b in range(ranks)]
    busiest = max(per_rank)
    return float(max((count + (ranks - 1) / virtual) * busiest, sum(stage_times)))


def _fill_drain(schedule, stage_times, count, virtual):
    return fill_drain_time(stage_times, count)


def _interleaved(schedule, stage_times, count, virtual):
    return interleaved_time(stage_times, len(stage_times) // virtual, virtual, count)


def _simulated(schedule, stage_times, count, virtual):
    return simulate_shared(stage_times, [1] * len(stage_times), count, schedule, math.inf)


# ---- task orders and their simulation ----------------------------------------------------------------
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


def task_fractions(schedule, stage: int) -> dict[str, float]:
    """The share of a stage's per-microbatch time each task takes: forward a third, backward two.
    Under a split backward the input and the weight gradient take a third each, the weight half
    ``SPLIT_BACKWARD_EXTRA`` of the backward more; stage 0 has no input gradient to send, and torch
    runs its whole backward as the weight task (unsplit)."""
    if not schedule_named(schedule).split_backward:
        return {"F": 1 / 3, "B": 2 / 3}
    if stage == 0:
        return {"F": 1 / 3, "B": 0.0, "W": 2 / 3}
    return {"F": 1 / 3, "B": 1 / 3, "W": 1 / 3 + 2 / 3 * SPLIT_BACKWARD_EXTRA}


def simulate_shared(alone_s, rows, count: int, schedule, capacity: float, trace: list | None = None) -> float:
    """Seconds of one step of a pipeline (``schedule_orders``) whose stage ``s`` takes ``alone_s[s]``
    per microbatch (split by ``task_fractions``) at full speed on ``rows[s]`` ranks, where the busy
    ranks share ``capacity`` ranks' worth of full speed (each runs at min(1, capacity / busy);
    ``math.inf``: a device per rank). Forward k of a stage waits for forward k of the one before,
    backward k for backward k of the one after and its own forward k, a weight half for its
    backward; each stage runs its tasks in order. ``trace``, if given, receives (stage, task,
    microbatch, start, end) per task."""
    schedule = schedule_named(schedule)
    p = len(alone_s)
    orders = schedule_orders(p, count, schedule)
    share = [task_fractions(schedule, st) for st in range(p)]
    done: set = set()
    nxt = [0] * p
    left = [None] * p  # remaining full-speed seconds of the task in progress
    started = [0.0] * p
    now = 0.0
    while any(i < len(o) for i, o in zip(nxt, orders)):
        for st in range(p):
            if left[st] is None and nxt[st] < len(orders[st]):
                kind, k = orders[st][nxt[st]]
                deps = [("F", st - 1, k)] if kind == "F" and st else []
                if kind == "B":
                    deps = [("F", st, k)] + ([("B", st + 1, k)] if st < p - 1 else [])
                if kind == "W":
                    deps = [("B", st, k)]
                if all(d in done for d in deps):
                    left[st] = alone_s[st] * share[st][kind]
                    started[st] = now
        running = [st for st in range(p) if left[st] is not None]
        if not running:  # cannot happen for these schedules; never loop forever
            raise PlanError(f"pipeline simulation stalled ({schedule}, {p} stages, {count} microbatches)")
        speed = min(1.0, capacity / sum(rows[st] for st in running))
        dt = min(left[st] for st in running) / speed
        now += dt
        for st in running:
            left[st] -= dt * speed
            if left[st] <= 1e-12:
                kind, k = orders[st][nxt[st]]
                done.add((kind, st, k))
                if trace is not None:
                    trace.append((st, kind, k, started[st], now))
                nxt[st] += 1
                left[st] = None
    return now


def bubble_fraction(stage_times, count: int, schedule, virtual: int = 1) -> float:
    """Idle share of a step with a device per rank: 1 - (count x the slowest stage) / the step.
    Interleaved: (ranks - 1) / virtual over count + (ranks - 1) / virtual; else the simulated
    schedule (GPipe and 1F1B: fill and drain, sum + (count - 1) x the slowest)."""
    times = [float(t) for t in stage_times]
    if virtual > 1:
        bubble = (len(times) // virtual - 1) / virtual
        return bubble / (count + bubble)
    if not times or max(times) <= 0:
        return 0.0
    total = simulate_shared(times, [1] * len(times), count, schedule, math.inf)
    return max(0.0, 1.0 - count * max(times) / total)


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
                 warmup=_warmup_all, inflight=_inflight_all, takes=_takes_any, timing=_fill_drain)
ONE_F_ONE_B = Schedule("1f1b", "Schedule1F1B", multi_stage=False, virtual_stages=1, split_backward=False,
                       warmup=_warmup_1f1b, inflight=_inflight_1f1b, takes=_takes_1f1b, timing=_fill_drain,
                       fallback="gpipe")
INTERLEAVED_1F1B = Schedule("interleaved-1f1b", "ScheduleInterleaved1F1B", multi_stage=True, virtual_stages=2,
                            split_backward=False, warmup=_warmup_1f1b, inflight=_inflight_1f1b,
                            takes=_takes_interleaved, timing=_interleaved)
ZERO_BUBBLE = Schedule("zero-bubble", "ScheduleInterleavedZeroBubble", multi_stage=True, virtual_stages=1,
                       split_backward=True, warmup=_warmup_1f1b, inflight=_inflight_zero_bubble,
                       takes=_takes_rounds, timing=_simulated)

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
