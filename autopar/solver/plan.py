"""The Plan: one serializable artifact that explain, codegen, benchmarks and tests all read.

JSON with a schema version. Specs are stored with their shapes so they load back exactly.
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

from autopar.errors import AutoparError, PlanError
from autopar.sharding_spec.spec import ShardingSpec

SCHEMA_VERSION = 1

# The backward of each resharding step under the dual-layout gradient convention.
BACKWARD_OF = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "slice": None,
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


def spec_str(spec) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, tuple):
        return "(" + ", ".join(spec_str(s) for s in spec) + ")"
    return spec.notation()


@dataclasses.dataclass
class NodePlan:
    name: str
    target: str
    layer: str | None
    family: str
    inputs: list  # ShardingSpec | None per node input
    output: object  # ShardingSpec | tuple | None
    compute_s: float
    memory_bytes: float


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


@dataclasses.dataclass
class ParamPlan:
    name: str  # canonical fqn
    node: str
    storage: ShardingSpec
    family: str  # replicated | sharded | zero2 | sharded+zero2
    grad_sync: tuple | None  # (kind, axes, bytes) per step, or None
    grad_sync_s: float
    aliases: tuple[str, ...] = ()
    buffer: bool = False


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

    # ---- reading ----------------------------------------------------------------------------
    @property
    def mesh_obj(self):
        from autopar.sharding_spec.mesh import Mesh

        return Mesh.from_dict(self.mesh)

    def collectives(self) -> list[tuple[str, tuple[int, ...], int]]:
        """Every collective of one training step: forward reshards, their backward duals, and
        gradient synchronisation."""
        out = []
        for e in self.edges:
            for s in e.steps:
                if s.kind in ("slice", "to_partial"):
                    continue
                out.append((s.kind, tuple(s.axes), int(s.nbytes)))
            if e.backward:
                for s in reversed(e.steps):
                    kind = BACKWARD_OF[s.kind]
                    if kind is not None:
                        out.append((kind, tuple(s.axes), int(s.nbytes)))
        for p in self.params.values():
            if p.grad_sync is not None:
                kind, axes, nbytes = p.grad_sync
                for k in kind.split("+"):
                    out.append((k, tuple(axes), int(nbytes)))
        return out

    def summary(self) -> dict:
        families = Counter(n.family for n in self.nodes.values() if n.target not in ("placeholder", "output"))
        return {
            "step_time_s": self.predicted["step_time_s"],
            "compute_s": self.predicted["compute_s"],
            "comm_s": self.predicted["comm_s"],
            "memory_bytes_per_device": self.predicted["memory_bytes_per_device"],
            "families": dict(families),
            "param_storage": dict(Counter(p.family for p in self.params.values() if not p.buffer)),
            "collectives": self.collectives(),
        }

    def explain(self, **kw) -> str:
        from autopar.solver.explain import explain

        return explain(self, **kw)

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
            "predicted": self.predicted,
            "solver": self.solver,
            "nodes": [
                {**dataclasses.asdict(n), "inputs": [spec_to_json(s) for s in n.inputs], "output": spec_to_json(n.output)}
                for n in self.nodes.values()
            ],
            "edges": [
                {
                    "src": e.src, "dst": e.dst, "position": e.position, "backward": e.backward,
                    "src_spec": spec_to_json(e.src_spec), "dst_spec": spec_to_json(e.dst_spec),
                    "steps": [dataclasses.asdict(s) for s in e.steps],
                }
                for e in self.edges
            ],
            "params": [
                {**dataclasses.asdict(p), "storage": spec_to_json(p.storage)} for p in self.params.values()
            ],
        }

    @staticmethod
    def from_json(d: dict) -> "Plan":
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(f"plan file has schema version {version}, this autopar reads version {SCHEMA_VERSION}; re-create the plan")
        nodes = {}
        for n in d["nodes"]:
            n = dict(n)
            n["inputs"] = [spec_from_json(s) for s in n["inputs"]]
            n["output"] = spec_from_json(n["output"])
            nodes[n["name"]] = NodePlan(**n)
        edges = []
        for e in d["edges"]:
            steps = [StepPlan(**{**s, "axes": tuple(s["axes"])}) for s in e["steps"]]
            edges.append(EdgePlan(e["src"], e["dst"], e["position"], spec_from_json(e["src_spec"]), spec_from_json(e["dst_spec"]), steps, e["backward"]))
        params = {}
        for p in d["params"]:
            p = dict(p)
            p["storage"] = spec_from_json(p["storage"])
            p["aliases"] = tuple(p["aliases"])
            if p["grad_sync"] is not None:
                kind, axes, nbytes = p["grad_sync"]
                p["grad_sync"] = (kind, tuple(axes), nbytes)
            params[p["name"]] = ParamPlan(**p)
        return Plan(d["model_name"], d["model_fingerprint"], d["mesh"], nodes, edges, params, d["predicted"], d["solver"], version,
                    tuple(d.get("idle_axes", ())))

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
        return isinstance(other, Plan) and self.to_json() == other.to_json()
