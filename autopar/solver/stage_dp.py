"""The pipeline stage search: a dynamic program over (layer range, sub-mesh), pure numpy.

Given, for every contiguous range of layers ``i..j`` and every sub-mesh option ``m``, the time one
microbatch takes through that stage (forward + backward, its intra-op plan already chosen), the
bytes it holds for good (parameters, gradients, optimizer states) and per microbatch in flight
(activations), choose the stages: contiguous ranges covering every layer in order, each on a
sub-mesh, the sub-meshes using exactly the devices there are. Under GPipe and 1F1B the step takes

    sum_k t_k + (B - 1) * max_k t_k          (B microbatches; the pipeline fill and drain, then
                                             the slowest stage once per remaining microbatch)

(Alpa's objective, Zheng et al., OSDI'22). The search fixes the slowest stage time ``t_max`` to each
candidate value in turn (ascending, stopping once ``(B - 1) * t_max`` alone cannot win), and for
each runs the DP

    G[s][k][d] = least sum of stage times covering layers k.. with s stages on d device units,
                 every stage at most t_max and within the memory budget

    G[s][k][d] = min over j >= k, option m:  t[k, j, m] + G[s-1][j+1][d - units(m)]

where the stage that starts at layer k is the s-th from the end, so it holds what the first of s
stages holds under the schedule (``Schedule.inflight(0, s, B)``): under 1F1B ``min(s, B)``
microbatches of activations, under GPipe all B. That is exact where a stage's count depends on its
place from the end alone; otherwise (zero bubble: ``min(p, B)`` on every stage of p) it is a lower
bound, which the caller checks on the answer. Device counts are in units of the options' greatest
common divisor. Which sub-mesh options tile the mesh, and the tables themselves,
are the orchestration's business (``autopar.solver.pipeline``); this module sees only arrays.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from functools import reduce

import numpy as np

from autopar.cost_model.schedules import fill_drain_time
from autopar.record.schedules import schedule_named


@dataclasses.dataclass
class StageSolution:
    stages: list[tuple[int, int, int]]  # (first layer, last layer, option), in pipeline order
    step_time: float
    t_max: float
    stage_times: list[float]

    @property
    def n_stages(self) -> int:
        return len(self.stages)


def _check(time, devices, total, microbatches, mem, act):
    time = np.asarray(time, dtype=float)
    if time.ndim != 3 or time.shape[0] != time.shape[1]:
        raise ValueError(f"time must be (layers, layers, options), got shape {time.shape}")
    devices = np.asarray(devices, dtype=int)
    if devices.shape != (time.shape[2],) or (devices < 1).any():
        raise ValueError(f"devices must give a positive count per option ({time.shape[2]}), got {devices}")
    if microbatches < 1 or total < 1:
        raise ValueError(f"microbatches and total devices must be >= 1, got {microbatches}, {total}")
    zeros = np.zeros_like(time)
    mem = zeros if mem is None else np.asarray(mem, dtype=float)
    act = zeros if act is None else np.asarray(act, dtype=float)
    return time, devices, mem, act


def _inflight(schedule):
    """(stages from the end, microbatches) -> what the DP counts in flight (see the module docstring)."""
    record = schedule_named(schedule)
    return lambda s, b: record.inflight(0, s, b)


def solve_stages(time, devices, total_devices: int, microbatches: int, *, mem=None, act=None,
                 budget: float = math.inf, schedule: str = "1f1b", stage_counts=None,
                 tolerance: float = 0.0) -> StageSolution | None:
    """The best stages (see the module docstring), or None when no choice fits.

    time[i, j, m]: per-microbatch time of layers i..j on option m (inf: not allowed; j < i unused).
    devices[m]: devices of option m; the stages use exactly ``total_devices``.
    mem / act: bytes held for good / per microbatch in flight, same shape as ``time``.
    stage_counts: the allowed numbers of stages (None: any).
    tolerance: skip a t_max within this relative distance of the last one tried (0: exact)."""
    time, devices, mem, act = _check(time, devices, total_devices, microbatches, mem, act)
    n_layers, _, n_opt = time.shape
    unit = reduce(math.gcd, devices.tolist())
    if total_devices % unit:
        return None
    units, n_units = devices // unit, total_devices // unit
    max_stages = min(n_layers, n_units)
    allowed = set(range(1, max_stages + 1)) if stage_counts is None else {s for s in stage_counts if 1 <= s <= max_stages}
    if not allowed:
        return None
    inflight = _inflight(schedule)
    upper = np.triu(np.ones((n_layers, n_layers), dtype=bool))[:, :, None]
    # Per number of stages from the end (s): the stage costs with the memory budget applied, then
    # reduced to the cheapest option per device count (the DP only needs that one; ``pick`` says
    # which option it was).
    sizes = sorted(set(units.tolist()))
    per_s, pick = {}, {}
    for s in range(1, max(allowed) + 1):
        fits = mem + inflight(s, microbatches) * act <= budget
        cost = np.where(upper & fits & np.isfinite(time), time, math.inf)
        per_s[s] = np.stack([cost[:, :, units == u].min(axis=2) for u in sizes], axis=2)
        pick[s] = np.stack([np.flatnonzero(units == u)[cost[:, :, units == u].argmin(axis=2)] for u in sizes], axis=2)
    sizes = np.asarray(sizes)
    # t_max candidates: the stage costs of ranges short enough to leave a unit for each other stage
    longest = n_layers - min(allowed) + 1
    short = (np.arange(n_layers)[None, :] - np.arange(n_layers)[:, None] < longest)[:, :, None]
    candidates = np.unique(np.concatenate([c[np.isfinite(c) & short] for c in per_s.values()]))
    best: tuple[float, float] | None = None  # (step time, t_max)
    last_tried = None
    for t_max in candidates:
        if best is not None and (microbatches - 1) * t_max >= best[0]:
            break
        # Near-equal t_max values give near-equal steps: skip them once something fits (before,
        # the next candidate may be the first that does).
        if best is not None and last_tried is not None and tolerance > 0 and t_max <= last_tried * (1 + tolerance):
            continue
        last_tried = t_max
        total_s = _dp_sum(per_s, t_max, sizes, n_units, allowed)[0]
        if math.isfinite(total_s):
            value = total_s + (microbatches - 1) * t_max
            if best is None or value < best[0] - 1e-15 * max(1.0, abs(value)):
                best = (value, t_max)
    if best is None:
        return None
    _, t_max = best
    _, s_best, choice = _dp_sum(per_s, t_max, sizes, n_units, allowed, keep_choice=True)
    stages, k, d = [], 0, n_units
    for s in range(s_best, 0, -1):
        j, g = choice[s][k, d]
        m = int(pick[s][k, j, g])
        stages.append((k, int(j), m))
        k, d = int(j) + 1, d - int(sizes[g])
    times = [float(time[i, j, m]) for i, j, m in stages]
    return StageSolution(stages, fill_drain_time(times, microbatches), float(max(times)), times)


def _dp_sum(per_s, t_max, units, n_units, allowed, keep_choice=False):
    """(least sum of stage times over the allowed stage counts, its stage count, choices).
    ``per_s[s][k, j, g]``: the cost of a stage on ``units[g]`` device units."""
    n_layers = next(iter(per_s.values())).shape[0]
    inf = math.inf
    prev = np.full((n_layers + 1, n_units + 1), inf)
    prev[n_layers, 0] = 0.0
    best, best_s, choices = inf, 0, {}
    for s in range(1, max(allowed) + 1):
        cost = np.where(per_s[s] <= t_max, per_s[s], inf)
        cur = np.full((n_layers + 1, n_units + 1), inf)
        choice = np.zeros((n_layers + 1, n_units + 1, 2), dtype=int) if keep_choice else None
        # the s-th stage from the end starts where every stage before and after it gets a layer:
        # after it s - 1 stages, before it at least (the fewest allowed counts >= s) - s
        before = min((a for a in allowed if a >= s), default=s) - s
        for k in range(n_layers - s, before - 1, -1):
            for m, u in enumerate(units):
                if u > n_units:
                    continue
                c = cost[k, k:, m]  # stage k..j for j = k..L-1
                if not np.isfinite(c).any():
                    continue
                rest = prev[k + 1:, : n_units + 1 - u]  # G[s-1][j+1][d - u]
                cand = c[:, None] + rest
                j_best = np.argmin(cand, axis=0)
                val = cand[j_best, np.arange(cand.shape[1])]
                target = cur[k, u:]
                better = val < target
                if better.any():
                    target[better] = val[better]
                    if keep_choice:
                        idx = np.nonzero(better)[0] + u
                        choice[k, idx, 0] = k + j_best[better]
                        choice[k, idx, 1] = m
        if keep_choice:
            choices[s] = choice
        if s in allowed and cur[0, n_units] < best:
            best, best_s = cur[0, n_units], s
        prev = cur
    return best, best_s, choices


def brute_force(time, devices, total_devices: int, microbatches: int, *, mem=None, act=None,
                budget: float = math.inf, schedule: str = "1f1b", stage_counts=None) -> StageSolution | None:
    """Every split into contiguous stages and every option per stage: the reference for tests."""
    time, devices, mem, act = _check(time, devices, total_devices, microbatches, mem, act)
    n_layers, _, n_opt = time.shape
    inflight = _inflight(schedule)
    best = None
    for n_stages in range(1, n_layers + 1):
        if stage_counts is not None and n_stages not in stage_counts:
            continue
        for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
            bounds = [0, *cuts, n_layers]
            ranges = [(bounds[i], bounds[i + 1] - 1) for i in range(n_stages)]
            for opts in itertools.product(range(n_opt), repeat=n_stages):
                if sum(int(devices[m]) for m in opts) != total_devices:
                    continue
                times, ok = [], True
                for pos, ((i, j), m) in enumerate(zip(ranges, opts)):
                    s = n_stages - pos
                    if not (math.isfinite(time[i, j, m]) and mem[i, j, m] + inflight(s, microbatches) * act[i, j, m] <= budget):
                        ok = False
                        break
                    times.append(float(time[i, j, m]))
                if not ok:
                    continue
                value = fill_drain_time(times, microbatches)
                if best is None or value < best.step_time - 1e-12:
                    best = StageSolution([(i, j, m) for (i, j), m in zip(ranges, opts)], value, max(times), times)
    return best
