"""The Plan: one serializable artifact that explain, codegen, benchmarks and tests all read.

JSON with a schema version. Specs are stored with their shapes so they load back exactly.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

from autopar.record.gradients import whole_on
from autopar.cost_model.schedules import bubble_fraction
from autopar.errors import AutoparError, PlanError
from autopar.record.grad_sync import GradSync
from autopar.record.recompute import Recompute
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import Family
from autopar.solver.diff import diff as diff_plans
from autopar.solver.explain import axis_roles, explain as explain_plan, throughput

# 2: pipeline stages (version-1 files load as one-stage plans); 3: identical-gradient axes (an
# older reader would run such a plan with the wrong gradient convention, so it must refuse it);
# 4: each stage's reshards of the values it receives (``StagePlan.received``; older files load
# without them, and ``solver.receives.with_received`` computes them from the graph); 5: a parameter's
# gradient sync as an object (``GradSync``; older files spelt it ``[kind, axes, bytes]``, read as such);
# 6: a stage's recomputation may be selective (``StagePlan.selective``: an older reader would run
# it whole, against its memory and time, so it must refuse it; older files read as whole)
SCHEMA_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)

# The backward of each resharding step under the dual-layout gradient convention.
BACKWARD_OF = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "slice": None,
    "to_partial": None,
}
# ... and on identical-gradient axes (the backward all-reduces of grad_sum are not steps of an edge)
BACKWARD_OF_WHOLE = {
    "all_gather": None,
    "reduce_scatter": "all_gather",
    "all_reduce": None,
    "all_to_all": "all_to_all",
    "slice": "all_gather",
    "to_partial": None,
}


def spec_to_json(spec):
    if spec is None:
        return None
    if isinstance(spec, tuple):
        return {"tuple": [spec_to_json(s) for s in spec]}
    return spec.to_dict()


def spec_from_json(d):
    if d is None:
        return None
    if "tuple" in d:
        return tuple(spec_from_json(x) for x in d["tuple"])
    return ShardingSpec.from_dict(d)


@dataclasses.dataclass
class NodePlan:
    name: str
    target: str
    layer: str | None
    family: Family
    inputs: list  # ShardingSpec | None per node input
    output: object  # ShardingSpec | tuple | None
    compute_s: float
    memory_bytes: float
    peak_bytes: float = 0.0  # the part of memory_bytes held only at the step's peak, once per stage

    def __post_init__(self):
        self.family = Family(self.family)


@dataclasses.dataclass
class StepPlan:
    kind: str
    axes: tuple[int, ...]
    nbytes: int
    cost_s: float
    src_dim: int | None = None
    dst_dim: int | None = None


@dataclasses.dataclass
class EdgePlan:
    src: str
    dst: str
    position: int
    src_spec: ShardingSpec
    dst_spec: ShardingSpec
    steps: list[StepPlan]
    backward: bool  # whether a gradient flows back over this edge (its duals run in backward)

    @property
    def forward_s(self) -> float:
        return sum(s.cost_s for s in self.steps)

    @property
    def cost_s(self) -> float:
        return self.forward_s * (2 if self.backward else 1)

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "position": self.position, "backward": self.backward,
                "src_spec": spec_to_json(self.src_spec), "dst_spec": spec_to_json(self.dst_spec),
                "steps": [dataclasses.asdict(s) for s in self.steps]}

    @staticmethod
    def from_json(e: dict) -> "EdgePlan":
        steps = [StepPlan(**{**s, "axes": tuple(s["axes"])}) for s in e["steps"]]
        return EdgePlan(e["src"], e["dst"], e["position"], spec_from_json(e["src_spec"]), spec_from_json(e["dst_spec"]),
                        steps, e["backward"])


@dataclasses.dataclass
class ParamPlan:
    name: str  # canonical fqn
    node: str
    storage: ShardingSpec
    family: Family  # replicated | sharded | zero2 | sharded+zero2
    grad_sync: GradSync | None  # how its gradient is synchronised each step, or None
    grad_sync_s: float
    aliases: tuple[str, ...] = ()
    buffer: bool = False
    accumulate_s: float = 0.0  # adding its gradient up, per run of the graph (``cost_model.step.accumulate_s``)

    def __post_init__(self):
        self.family = Family(self.family)


@dataclasses.dataclass
class StagePlan:
    """One pipeline stage: a contiguous range of the traced layers on a block of mesh rows, with
    its own intra-op plan (on the stage's sub-mesh, over the nodes the stage runs)."""

    layers: tuple[int, int]  # first and last layer index (into the model's layer list)
    layer_names: tuple[str, str]
    rows: tuple[int, int]  # first and last row of mesh axis 0
    ranks: list[int]
    mesh_shape: tuple[int, ...]
    time_per_microbatch_s: float
    memory_bytes: float
    plan: "Plan"
    recompute: list = dataclasses.field(default_factory=list)  # the layers recomputed in backward
    # The reshards of the values it receives from earlier stages, per read (``autopar.solver.receives``);
    # None where a plan file predates them.
    received: list[EdgePlan] | None = None
    selective: bool = False  # recomputed selectively (``record.recompute``), not whole

    @property
    def recomputed(self) -> Recompute:
        """How the stage's layers are recomputed."""
        if not self.recompute:
            return Recompute.NONE
        return Recompute.SELECTIVE if self.selective else Recompute.FULL

    def to_json(self) -> dict:
        return {"layers": list(self.layers), "layer_names": list(self.layer_names), "rows": list(self.rows),
                "ranks": list(self.ranks), "mesh_shape": list(self.mesh_shape), "recompute": list(self.recompute),
                "time_per_microbatch_s": self.time_per_microbatch_s, "memory_bytes": self.memory_bytes,
                "plan": self.plan.to_json(),
                "received": None if self.received is None else [e.to_json() for e in self.received],
                "selective": self.selective}

    @staticmethod
    def from_json(d: dict) -> "StagePlan":
        received = d.get("received")
        return StagePlan(tuple(d["layers"]), tuple(d["layer_names"]), tuple(d["rows"]), list(d["ranks"]),
                         tuple(d["mesh_shape"]), d["time_per_microbatch_s"], d["memory_bytes"],
                         Plan.from_json(d["plan"]), list(d.get("recompute", [])),
                         None if received is None else [EdgePlan.from_json(e) for e in received],
                         bool(d.get("selective", False)))


@dataclasses.dataclass
class PipelinePlan:
    """The stages, in pipeline order, and how microbatches flow through them."""

    schedule: str
    microbatches: int
    stages: list[StagePlan]
    virtual_stages: int = 1  # stages per rank (interleaved 1F1B): stage s runs on rank block s mod (stages / this)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of a step (``schedules.bubble_fraction``)."""
        return bubble_fraction([s.time_per_microbatch_s for s in self.stages], self.microbatches, self.schedule,
                               self.virtual_stages)

    def memory_per_device(self) -> float:
        """The most any device holds: the sum over the stages its block of ranks runs."""
        per_block: dict = {}
        for s in self.stages:
            per_block[tuple(s.ranks)] = per_block.get(tuple(s.ranks), 0.0) + s.memory_bytes
        return max(per_block.values())

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "virtual_stages": self.virtual_stages,
                "stages": [s.to_json() for s in self.stages]}

    @staticmethod
    def from_json(d: dict) -> "PipelinePlan":
        return PipelinePlan(d["schedule"], d["microbatches"], [StagePlan.from_json(s) for s in d["stages"]],
                            int(d.get("virtual_stages", 1)))


