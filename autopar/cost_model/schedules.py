"""The step a pipeline schedule gives (``autopar.record.schedules`` holds the schedules): a formula
from the stages' times per microbatch, or an event simulation of each stage's task order, which also
prices ranks that share CPU cores (``simulate_shared``). No torch import.
"""
from __future__ import annotations

import math
from typing import Sequence

from autopar.errors import PlanError
from autopar.record.schedules import Schedule, schedule_named, schedule_orders

# A backward split into an input and a weight half costs more than the whole one: the weight half
# runs one autograd call per group of weights from the saved intermediates. Measured on CPU (torch
# 2.13's stage_backward_input + stage_backward_weight against one backward, transformer layers of
# width 64-256, 2-4 layers): 3.5-7.5% of forward + backward, about a tenth of the backward.
SPLIT_BACKWARD_EXTRA = 0.1


# ---- step times --------------------------------------------------------------------------------------
def step_time(schedule: str | Schedule, stage_times: Sequence[float], count: int, virtual: int = 1) -> float:
    """Seconds of a step of ``count`` microbatches with a device per rank, from the stages' times
    per microbatch (``virtual`` stages per rank), as ``schedule.timing`` says to price it."""
    schedule = schedule_named(schedule)
    if schedule.timing == "fill-drain":
        return fill_drain_time(stage_times, count)
    if schedule.timing == "interleaved":
        return interleaved_time(stage_times, len(stage_times) // virtual, virtual, count)
    return simulate_shared(stage_times, [1] * len(stage_times), count, schedule, math.inf)


def fill_drain_time(stage_times, microbatches: int, ranks: int | None = None) -> float:
    """GPipe / 1F1B step time from per-microbatch stage times: the pipeline fill and drain, then the
    slowest stage once per remaining microbatch (Alpa's objective, Zheng et al., OSDI'22). With
    ``ranks`` (fewer than the stages: stage i on rank i mod ``ranks``, each running its stages in
    turn, as a pipelined module's call does) the busiest rank's stages in place of the slowest."""
    ranks = ranks or len(stage_times)
    busiest = max(sum(stage_times[b::ranks]) for b in range(ranks))
    return float(sum(stage_times) + (microbatches - 1) * busiest)


def interleaved_time(stage_times, ranks: int, virtual: int, count: int) -> float:
    """Interleaved 1F1B's step: each rank runs ``virtual`` stages (stage i on rank i mod ``ranks``);
    with T the busiest rank's time per microbatch, ``count`` microbatches take count x T plus a
    bubble of (ranks - 1) x T / virtual (Narayanan et al., SC'21); never less than one
    microbatch's way through every stage (the formula assumes count >= ranks)."""
    per_rank = [sum(stage_times[b::ranks]) for b in range(ranks)]
    busiest = max(per_rank)
    return float(max((count + (ranks - 1) / virtual) * busiest, sum(stage_times)))


# ---- the simulation ---------------------------------------------------------------------------------
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
