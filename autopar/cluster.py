"""Device and cluster specs: what one device can do and how fast its links are.

A ClusterSpec is a frozen record, so a Mesh that holds one stays hashable and plans can be
cached per mesh. Link speeds follow the alpha-beta model: sending a message of b bytes over
one hop costs ``alpha + b * beta`` seconds (alpha: latency in s, beta: s per byte).

Which link a mesh axis uses: the last mesh axis is the fastest. An axis whose group, together
with all axes after it, fits inside one node (``devices_per_node``) talks over the intra-node
link; any other axis crosses nodes. ``axis_links`` overrides that per axis.

This is a description of the hardware (data), not a price: it sits below every layer, so a
``Mesh`` (``autopar.sharding_spec``) can hold one, and ``autopar.cost_model`` prices with it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from autopar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link. alpha: seconds per message hop; beta: seconds per byte."""

    alpha: float
    beta: float

    def __post_init__(self):
        if not (self.alpha >= 0 and self.beta >= 0 and math.isfinite(self.alpha) and math.isfinite(self.beta)):
            raise ConfigError(f"a link needs finite alpha >= 0 and beta >= 0, got alpha={self.alpha}, beta={self.beta}")

    @property
    def bandwidth(self) -> float:
        """Bytes per second (inf for a free link)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster.

    name: preset name or the file it came from.
    peak_flops: FLOP/s of one device per dtype name ("float32", "bfloat16", "float16").
    memory_bandwidth: bytes/s between a device and its memory.
    memory_bytes: memory of one device.
    devices_per_node: devices sharing the fast intra-node link.
    intra_node / inter_node: the two link kinds.
    axis_links: optional explicit link per mesh axis (overrides the node rule); its length must
      equal the mesh's number of axes.
    source: where the numbers come from.
    collective_factors: optional per collective kind, factors on (alpha, beta), written
      ``{"reduce_scatter": {"alpha": 1.6, "beta": 2.7}}``: how much slower (or faster) than the
      ring model a backend runs that kind (gloo's reduce_scatter, for one). Kinds not listed use
      (1, 1); the GPU presets list none (NCCL follows the ring model), cpu-gloo lists gloo's.
      Fitted by ``profile_comm``; applied by ``comm.mesh_collective_time``.
    scalar_all_reduce_alphas: the alphas (all_reduce's factor applied) one all_reduce of a single
      value (a loss, a count: at most 8 bytes) pays, where the backend does not run its ring for it
      (gloo: about 1-1.6 where the ring pays 2n - 1); None: the ring model. Fitted by
      ``profile_comm``; applied by ``comm.mesh_collective_time``.
    op_overhead_s / backward_op_overhead_s: framework time per op run eagerly (dispatch, autograd
      bookkeeping), forward and backward; paid by every op, views included, on top of its roofline.
    optimizer_s_per_element / optimizer_s_per_tensor: one AdamW step's time per local parameter
      element and per parameter tensor.
    comm_overlap: the share of the backward compute still to run that hides a gradient bucket's
      collective (1: a copy engine / spare cores run it alongside; 0: it competes for the same cores).
    collective_overhead_s: extra seconds per collective call in a real step over the profiled
      alpha-beta time: ranks reach it from compute, at slightly different times (on shared cores,
      after the OS runs a descheduled peer), while the profile times calls right after a barrier.
    rank_contention: how much slower an op runs while every rank on its host computes than alone
      (ranks sharing CPU cores); profiled op times already include it.
    compute_efficiency: the share of ``peak_flops`` that large matmuls sustain (the roofline's
      arithmetic rate is peak x this); profiled op times replace the roofline where they exist.
    memory_efficiency: likewise the share of ``memory_bandwidth`` that large elementwise kernels
      sustain (the roofline's memory rate is ``memory_bandwidth`` x this).
    fresh_memory_bandwidth: bytes/s written into memory just allocated, where the allocator hands a
      large tensor new pages each time and the OS maps and zeroes them on first touch (glibc past
      its mmap threshold: 3x slower than a warm write with 4 ranks on 2 cores); 0: as fast as a
      warm write (a GPU's caching allocator keeps its blocks).
    in_situ_factor: how much longer a model's own forward and backward run than the sum of its
      ops profiled one by one (hot inputs, no allocation, no neighbours evicting the caches);
      multiplies profiled op times (``compute.node_time``). ``parallelize`` measures it on the
      model it plans (``live_profile.in_situ_factor``) and scales the per-op overheads with it.
    memory_is_budget: whether ``memory_bytes`` bounds a plan when the caller gives no budget (a
      GPU's memory is a hard limit; a CPU host's is shared by its ranks and swaps).
    measured_spread: how far the live host's measurement may be off, relative (the rank
      contention's standard error; 0 for a preset): a plan with more parts must be predicted faster
      than the plain one by more than this to be chosen (``solver.api.simpler_unless_faster``), so
      the moment's noise does not decide near a tie.
    Live profiles (``autopar.parallelize``) measure the overheads, the optimizer's costs, the
    overlap, the collective overhead, the contention and the in-situ factor; presets estimate them,
    and the two efficiencies (profiled op times replace the roofline where they exist).
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bandwidth: float
    memory_bytes: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    axis_links: tuple[Link, ...] | None = None
    source: str = ""
    collective_factors: tuple[tuple[str, float, float], ...] = ()
    scalar_all_reduce_alphas: float | None = None
    op_overhead_s: float = 0.0
    backward_op_overhead_s: float = 0.0
    optimizer_s_per_element: float = 0.0
    optimizer_s_per_tensor: float = 0.0
    comm_overlap: float = 1.0
    collective_overhead_s: float = 0.0
    rank_contention: float = 1.0
    compute_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    in_situ_factor: float = 1.0
    memory_is_budget: bool = True
    measured_spread: float = 0.0
    fresh_memory_bandwidth: float = 0.0

    def __post_init__(self):
        # Canonical order (by dtype name), as from_dict builds it, so a to_dict/from_dict round
        # trip gives an equal (and equally hashed) spec, and meshes holding it stay cache keys.
        object.__setattr__(self, "peak_flops", tuple(sorted(self.peak_flops)))
        factors = tuple(sorted((str(k), float(a), float(b)) for k, a, b in self.collective_factors))
        object.__setattr__(self, "collective_factors", factors)
        if any(not (v > 0 and math.isfinite(v)) for _, a, b in factors for v in (a, b)):
            raise ConfigError(f"cluster {self.name!r}: collective_factors need finite factors > 0, got {factors}")
        if self.scalar_all_reduce_alphas is not None and not (0 < self.scalar_all_reduce_alphas < math.inf):
            raise ConfigError(f"cluster {self.name!r}: scalar_all_reduce_alphas must be finite and > 0 (or None), "
                              f"got {self.scalar_all_reduce_alphas}")
        timings = (self.op_overhead_s, self.backward_op_overhead_s, self.optimizer_s_per_element, self.optimizer_s_per_tensor,
               self.collective_overhead_s, self.fresh_memory_bandwidth)
        if any(not (v >= 0 and math.isfinite(v)) for v in timings) or not 0 <= self.comm_overlap <= 1 \
                or not (1 <= self.rank_contention < math.inf):
            raise ConfigError(f"cluster {self.name!r}: overheads must be finite and >= 0, comm_overlap in [0, 1] "
                              "and rank_contention >= 1")
        if self.devices_per_node < 1:
            raise ConfigError(f"cluster {self.name!r}: devices_per_node must be >= 1, got {self.devices_per_node}")
        if self.memory_bandwidth <= 0 or self.memory_bytes <= 0:
            raise ConfigError(f"cluster {self.name!r}: memory_bandwidth and memory_bytes must be > 0")
        if not (0 < self.in_situ_factor < math.inf):
            raise ConfigError(f"cluster {self.name!r}: in_situ_factor must be finite and > 0, got {self.in_situ_factor}")
        for field in ("compute_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ConfigError(f"cluster {self.name!r}: {field} must be in (0, 1], got {getattr(self, field)}")
        if not self.peak_flops or any(v <= 0 for _, v in self.peak_flops):
            raise ConfigError(f"cluster {self.name!r}: peak_flops needs a positive FLOP/s per dtype")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype name; float32's figure for dtypes not listed."""
        table = dict(self.peak_flops)
        return table.get(dtype, table.get("float32", max(table.values())))

    def flops(self, dtype: str) -> float:
        """Sustained FLOP/s for a dtype name (``peak`` x ``compute_efficiency``)."""
        return self.peak(dtype) * self.compute_efficiency

    @property
    def sustained_memory_bandwidth(self) -> float:
        """Bytes/s large memory-bound kernels sustain (``memory_bandwidth`` x ``memory_efficiency``)."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def fresh_write_bandwidth(self) -> float:
        """Bytes/s written into a freshly allocated large tensor (``fresh_memory_bandwidth``, or
        the sustained rate where that is not measured)."""
        return self.fresh_memory_bandwidth or self.sustained_memory_bandwidth

    def collective_factor(self, kind: str) -> tuple[float, float]:
        """(alpha factor, beta factor) of collective ``kind``; (1.0, 1.0) when not listed."""
        for k, a, b in self.collective_factors:
            if k == kind:
                return a, b
        return 1.0, 1.0

    def links_for(self, mesh_shape: tuple[int, ...]) -> tuple[Link, ...]:
        """The link each mesh axis uses (see the module docstring)."""
        if self.axis_links is not None:
            if len(self.axis_links) != len(mesh_shape):
                raise ConfigError(
                    f"cluster {self.name!r} gives {len(self.axis_links)} axis_links but the mesh has "
                    f"{len(mesh_shape)} axes {tuple(mesh_shape)}; give one link per mesh axis"
                )
            return self.axis_links
        links = []
        inner = 1
        for size in reversed(mesh_shape):
            inner *= size
            links.append(self.intra_node if inner <= self.devices_per_node else self.inter_node)
        return tuple(reversed(links))

    def with_axis_links(self, links) -> "ClusterSpec":
        return dataclasses.replace(self, axis_links=tuple(links))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["peak_flops"] = dict(self.peak_flops)
        d["collective_factors"] = {k: {"alpha": a, "beta": b} for k, a, b in self.collective_factors}
        if d["axis_links"] is not None:  # a list, as JSON gives it back (plans compare equal after a round trip)
            d["axis_links"] = list(d["axis_links"])
        return d

    @staticmethod
    def from_dict(d: dict) -> "ClusterSpec":
        try:
            d = dict(d)
            d["peak_flops"] = tuple(sorted((str(k), float(v)) for k, v in d["peak_flops"].items()))
            d["intra_node"] = Link(**d["intra_node"])
            d["inter_node"] = Link(**d["inter_node"])
            if d.get("axis_links") is not None:
                d["axis_links"] = tuple(Link(**x) for x in d["axis_links"])
            d["memory_bytes"] = int(d["memory_bytes"])
            d["collective_factors"] = tuple(
                (str(k), float(v["alpha"]), float(v["beta"])) for k, v in (d.get("collective_factors") or {}).items()
            )
            return ClusterSpec(**d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(
                f"bad cluster description ({e}); it needs name, peak_flops {{dtype: FLOP/s}}, memory_bandwidth, "
                "memory_bytes, devices_per_node, intra_node {alpha, beta}, inter_node {alpha, beta}"
            ) from None


GB = 1e9
_GIB = 1 << 30
# fp32 AdamW touches 28 bytes per element: reads parameter, gradient and both moments, writes
# parameter and moments; memory-bound on a GPU.
_ADAMW_BYTES = 28
# What the GPU presets take from measurements rather than datasheets (a plan priced at datasheet
# rates runs slower than predicted):
# - Links: NCCL's achieved bus bandwidth. NVLink moves about 20 of each link's 25 GB/s of line rate
#   in the 128-byte payloads SM-driven collectives use, so an 8-GPU A100 all-reduce reaches
#   ~230 GB/s, an H100 ring collective ~370 GB/s (NCCL maintainer, NVIDIA/nccl-tests issues 149 and
#   212); all-reduce across HDR InfiniBand nodes measured 86-96% of line rate (nccl-tests 119, 175).
# - Memory-bound kernels: an A800 80GB (HBM2e, as the A100 80GB) streamed 1727 of its 1935 GB/s in
#   an elementwise benchmark (mli/transformers-benchmarks issue 4), hence memory_efficiency 0.89.
# - GEMMs: an A100 80GB ran fp16 matmuls at 230 of 312 TFLOP/s (the same benchmarks' README),
#   hence compute_efficiency 0.75; H100 assumed alike.
_GPU_OVERHEADS = ("Links at NCCL's achieved bus bandwidth, large GEMMs at 3/4 of peak and memory-bound kernels "
                  "at 89% of HBM bandwidth (measured figures, see cluster.py). Per-op overheads are eager "
                  "PyTorch's launch cost; AdamW is priced memory-bound (28 bytes per fp32 element) plus a fused "
                  "launch per tensor.")
_MEMORY_EFFICIENCY = 0.89

PRESETS: dict[str, ClusterSpec] = {
    # NVIDIA A100 SXM4 80GB in a DGX A100 (8 GPUs per node).
    "a100-80g": ClusterSpec(
        name="a100-80g",
        peak_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)),
        memory_bandwidth=2.039e12,
        memory_bytes=80 * _GIB,
        devices_per_node=8,
        intra_node=Link(alpha=5e-6, beta=1 / (230 * GB)),
        inter_node=Link(alpha=10e-6, beta=1 / (23 * GB)),
        source=(
            "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16, 19.5 TFLOP/s FP32, 2,039 GB/s HBM2e; "
            "NVLink 3 300 GB/s per direction, of which NCCL achieves ~230; DGX A100 user guide: "
            "8x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU, ~23 achieved. Latencies are typical NCCL figures. "
            + _GPU_OVERHEADS
        ),
        op_overhead_s=10e-6,
        backward_op_overhead_s=10e-6,
        compute_efficiency=0.75,
        memory_efficiency=_MEMORY_EFFICIENCY,
        optimizer_s_per_element=_ADAMW_BYTES / (2.039e12 * _MEMORY_EFFICIENCY),
        optimizer_s_per_tensor=5e-6,
    ),
    # NVIDIA H100 SXM5 80GB in a DGX H100 (8 GPUs per node).
    "h100-80g": ClusterSpec(
        name="h100-80g",
        peak_flops=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12)),
        memory_bandwidth=3.35e12,
        memory_bytes=80 * _GIB,
        devices_per_node=8,
        intra_node=Link(alpha=4e-6, beta=1 / (370 * GB)),
        inter_node=Link(alpha=8e-6, beta=1 / (46 * GB)),
        source=(
            "NVIDIA H100 datasheet (SXM): 989 TFLOP/s dense BF16/FP16, 67 TFLOP/s FP32, 3.35 TB/s HBM3; "
            "NVLink 4 450 GB/s per direction, of which NCCL's ring collectives achieve ~370; DGX H100: "
            "8x 400 Gb/s NDR InfiniBand = 50 GB/s per GPU, ~46 achieved. Latencies are typical NCCL figures. "
            + _GPU_OVERHEADS
        ),
        op_overhead_s=8e-6,
        backward_op_overhead_s=8e-6,
        compute_efficiency=0.75,
        memory_efficiency=_MEMORY_EFFICIENCY,
        optimizer_s_per_element=_ADAMW_BYTES / (3.35e12 * _MEMORY_EFFICIENCY),
        optimizer_s_per_tensor=4e-6,
    ),
    # This kind of machine: processes on a few CPU cores talking gloo over loopback TCP.
    "cpu-gloo": ClusterSpec(
        name="cpu-gloo",
        # one thread's GEMM, measured on this 2-core EPYC VM (1024^3, torch 2.13): bf16 runs 2.3x
        # fp32's rate, fp16 has no fast CPU kernel (~1/80 of fp32's)
        peak_flops=(("float32", 20e9), ("bfloat16", 46e9), ("float16", 0.25e9)),
        memory_bandwidth=20e9,
        memory_bytes=8 * _GIB,
        devices_per_node=1 << 20,
        intra_node=Link(alpha=60e-6, beta=1 / (1.0 * GB)),
        inter_node=Link(alpha=60e-6, beta=1 / (1.0 * GB)),
        source=(
            "Rough figures for gloo over loopback on a 2-core cloud VM (one core per rank, fp32 GEMM "
            "~20 GFLOP/s; an add past the caches streams ~37 GB/s on one rank alone, ~20 per rank "
            "beside the others); `autopar profile` measures the real ones. Eager PyTorch: ~2 us per op "
            "forward and backward, AdamW ~2 ns per fp32 element and ~20 us per tensor on one core; "
            "gloo's collectives compete with compute for the cores."
        ),
        # gloo's own algorithms, relative to the ring model (geometric mean 1 over the kinds): its
        # reduce_scatter moves a byte ~4x slower than its all_reduce does. Fitted by
        # `autopar profile --mesh 2` and `--mesh 4` (five fits, this 2-core VM, torch 2.13); the
        # per-axis link above stays rough, the ratios between kinds are gloo's.
        collective_factors=(("all_gather", 1.0, 0.85), ("all_reduce", 1.1, 0.6), ("all_to_all", 0.55, 0.75),
                            ("reduce_scatter", 1.65, 2.6)),
        # gloo runs no ring for one value: `autopar profile` measured 1.8 alphas on 2 ranks, 1.5 on 4
        scalar_all_reduce_alphas=1.5,
        op_overhead_s=2e-6,
        backward_op_overhead_s=3e-6,
        optimizer_s_per_element=2e-9,
        optimizer_s_per_tensor=20e-6,
        comm_overlap=0.0,
        memory_is_budget=False,
    ),
}


def resolve_cluster(cluster) -> ClusterSpec:
    """A ClusterSpec from a preset name, a JSON file path, a dict or a ClusterSpec."""
    if cluster is None:
        return PRESETS["cpu-gloo"]
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, dict):
        return ClusterSpec.from_dict(cluster)
    if isinstance(cluster, (str, Path)):
        if str(cluster) in PRESETS:
            return PRESETS[str(cluster)]
        path = Path(cluster)
        if path.suffix == ".json" or path.exists():
            if not path.exists():
                raise ConfigError(f"cluster file {str(path)!r} does not exist; give a preset name {sorted(PRESETS)} or a JSON file")
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"cluster file {str(path)!r} is not valid JSON: {e}") from None
            data.setdefault("name", str(path))
            return ClusterSpec.from_dict(data)
        raise ConfigError(f"unknown cluster {str(cluster)!r}; use one of {sorted(PRESETS)} or a JSON file path")
    raise ConfigError(f"cluster must be a preset name, a JSON file, a dict or a ClusterSpec, got {type(cluster).__name__}")
