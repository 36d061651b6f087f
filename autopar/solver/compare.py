"""What-ifs: hand-written hybrid configurations priced by the same cost model as autopar's plan.

A configuration is written as people write them: ``"tp=8,dp=16"``, ``"tp=8,pp=4,dp=4,mb=16"``,
``"dp=8,zero=3"``, ``"tp=4,vocab=1"``, ``"dp=64,zero=1,mb=8,recompute=full"`` (keys: dp, tp, pp, mb
(microbatches: gradient accumulation, with or without a pipeline), zero (0-3), vocab
(vocabulary-parallel loss, 0/1), recompute (none, full: every layer's activations recomputed in
backward, or selective: all but the outputs of matmuls and attention; ``record.recompute``)). The mesh's devices are viewed as (pp x dp, tp) when its shape differs (the cluster
prices the links of that view). Without ``pp``, ``mb`` and ``recompute`` it is
``autopar.plan(..., force=Layout(...))``; with any of them it is a pipeline of ``pp`` equal stages
(one: gradient accumulation) (``Pipeline(stages=pp, microbatches=mb, recompute=...)``) whose stages
run ``Layout(dp, tp, zero)`` on their sub-meshes. Each row says
the predicted step time, memory per device and bytes moved per step; one that does not fit the
budget says how much memory it needs. ``autopar.compare(plan, model, inputs, *configs)`` puts a plan
beside configurations; it is no method of ``Plan``, which the planner makes and so cannot call.
"""
from __future__ import annotations

import dataclasses
import math

from autopar.errors import ConfigError, PlanError
from autopar.ir.precision import MixedPrecision
from autopar.record.recompute import Recompute
from autopar.solver.config import Pipeline, PlanConfig
from autopar.solver.mesh_views import config_mesh
from autopar.solver.units import fmt_bytes, fmt_s

KEYS = ("dp", "tp", "pp", "mb", "zero", "vocab", "recompute")


@dataclasses.dataclass
class WhatIf:
    name: str
    step_time_s: float | None
    memory_bytes: float | None
    bytes_moved: float | None
    fits: bool
    note: str = ""
    plan: object = None


def parse_config(text: str) -> dict:
    """``"tp=8,pp=4,dp=4,mb=16,recompute=full"`` -> {"tp": 8, "pp": 4, "dp": 4, "mb": 16,
    "recompute": Recompute.FULL}."""
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in KEYS:
            raise ConfigError(f"what-if {text!r}: write items like tp=8,dp=16 (keys {', '.join(KEYS)}); got {item!r}")
        if key == "recompute":
            try:
                out[key] = Recompute.of(value.strip())
            except ConfigError:
                raise ConfigError(f"what-if {text!r}: recompute must be none, full or selective, got {value!r}") from None
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise ConfigError(f"what-if {text!r}: {key} must be a whole number, got {value!r}") from None
        if out[key] < 0 or (out[key] == 0 and key not in ("zero", "vocab", "recompute")):
            raise ConfigError(f"what-if {text!r}: {key} must be positive")
    return out