@dataclasses.dataclass
class Plan:
    model_name: str
    model_fingerprint: str
    mesh: dict
    nodes: dict[str, NodePlan]
    edges: list[EdgePlan]
    params: dict[str, ParamPlan]
    predicted: dict
    solver: dict
    schema_version: int = SCHEMA_VERSION
    # Mesh axes the plan leaves unused: every rank along them computes the same thing (redundant
    # compute), so their gradients agree and need no synchronisation.
    idle_axes: tuple[int, ...] = ()
    # Mesh axes on which gradients of replicated values are whole on every rank (Megatron's
    # tensor-parallel convention) instead of pending sums: see autopar.cost_model.gradients.
    identical_axes: tuple[int, ...] = ()
    # None: one stage (nodes, edges and params above). Else the stages, each with its own plan;
    # the fields above are then empty and the fingerprint is the microbatch graph's.
    pipeline: PipelinePlan | None = None
    # The mixed-precision recipe the plan runs (``autopar.MixedPrecision.to_dict()``: working,
    # reduction and master dtypes); None: the model's own dtypes, nothing cast.
    precision: dict | None = None

    # ---- reading ----------------------------------------------------------------------------
    def stage_plans(self) -> list["Plan"]:
        """Each stage's intra-op plan, in pipeline order (this plan itself when it has one stage)."""
        return [self] if self.pipeline is None else [s.plan for s in self.pipeline.stages]

    def pipeline_summary(self) -> dict:
        """``summary()["pipeline"]``: stages (layers, ranks, mesh shape, recomputed layers),
        schedule, microbatches and bubble; one stage over every layer and rank when not pipelined."""
        if self.pipeline is None:
            layers = list(dict.fromkeys(n.layer for n in self.nodes.values() if n.layer is not None))
            size = 1
            for s in self.mesh["shape"]:
                size *= s
            return {"stages": [{"layers": [0, max(len(layers) - 1, 0)], "ranks": list(range(size)),
                                "mesh_shape": list(self.mesh["shape"]), "recompute": [], "recompute_kind": "none"}],
                    "schedule": None, "microbatches": 1, "virtual_stages": 1, "bubble_fraction": 0.0}
        p = self.pipeline
        return {"stages": [{"layers": list(s.layers), "layer_names": list(s.layer_names), "ranks": list(s.ranks),
                            "mesh_shape": list(s.mesh_shape), "recompute": list(s.recompute),
                            "recompute_kind": s.recomputed.value, "time_per_microbatch_s": s.time_per_microbatch_s, "memory_bytes": s.memory_bytes}
                           for s in p.stages],
                "schedule": p.schedule, "microbatches": p.microbatches, "virtual_stages": p.virtual_stages,
                "bubble_fraction": p.bubble_fraction}

    @property
    def mesh_obj(self):
        return Mesh.from_dict(self.mesh)

    def collectives(self) -> list[tuple[str, tuple[int, ...], int]]:
        """Every collective of one training step: forward reshards, their backward duals, and
        gradient synchronisation (of one microbatch, per stage, for a pipelined plan)."""
        if self.pipeline is not None:
            return [c for p in self.stage_plans() for c in p.collectives()]
        out = []
        for e in self.edges:
            for s in e.steps:
                if s.kind in ("slice", "to_partial"):
                    continue
                out.append((s.kind, tuple(s.axes), int(s.nbytes)))
            if e.backward:
                for s in reversed(e.steps):
                    kind = (BACKWARD_OF_WHOLE if whole_on(s.axes, self.identical_axes) else BACKWARD_OF)[s.kind]
                    if kind is not None:
                        out.append((kind, tuple(s.axes), int(s.nbytes)))
        for p in self.params.values():
            if p.grad_sync is not None:
                out += [(k, p.grad_sync.axes, int(p.grad_sync.nbytes)) for k in p.grad_sync.collectives]
        return out

    def summary(self) -> dict:
        stages = self.stage_plans()
        families = Counter(n.family for p in stages for n in p.nodes.values() if n.target not in ("placeholder", "output"))
        storage = Counter(p.family for plan in stages for p in plan.params.values() if not p.buffer)
        return {
            "step_time_s": self.predicted["step_time_s"],
            "compute_s": self.predicted["compute_s"],
            "comm_s": self.predicted["comm_s"],
            "memory_bytes_per_device": self.predicted["memory_bytes_per_device"],
            "families": dict(families),
            "param_storage": dict(storage),
            "collectives": self.collectives(),
            "pipeline": self.pipeline_summary(),
            **self.degrees(),
            **throughput(self),  # mfu, model_flops, tokens (or samples) per second per device
        }

    def degrees(self) -> dict:
        """``{"tp": ..., "sp": ..., "dp": ..., "pp": ...}``: tensor-, sequence- and data-parallel
        degrees (the product of the mesh axes in that role, as ``explain`` names them: an axis
        splitting the blocks' weights is tensor parallel, one splitting only their tokens
        sequence parallel) and the pipeline stages; tp, sp and dp are None when the stages lay
        their axes out differently."""
        per_stage = set()
        for p in self.stage_plans():
            roles = axis_roles(p)
            shape = p.mesh["shape"]
            per_stage.add(tuple(math.prod(shape[a] for a, r in roles.items() if r == role)
                                for role in ("tensor", "sequence", "data")))
        tp, sp, dp = per_stage.pop() if len(per_stage) == 1 else (None, None, None)
        pp = 1 if self.pipeline is None else len(self.pipeline.stages) // self.pipeline.virtual_stages
        return {"tp": tp, "sp": sp, "dp": dp, "pp": pp}

    def explain(self, **kw) -> str:
        """A readable account of the plan (``autopar.solver.explain.explain``)."""
        return explain_plan(self, **kw)

    def diff(self, other: "Plan"):
        """What changes from this plan to ``other`` (``autopar.solver.diff.PlanDiff``; ``.lines()``)."""
        return diff_plans(self, other)

    def check_model(self, fingerprint: str, model_name: str = "") -> None:
        if fingerprint != self.model_fingerprint:
            raise PlanError(
                f"this plan was made for model {self.model_name!r} (fingerprint {self.model_fingerprint[:12]}), "
                f"not for {model_name or 'this model'} (fingerprint {fingerprint[:12]}): its graph, shapes or parameter "
                "names differ. Make a new plan with autopar.plan() for this model and these example inputs."
            )

    # ---- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "model_name": self.model_name,
            "model_fingerprint": self.model_fingerprint,
            "mesh": self.mesh,
            "idle_axes": list(self.idle_axes),
            "identical_axes": list(self.identical_axes),
            "predicted": self.predicted,
            "solver": self.solver,
            "nodes": [
                {**dataclasses.asdict(n), "inputs": [spec_to_json(s) for s in n.inputs], "output": spec_to_json(n.output)}
                for n in self.nodes.values()
            ],
            "edges": [e.to_json() for e in self.edges],
            "params": [
                {**dataclasses.asdict(p), "storage": spec_to_json(p.storage),
                 "grad_sync": None if p.grad_sync is None else p.grad_sync.to_json()} for p in self.params.values()
            ],
            "pipeline": None if self.pipeline is None else self.pipeline.to_json(),
            "precision": self.precision,
        }

    @staticmethod
    def from_json(d: dict) -> "Plan":
        version = d.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise PlanError(f"plan file has schema version {version}, this autopar reads versions {list(READABLE_VERSIONS)}; "
                            "re-create the plan")
        nodes = {}
        for n in d["nodes"]:
            n = dict(n)
            n["inputs"] = [spec_from_json(s) for s in n["inputs"]]
            n["output"] = spec_from_json(n["output"])
            nodes[n["name"]] = NodePlan(**n)
        edges = [EdgePlan.from_json(e) for e in d["edges"]]
        params = {}
        for p in d["params"]:
            p = dict(p)
            p["storage"] = spec_from_json(p["storage"])
            p["aliases"] = tuple(p["aliases"])
            p["grad_sync"] = GradSync.from_json(p["grad_sync"])
            params[p["name"]] = ParamPlan(**p)
        pipeline = PipelinePlan.from_json(d["pipeline"]) if d.get("pipeline") else None
        return Plan(d["model_name"], d["model_fingerprint"], d["mesh"], nodes, edges, params, d["predicted"], d["solver"],
                    SCHEMA_VERSION, tuple(d.get("idle_axes", ())), tuple(d.get("identical_axes", ())), pipeline,
                    d.get("precision"))

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @staticmethod
    def load(path) -> "Plan":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"plan file {str(path)!r} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"plan file {str(path)!r} is not valid JSON ({e})") from None
        except OSError as e:
            raise PlanError(f"cannot read plan file {str(path)!r}: {e}") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan file {str(path)!r} is not an autopar plan (a JSON object was expected)")
        try:
            return Plan.from_json(data)
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, AutoparError) as e:
            raise PlanError(f"plan file {str(path)!r} is not an autopar plan ({e!r})") from None

    def __eq__(self, other) -> bool:
        # as JSON: a loaded plan holds lists where a fresh one may hold tuples
        return isinstance(other, Plan) and json.dumps(self.to_json(), sort_keys=True) == json.dumps(other.to_json(), sort_keys=True)
