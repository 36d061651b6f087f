"""How autopar plans: ``PlanConfig``, the one set of planning options that ``autopar.plan``,
``autopar.parallelize`` and the CLI share, and ``Pipeline``, its pipeline field.

Both functions take ``config=PlanConfig(...)`` and, as a shorthand, any of its fields as a keyword
(``autopar.plan(model, mesh, x, pipeline=False)``); the CLI's flags build one (``cli.main.planning_config``).
Inside the planner the config travels whole: a caller that changes an option says so with
``config.replace(...)``, never by filtering a dict of keywords.
"""
from __future__ import annotations

import dataclasses

from autopar.cost_model.memory import OPTIMIZER_STATES
from autopar.record.recompute import Recompute
from autopar.record.schedules import SCHEDULES, listed, schedule_named
from autopar.record.buckets import DEFAULT_BUCKET_BYTES
from autopar.errors import ConfigError
from autopar.ir.precision import policy
from autopar.solver.layout import Layout


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline choices for ``autopar.plan``: every given field is fixed, every None searched."""

    stages: int | None = None
    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    # "none", "full", "selective" (``record.recompute``; True is "full"), None: chosen per stage
    recompute: Recompute | bool | str | None = None
    layers: tuple[int, ...] | None = None  # layers per stage, in order (e.g. (3, 1)); fixes the stage count

    def __post_init__(self):
        named = SCHEDULES.get(self.schedule) if isinstance(self.schedule, str) else None  # None: searched or unknown
        object.__setattr__(self, "recompute", Recompute.of(self.recompute))
        if self.layers is not None:
            layers = tuple(int(n) for n in self.layers)
            if not layers or min(layers) < 1:
                raise ConfigError(f"Pipeline(layers={self.layers}): every stage needs at least one layer")
            object.__setattr__(self, "layers", layers)
            v = self.virtual_stages or (named.virtual_stages if named else 1)
            if len(layers) % v:
                raise ConfigError(f"Pipeline(layers={self.layers}): {len(layers)} stages do not fill {v} virtual stages per rank")
            if self.stages is not None and self.stages * v != len(layers):
                raise ConfigError(f"Pipeline(stages={self.stages}, layers={self.layers}): {len(layers)} stages given by layers")
            object.__setattr__(self, "stages", len(layers) // v)
        if self.stages is not None and self.stages < 1:
            raise ConfigError(f"Pipeline(stages={self.stages}): need at least one stage")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"Pipeline(microbatches={self.microbatches}): need at least one microbatch")
        if self.schedule is not None:
            named = schedule_named(self.schedule)
        if named is not None and not named.recompute and self.recompute:
            others = listed(s for s in SCHEDULES.values() if s.recompute)
            raise ConfigError(f"Pipeline(schedule={named.name!r}, recompute={self.recompute.value!r}): the {named.name} schedule splits each "
                              "backward into one autograd call per group of weights, and a recomputed layer would run "
                              f"its forward again in each; use recompute with {others}")
        if self.virtual_stages is not None and self.virtual_stages < 1:
            raise ConfigError(f"Pipeline(virtual_stages={self.virtual_stages}): need at least one stage per rank")
        if self.virtual_stages is not None and self.virtual_stages > 1:
            interleaving = [s for s in SCHEDULES.values() if s.interleaved]
            if named is not None and not named.interleaved:
                raise ConfigError(f"Pipeline(virtual_stages={self.virtual_stages}) runs several stages per rank: only "
                                  f"schedule={listed(interleaving)} does that, not {self.schedule!r}")
            named = named or interleaving[0]
            object.__setattr__(self, "schedule", named.name)
        if named is not None and named.interleaved and self.virtual_stages in (None, 1):
            object.__setattr__(self, "virtual_stages", named.virtual_stages)


AXES_OPTIONS = ("idle_axes", "identical_axes")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """The planning options (every field keyword-only, each with its default).

    memory_budget: bytes per device (int/float) or a string like "40GB"/"512MiB"; None: no limit;
        "auto" (default): the cluster's device memory where that is a hard limit (the GPU presets:
        80 GB; ``plan.solver["memory_budget_from"]`` says so), else no limit (cpu-gloo).
    cluster: a preset name ("a100-80g", "h100-80g", "cpu-gloo"), a JSON file or a ClusterSpec to
        price with, instead of the mesh's own (``Mesh(..., cluster=)``; default cpu-gloo;
        ``parallelize`` profiles the live groups when the mesh has none).
    pipeline: "auto" (default): search pipeline stages too (``autopar.solver.pipeline``), one
        stage allowed; it plans one stage where no pipeline can be searched (no batch among the
        example inputs, a mesh whose slowest axis has one row, a forced ``Layout``, a model with no
        layers to cut). A ``Pipeline``: search with its given fields fixed. None / False: one stage.
    force: an ``autopar.Layout`` (e.g. ``Layout(dp=2, tp=2, zero=2)``): the plan of that
        hand-style layout, on every mesh axis (but those a tuple of ``idle_axes`` names); or node name -> family label (e.g. ``{"linear":
        "1d-row", "p_fc_weight": "sharded"}``) or -> a predicate on a ``Strategy``: restricts that
        node's candidates (hand-written plans, tests).
    optimizer: the optimizer whose states are priced: "adamw" / "adam" (2 fp32 values a parameter),
        "sgd_momentum" / "momentum" (1), "sgd" (0).
    idle_axes: mesh axes the plan may leave unused (every rank along them computes the same thing
        and needs no gradient sync there): "auto" tries the candidates of ``idle_candidates`` and
        keeps the cheapest; a tuple fixes them (``()``: use every axis).
    identical_axes: mesh axes on which gradients of replicated values are kept whole on every rank
        (Megatron's tensor-parallel convention; ``autopar.record.gradients``), each set priced in
        its own ILP: "auto" solves the dual convention first, then every set of the axes its plan
        communicates over in backward besides gradient syncs (tensor parallelism, batch-norm
        statistics), and keeps the cheapest; a tuple fixes it (``()``: none). Pipeline stages
        keep the dual convention.
    bucket_bytes: the gradient bucket size, priced and (in ``parallelize``) run.
    time_limit_s, solver: the ILP solver's time limit and name ("highs" / "cbc"; None: HiGHS
        where installed).
    precision: None (default): the model's own dtypes, nothing cast; "bf16" / "fp16": the forward
        and backward in 16 bits on a working copy of fp32 masters, which the optimizer updates;
        "fp32"; or ``autopar.MixedPrecision(param_dtype, reduce_dtype, master_dtype)``
        (``autopar.ir.precision``). The plan is traced and priced as it computes. "fp16" trains
        with ``autopar.GradScaler`` (loss scaling whose overflow check every rank agrees on).

    For the planner's own callers (the pipeline search, the what-if pricing, tests):
    op_table: profiled op times (``parallelize`` measures them on the live ranks).
    reuse_blocks: tie structurally identical layers: solve one block, reuse it.
    simplify: eliminate chain nodes exactly before solving.
    optimizer_sharding: allow ZeRO-2 choices.
    microbatches: how many times a step runs the traced graph (gradient sync and the optimizer are
        priced at 1 / microbatches of a run).
    objective_cutoff_s: a plan whose objective (a run of the graph priced, op overheads included) is
        above this is of no use:
        ``ilp.NoCheaperPlan`` instead, found quickly.
    """

    memory_budget: object = "auto"
    cluster: object = None
    pipeline: object = "auto"
    force: object = None
    optimizer: str = "adamw"
    idle_axes: object = "auto"
    identical_axes: object = "auto"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    time_limit_s: float = 60.0
    solver: str | None = None
    precision: object = None
    op_table: object = None
    reuse_blocks: bool = True
    simplify: bool = True
    optimizer_sharding: bool = True
    microbatches: int = 1
    objective_cutoff_s: float | None = None
    # where backward hides gradient syncs, search between charging them and hiding them until the
    # step is proven optimal (``intra_op._solve_overlapped``); False: one ILP (the pipeline search's)
    prove_overlap: bool = True

    def __post_init__(self):
        if self.pipeline is False:
            object.__setattr__(self, "pipeline", None)
        if self.pipeline not in (None, "auto") and not isinstance(self.pipeline, Pipeline):
            raise ConfigError(f"pipeline={self.pipeline!r}: use None/False (one stage), 'auto' or autopar.Pipeline(...)")
        if self.force is not None and not isinstance(self.force, (Layout, dict)):
            raise ConfigError(f"force={self.force!r}: use an autopar.Layout or a dict of node name -> family")
        if not isinstance(self.optimizer, str) or self.optimizer.lower() not in OPTIMIZER_STATES:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
        for name in AXES_OPTIONS:
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, ())
            elif value != "auto":
                if isinstance(value, (int, str)) or not hasattr(value, "__iter__"):
                    raise ConfigError(f"{name}={value!r}: use 'auto' or a tuple of mesh axes (indices or names)")
                object.__setattr__(self, name, tuple(value))
        if self.bucket_bytes is None:
            object.__setattr__(self, "bucket_bytes", DEFAULT_BUCKET_BYTES)
        if not isinstance(self.bucket_bytes, int) or isinstance(self.bucket_bytes, bool) or self.bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes={self.bucket_bytes!r}: use a positive number of bytes")
        if not self.time_limit_s > 0:
            raise ConfigError(f"time_limit_s={self.time_limit_s!r}: use a positive number of seconds")
        if self.solver not in (None, "highs", "cbc"):
            raise ConfigError(f"unknown ILP solver {self.solver!r}; use 'highs' (needs highspy), 'cbc', or None for "
                              "the best available")
        object.__setattr__(self, "precision", policy(self.precision))
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError(f"microbatches={self.microbatches!r}: use a positive count")

    @classmethod
    def of(cls, config: PlanConfig | None = None, **options) -> PlanConfig:
        """``config`` (default: every option at its default) with ``options`` changed; an option
        that is not a field is a ConfigError naming the fields."""
        if config is not None and not isinstance(config, cls):
            raise ConfigError(f"config must be an autopar.PlanConfig, got {type(config).__name__}")
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise ConfigError(f"unknown planning option(s) {', '.join(unknown)}; the options are the fields of "
                              f"autopar.PlanConfig: {', '.join(OPTION_NAMES)}")
        base = config if config is not None else cls()
        return dataclasses.replace(base, **options) if options else base

    def replace(self, **changes) -> PlanConfig:
        """This config with ``changes`` (checked like ``of``)."""
        return PlanConfig.of(self, **changes)

    @property
    def searched_pipeline(self) -> Pipeline | None:
        """The pipeline fields to search with: ``pipeline`` itself, every field free for "auto",
        None for one stage."""
        return Pipeline() if self.pipeline == "auto" else self.pipeline


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PlanConfig))
# the options users set (``plan``'s doc, the CLI's flags); the rest serve the planner's own callers
USER_OPTIONS = OPTION_NAMES[:OPTION_NAMES.index("op_table")]