def config_grid(devices: int, *, layers: int | None = None, batch: int | None = None, tp_max: int | None = None,
                microbatches=(1, 2, 4, 8), zero=(0, 1, 2, 3), recompute=tuple(Recompute)) -> list[str]:
    """Every hand-written configuration of ``devices``: tp x pp x dp over the divisors (pp at most
    ``layers``, tp at most ``tp_max``), each ZeRO stage where dp > 1, the vocabulary-parallel loss
    on or off where tp > 1, the whole batch where dp splits it and each of ``microbatches`` that
    splits ``batch`` evenly over dp (with pp > 1 at least pp, what torch's 1F1B runs; without a
    pipeline, more than one is gradient accumulation), and each of ``recompute`` (``Recompute``
    kinds or their names: none, full, selective)."""
    def divisors(n):
        return [d for d in range(1, n + 1) if n % d == 0]

    def splits(m, dp):
        return batch is None or (batch % m == 0 and (batch // m) % dp == 0)

    out = []
    for tp in divisors(devices):
        if tp_max is not None and tp > tp_max:
            continue
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            if layers is not None and pp > layers:
                continue
            if pp == 1:
                mbs = ([None] if splits(1, dp) else []) + [m for m in microbatches if m > 1 and splits(m, dp)]
            else:
                mbs = [m for m in microbatches if m >= pp and splits(m, dp)]
            for z in zero:
                if z and dp == 1:
                    continue
                for vocab in ((0, 1) if tp > 1 else (0,)):
                    for mb in mbs:
                        for rc in map(Recompute.of, recompute):
                            parts = [f"tp={tp}", f"pp={pp}", f"dp={dp}"] + ([f"mb={mb}"] if mb else [])
                            parts += [f"zero={z}", f"vocab={vocab}"] + ([f"recompute={rc.value}"] if rc else [])
                            out.append(",".join(parts))
    return out


def config_of(plan) -> str | None:
    """The plan's own layout as a configuration (``"dp=4,zero=2,vocab=0"``) when it is one a
    hand-written configuration can state - each mesh axis either data or tensor parallel, at most
    one of each, one stage - else None."""
    from autopar.solver.explain import axis_roles, layout_words

    if plan.pipeline is not None:
        return None
    shape = plan.mesh["shape"]
    roles = axis_roles(plan)
    if any(r not in ("data", "tensor") for r in roles.values()) or \
            sum(r == "data" for r in roles.values()) > 1 or sum(r == "tensor" for r in roles.values()) > 1:
        return None
    dp = next((shape[a] for a, r in roles.items() if r == "data"), 1)
    tp = next((shape[a] for a, r in roles.items() if r == "tensor"), 1)
    words = layout_words(plan)
    zero = 2 if "ZeRO-2" in words else 3 if "ZeRO-3" in words else 0
    if zero and dp == 1:  # sharded over the tensor axis: no hand-written configuration says that
        return None
    synced = [p.grad_sync for p in plan.params.values() if not p.buffer]
    if zero == 2 and sum(s is not None and s.split for s in synced) * 2 < len(synced):
        return None  # mixed storage
    vocab = int("vocabulary-parallel loss" in words)
    parts = ([f"dp={dp}"] if dp > 1 else []) + ([f"tp={tp}"] if tp > 1 else [])
    return ",".join(parts + ([f"zero={zero}"] if zero else []) + [f"vocab={vocab}"])


def _bytes_moved(plan) -> float:
    from autopar.solver.explain import bytes_per_step

    return bytes_per_step(plan)


def price(model, mesh, example_inputs, config: str, *, example_kwargs=None, memory_budget="auto",
          plan_config: PlanConfig | None = None, **options) -> WhatIf:
    """One configuration, priced (see the module docstring) under ``plan_config`` and ``options``
    (``PlanConfig`` fields): planned without a budget, then held against ``memory_budget`` (as
    ``autopar.plan`` reads it)."""
    from autopar.solver.api import plan as make_plan
    from autopar.solver.intra_op import default_budget
    from autopar.solver.layout import Layout

    c, dp, tp, pp = _degrees(config, mesh)
    vocab = c.get("vocab")
    budget = default_budget(memory_budget, mesh)[0] or math.inf
    mesh = config_mesh(mesh, pp * dp, tp)
    try:
        layout = Layout(dp=dp, tp=tp, zero=c.get("zero", 0), vocab_parallel=None if vocab is None else bool(vocab))
        accumulates = pp > 1 or "mb" in c or "recompute" in c  # a pipeline (of one stage: accumulation)
        recompute = c.get("recompute")
        # without mb, one stage runs the batch whole (recomputed or not); a pipeline's count is searched
        microbatches = c.get("mb", 1 if pp == 1 else None)
        pipeline = Pipeline(stages=pp, microbatches=microbatches, recompute=recompute) if accumulates else None
        config_of_plan = PlanConfig.of(plan_config, **options).replace(memory_budget=None, force=layout, pipeline=pipeline)
        plan = make_plan(model, mesh, example_inputs, example_kwargs=example_kwargs, config=config_of_plan)
    except (PlanError, ConfigError) as err:
        return WhatIf(config, None, None, None, False, f"cannot be planned: {err}")
    memory = plan.predicted["memory_bytes_per_device"]
    fits = memory <= budget
    note = "" if fits else f"does not fit: needs {fmt_bytes(memory)} per device, the budget is {fmt_bytes(budget)}"
    return WhatIf(config, plan.predicted["step_time_s"], memory, _bytes_moved(plan), fits, note, plan)


def _degrees(config: str, mesh) -> tuple[dict, int, int, int]:
    """(parsed configuration, dp, tp, pp), or the ConfigError of a configuration ``mesh`` cannot run."""
    c = parse_config(config)
    dp, tp, pp = c.get("dp", 1), c.get("tp", 1), c.get("pp", 1)
    if dp * tp * pp != mesh.size:
        raise ConfigError(f"what-if {config!r}: dp x tp x pp = {dp * tp * pp}, but the mesh has {mesh.size} devices")
    return c, dp, tp, pp


def check_configs(configs, mesh) -> None:
    """Raise the ConfigError a configuration would raise, before anything is planned."""
    for config in configs:
        _degrees(config, mesh)


def compare(model, mesh, example_inputs, configs, *, plan=None, example_kwargs=None, memory_budget="auto",
            plan_config: PlanConfig | None = None, **options) -> list[WhatIf]:
    """autopar's ``plan`` (first, when given) and each configuration, priced alike."""
    check_configs(configs, mesh)
    rows = []
    if plan is not None:
        own = config_of(plan)
        rows.append(WhatIf("autopar" + (f" ({own})" if own else ""), plan.predicted["step_time_s"], plan.predicted["memory_bytes_per_device"],
                           _bytes_moved(plan), True, "", plan))
    for config in configs:
        rows.append(price(model, mesh, example_inputs, config, example_kwargs=example_kwargs,
                          memory_budget=memory_budget, plan_config=plan_config, **options))
    return rows


def compare_plan(plan, model, example_inputs, *configs, example_kwargs=None, memory_budget=None,
                 plan_config: PlanConfig | None = None, **options) -> list[WhatIf]:
    """``plan`` beside hand-written configurations (``"tp=8,dp=16"``, ``"tp=8,pp=4,dp=4,mb=16"``)
    priced by the same cost model on the plan's mesh: ``WhatIf`` rows, the plan first (``table(rows)``
    prints them), under the plan's precision unless one is given. ``autopar.compare``."""
    if plan.precision and "precision" not in options and (plan_config is None or plan_config.precision is None):
        options["precision"] = MixedPrecision.from_dict(plan.precision)
    return compare(model, plan.mesh_obj, example_inputs, configs, plan=plan, example_kwargs=example_kwargs,
                   memory_budget=memory_budget, plan_config=plan_config, **options)


def table(rows: list[WhatIf]) -> str:
    """The rows side by side, with each one's step time against the first row's."""
    base = next((r.step_time_s for r in rows if r.step_time_s is not None), None)
    out = [f"{'configuration':<28} {'step time':>12} {'vs first':>9} {'memory/device':>14} {'moved/step':>12}  note"]
    for r in rows:
        if r.step_time_s is None:
            out.append(f"{r.name:<28} {'-':>12} {'-':>9} {'-':>14} {'-':>12}  {r.note}")
            continue
        ratio = f"{r.step_time_s / base:.2f}x" if base else "-"
        out.append(f"{r.name:<28} {fmt_s(r.step_time_s):>12} {ratio:>9} {fmt_bytes(r.memory_bytes):>14} "
                   f"{fmt_bytes(r.bytes_moved):>12}  {r.note}")
    return "\n".join(out)
