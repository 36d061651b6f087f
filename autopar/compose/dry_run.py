"""``autopar.dry_run``: a plan's programs built and run for sampled ranks before a job starts.

For each sampled rank, in this process: a fake world of the plan's size with this rank in it
(``autopar.runtime.dry_run.FakeWorld``), ``autopar.parallelize`` with the plan on the meta device,
the optimizer the plan was priced with on the module's parameters, and two training steps
(``train_step``, ``optimizer.step()``, ``zero_grad()``): the first makes what lives from step to
step (optimizer states, kept buffers), the second is measured. A ``Recorder`` lists every
collective the rank issues from its first ``new_group`` on, counts the step's ops and follows the
bytes it holds; then the ranks' collectives are checked against each other (``check``) and each
rank's peak against the plan's prediction for it.

Sampled by default: the first and last rank of every pipeline stage and the corners of the mesh
(every axis at its first and last coordinate), which puts two members in every group of a
one-stage plan and both ends of every stage-to-stage send. Ranks whose stage comes later run
first: the last stage is where a pipeline's outputs are broadcast from. The model is traced once
per call shape for all of them (``ir.trace.reusing_traces``).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from collections import Counter

import torch

from autopar.errors import ConfigError
from autopar.ir.trace import reusing_traces
from autopar.runtime.dry_run import Collective, FakeWorld, Recorder, check, ranks_text

MEMORY_TOLERANCE = 0.10  # |measured / predicted - 1| a rank may show and pass
OPTIMIZERS = {  # the optimizer a plan is priced with (PlanConfig.optimizer) -> how a user builds it
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


@dataclasses.dataclass
class RankRun:
    """What one sampled rank ran."""

    rank: int
    stages: tuple[int, ...]  # the pipeline stages it runs ((0,) for a one-stage plan)
    collectives: list[Collective]  # every call, from building the module to the end of the measured step
    step_from: int  # index of the measured step's first collective
    ops: int  # ops of the measured step, collectives not counted
    held_bytes: int  # alive on the device when the measured step starts
    peak_bytes: int  # the most alive during it
    predicted_bytes: float
    seconds: float

    @property
    def step_collectives(self) -> list[Collective]:
        return self.collectives[self.step_from:]

    @property
    def memory_ratio(self) -> float:
        return self.peak_bytes / self.predicted_bytes if self.predicted_bytes else float("inf")

    def by_group(self) -> list[tuple[tuple[int, ...], str, str, int, int]]:
        """The measured step's collectives as (group ranks, kind, dtype, calls, elements sent)."""
        out: Counter = Counter()
        count: Counter = Counter()
        for c in self.step_collectives:
            key = (c.ranks if c.kind not in ("send", "recv") else (self.rank, c.peer), c.kind, ",".join(sorted(set(c.dtypes))))
            count[key] += 1
            out[key] += sum(math.prod(s) for s in c.shapes)
        return [(*k, count[k], out[k]) for k in count]

    def to_json(self) -> dict:
        return {"rank": self.rank, "stages": list(self.stages), "ops": self.ops, "held_bytes": self.held_bytes,
                "peak_bytes": self.peak_bytes, "predicted_bytes": self.predicted_bytes, "seconds": self.seconds,
                "step_collectives": len(self.step_collectives),
                "by_group": [{"ranks": list(r), "kind": k, "dtype": d, "calls": n, "elements": e}
                             for r, k, d, n, e in self.by_group()],
                "collectives": [c.to_json() for c in self.collectives]}


@dataclasses.dataclass
class DryRun:
    """The dry run of a plan: each sampled rank's run, and what disagrees."""

    world_size: int
    runs: list[RankRun]
    mismatches: list[str]
    tolerance: float = MEMORY_TOLERANCE

    @property
    def memory_ok(self) -> bool:
        return all(abs(r.memory_ratio - 1) <= self.tolerance for r in self.runs)

    @property
    def ok(self) -> bool:
        """Every collective matched among the sampled ranks and every rank's peak within the tolerance."""
        return not self.mismatches and self.memory_ok

    def report(self, verbose: bool = False) -> str:
        """The table of ranks, the first rank's (``verbose``: every rank's) collectives by group,
        the disagreements, and OK or FAILED."""
        from autopar.solver.units import fmt_bytes

        lines = [f"dry run of {len(self.runs)} of {self.world_size} ranks (meta tensors, fake process group, "
                 "two training steps, the second measured)",
                 f"{'rank':>6} {'stage':>6} {'ops':>7} {'collectives':>11}  {'held':>10} {'peak':>10} "
                 f"{'predicted':>10} {'ratio':>6}"]
        for r in sorted(self.runs, key=lambda r: r.rank):
            lines.append(f"{r.rank:>6} {','.join(map(str, r.stages)):>6} {r.ops:>7} {len(r.step_collectives):>11}  "
                         f"{fmt_bytes(r.held_bytes):>10} {fmt_bytes(r.peak_bytes):>10} {fmt_bytes(r.predicted_bytes):>10} "
                         f"{r.memory_ratio:>6.3f}")
        shown = sorted(self.runs, key=lambda r: r.rank) if verbose else sorted(self.runs, key=lambda r: r.rank)[:1]
        for r in shown:
            lines.append(f"rank {r.rank}'s step, collectives by group:")
            for ranks, kind, dtype, n, elements in sorted(r.by_group(), key=lambda x: (x[1], x[0])):
                members = ranks_text(ranks) if kind not in ("send", "recv") else f"{ranks[0]} -> {ranks[1]}"
                lines.append(f"  {kind:<17} {dtype:<9} x{n:<4} {elements:>14,} elements  ranks {members}")
        if self.mismatches:
            lines.append(f"{len(self.mismatches)} disagreement(s) between ranks (a real job would hang or compute "
                         "garbage there):")
            lines += [f"  {m}" for m in self.mismatches[:20]]
        else:
            lines.append("every collective matched among the sampled ranks")
        off = [r for r in self.runs if abs(r.memory_ratio - 1) > self.tolerance]
        if off:
            lines.append(f"memory off the prediction by more than {self.tolerance:.0%} on rank(s) "
                         + ", ".join(f"{r.rank} ({r.memory_ratio:.2f}x)" for r in off[:8]))
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "ok": self.ok, "mismatches": self.mismatches,
                "tolerance": self.tolerance, "ranks": [r.to_json() for r in self.runs]}


def sample_ranks(plan) -> list[int]:
    """The first and last rank of every pipeline stage, and the mesh's corners."""
    mesh = plan.mesh_obj
    out = {int(r) for s in (plan.pipeline.stages if plan.pipeline is not None else ()) for r in (s.ranks[0], s.ranks[-1])}
    for corner in itertools.product(*[(0, n - 1) for n in mesh.shape]):
        out.add(mesh.rank(corner))
    return sorted(out)


def stages_of(plan, rank: int) -> tuple[int, ...]:
    if plan.pipeline is None:
        return (0,)
    return tuple(i for i, s in enumerate(plan.pipeline.stages) if rank in s.ranks)


def predicted_bytes(plan, rank: int) -> float:
    """The plan's memory for ``rank``: the stages it runs, or the one-stage plan's per device."""
    if plan.pipeline is None:
        return float(plan.predicted["memory_bytes_per_device"])
    return float(sum(s.memory_bytes for s in plan.pipeline.stages if rank in s.ranks))


def dry_run(plan, model: torch.nn.Module, example_inputs=(), *, example_kwargs: dict | None = None, ranks=None,
            optimizer: str = "adamw", tolerance: float = MEMORY_TOLERANCE, progress=None) -> DryRun:
    """Build and run ``plan``'s program for sampled ranks in this process (see the module
    docstring) and check them against each other and against the plan's memory.

    plan: a Plan or a path to a plan JSON, made for ``model`` and ``example_inputs`` (a meta-device
        model is how a plan larger than this machine is made; a real one works too).
    ranks: None (the first and last rank of every stage and the mesh corners), "all", or ranks.
    optimizer: what the plan was priced with (``PlanConfig.optimizer``), built on each rank's
        parameters as a user would.
    progress: called with each ``RankRun`` as it finishes (the CLI prints them).
    """
    from autopar.solver.plan import Plan

    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r} for a dry run; expected one of {sorted(OPTIMIZERS)}")
    mesh = plan.mesh_obj
    world = mesh.size
    chosen = _chosen_ranks(plan, ranks, world)
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    order = sorted(chosen, key=lambda r: (-max(stages_of(plan, r), default=0), r))
    payloads: dict = {}
    runs = []
    with reusing_traces():  # every rank traces the same model on the same calls
        for rank in order:
            recorder = Recorder("meta")
            with FakeWorld(rank, world, recorder, payloads), recorder:
                run = run_rank(plan, model, inputs, kwargs, recorder, device="meta", optimizer=optimizer)
            runs.append(run)
            if progress is not None:
                progress(run)
    mismatches = check({r.rank: r.collectives for r in runs})
    return DryRun(world, runs, mismatches, tolerance)


def run_rank(plan, model, inputs, kwargs, recorder: Recorder, *, device, optimizer: str = "adamw") -> RankRun:
    """This rank's module built with ``plan`` on ``device`` and two training steps run under
    ``recorder`` (active), the second measured. Inside a process group: the fake one of a dry
    run, or a real one (a test runs a real world and compares)."""
    import torch.distributed as dist

    from autopar.compose.parallelize import parallelize

    t0 = time.perf_counter()
    rank = dist.get_rank()
    pmodel = parallelize(model, plan.mesh_obj, tuple(inputs), example_kwargs=kwargs or None, plan=plan, device=device,
                         profile=False)
    opt = OPTIMIZERS[optimizer](list(pmodel.parameters()))
    recorder.track(held=list(pmodel.parameters()) + list(pmodel.buffers()))
    _train_step(pmodel, opt, inputs, kwargs)
    recorder.start_step()
    _train_step(pmodel, opt, inputs, kwargs)
    del pmodel, opt
    return RankRun(rank, stages_of(plan, rank), recorder.collectives, recorder.step_from, recorder.ops,
                   recorder.held_bytes, recorder.peak_bytes, predicted_bytes(plan, rank), time.perf_counter() - t0)


def _train_step(pmodel, opt, inputs, kwargs) -> None:
    pmodel.train_step(*inputs, **kwargs)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _chosen_ranks(plan, ranks, world: int) -> list[int]:
    if ranks is None:
        return sample_ranks(plan)
    if isinstance(ranks, str):
        if ranks != "all":
            raise ConfigError(f"ranks={ranks!r}: give 'all', a list of ranks, or None for the sample")
        return list(range(world))
    chosen = sorted({int(r) for r in ranks})
    bad = [r for r in chosen if not 0 <= r < world]
    if bad or not chosen:
        raise ConfigError(f"ranks {bad or '(none)'} are not ranks of the plan's mesh of {world}: give ranks in 0..{world - 1}")
    return chosen
