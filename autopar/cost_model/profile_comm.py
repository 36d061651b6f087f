"""Live communication profiling: measure collectives on each mesh axis, fit alpha and beta.

Inside every rank of a live mesh (all ranks call it, in the same place)::

    cluster = profile_mesh(mesh, MeshGroups(mesh))      # a ClusterSpec with fitted axis_links

For every mesh axis of size n > 1, every collective kind and every message size B (bytes, as
``comm.py`` defines B per kind), each rank times ``repeats`` calls on its group over that axis
(all groups of the axis run at once, as in training), after one warm-up call per point, in
interleaved rounds (see ``_measure``). The median per rank is taken, then the max over ranks (a
collective ends when its slowest member does). Per axis,
alpha and beta are fitted to every (kind, B) point of the comm.py model

    t = alpha * latency_hops(kind, n) + beta * volume_factor(kind, n) * B,   alpha, beta >= 0

by non-negative least squares on the *relative* residual (each row divided by its measured t, so
a 4 KiB and a 4 MiB message weigh alike).

Backends do not all follow the ring model equally: on gloo over loopback (torch 2.13, 2x2 mesh),
reduce_scatter moves its bytes ~2.5x slower than all_gather does and all_to_all and all_reduce
~2x faster, and the latencies differ by kind too. One Link per axis then misprices kinds by up to
~2x (median relative error 0.3-0.4 on its own >= 64 KiB points), so with ``per_kind`` (the
default) the fit also finds per-kind factors on alpha and on beta, shared by all axes
(``fit_collective_factors``, geometric mean 1 over the kinds), stores them as
``ClusterSpec.collective_factors`` and fits each axis' alpha and beta under them;
``comm.mesh_collective_time`` applies them.

Each axis also times an all_reduce of one float32 value (a loss, a count): gloo does not run its
ring for fewer elements than ranks, and such a call costs about one alpha where the ring model
charges 2n - 1 (2026-12, 2-core VM: 0.27 ms on 2 ranks, 0.85 ms on 4, against 5-7 ms for 4 KiB).
It is left out of the alpha-beta fits and kept as ``ClusterSpec.scalar_all_reduce_alphas``, the
median over axes of its seconds in units of the axis' all_reduce alpha.

A collective the backend lacks is emulated as the runtime emulates it (all_gather via the list
form, reduce_scatter via all_reduce, all_to_all via all_gather) and the profile says so in
``emulated``.

Rank 0 fits and writes the profile (links and raw measurements) to
``cache_dir()/comm-<backend>-<mesh shape>.json``; every rank gets the same result through
``broadcast_object_list``. A later call with the same mesh shape and backend reads that file.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from autopar.cost_model.cache import cache_dir, read_json, write_json
from autopar.cluster import ClusterSpec, Link, resolve_cluster
from autopar.cost_model.comm import COLLECTIVES, SCALAR_BYTES, latency_hops, volume_factor
from autopar.errors import AutoparError

KIB = 1024
DEFAULT_SIZES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB)
PROFILE_VERSION = 4  # 2: with the one-value all_reduce; 3: the live profile measures a bucket-sized call; 4: small points timed 3x
DEFAULT_REPEATS = 10
SMALL_BYTES, SMALL_REPEATS = 256 * KIB, 3  # small points are timed 3x as often (``_measure``)


@dataclasses.dataclass(frozen=True)
class CommMeasurement:
    """One measured point: ``kind`` on mesh ``axis`` (a group of ``n`` ranks), ``nbytes`` as
    comm.py defines B for that kind, ``seconds`` the max over ranks of the per-rank median."""

    kind: str
    axis: int
    n: int
    nbytes: int
    seconds: float


Factors = Mapping[str, tuple[float, float]]  # kind -> (alpha factor, beta factor)


def _design(measurements: Sequence[CommMeasurement], factors: Factors | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows [alpha factor * latency_hops, beta factor * volume_factor * B] and the measured seconds."""
    factors = factors or {}
    rows = []
    for m in measurements:
        fa, fb = factors.get(m.kind, (1.0, 1.0))
        rows.append([fa * latency_hops(m.kind, m.n), fb * volume_factor(m.kind, m.n) * m.nbytes])
    return np.array(rows, dtype=float).reshape(-1, 2), np.array([m.seconds for m in measurements], dtype=float)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a c - b||, c >= 0, for a few columns: the optimum is the unconstrained least-squares
    solution on its own support, so every support is tried and the best non-negative one kept."""
    cols = a.shape[1]
    if cols > 8:
        raise ValueError(f"nnls here is exhaustive; {cols} columns is too many")
    best, best_res = np.zeros(cols), float(b @ b)
    for mask in range(1, 1 << cols):
        support = [j for j in range(cols) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, support], b, rcond=None)
        if (sol < 0).any():
            continue
        c = np.zeros(cols)
        c[support] = sol
        res = float(np.sum((a @ c - b) ** 2))
        if res < best_res - 1e-15 * max(best_res, 1e-300):
            best, best_res = c, res
    return best


def _weighted(x: np.ndarray, y: np.ndarray, relative: bool) -> tuple[np.ndarray, np.ndarray]:
    if not relative:
        return x, y
    w = 1.0 / np.maximum(y, 1e-12)
    return x * w[:, None], y * w


def fit_alpha_beta(measurements: Iterable[CommMeasurement], *, relative: bool = True, factors: Factors | None = None) -> Link:
    """The Link (alpha, beta >= 0) that best fits ``measurements`` to the comm.py formulas by
    non-negative least squares. ``relative``: each point weighs 1 / its measured time, so the
    fit minimises relative error. ``factors``: per-kind (alpha, beta) factors
    (``fit_collective_factors``) to fit under; none by default."""
    measurements = [m for m in measurements if m.n > 1]
    if not measurements:
        raise ValueError("fit_alpha_beta needs measurements on a group of 2 or more ranks")
    c = nnls(*_weighted(*_design(measurements, factors), relative))
    return Link(alpha=float(c[0]), beta=float(c[1]))


def fit_collective_factors(measurements: Iterable[CommMeasurement], *, relative: bool = True) -> dict[str, tuple[float, float]]:
    """Per collective kind, how far its alpha and its beta depart from the other kinds'.

    On each axis, every kind gets its own (alpha, beta) fit; a kind's alpha factor is the
    geometric mean over axes of its alpha over that axis' geometric-mean alpha (likewise beta),
    and the factors are normalised to a geometric mean of 1 over the kinds. A coefficient that
    fits to 0 is left out of the means; a kind with no usable alpha (or beta) gets 1.0 for it."""
    measurements = [m for m in measurements if m.n > 1]
    kinds = [k for k in COLLECTIVES if any(m.kind == k for m in measurements)]
    ratios = {k: ([], []) for k in kinds}  # kind -> (alpha ratios, beta ratios)
    for axis in sorted({m.axis for m in measurements}):
        per_kind = {}
        for k in kinds:
            pts = [m for m in measurements if m.axis == axis and m.kind == k]
            if len({m.nbytes for m in pts}) >= 2:
                per_kind[k] = nnls(*_weighted(*_design(pts), relative))
        for j in (0, 1):
            values = {k: c[j] for k, c in per_kind.items() if c[j] > 0}
            if len(values) >= 2:
                mean = _geomean(values.values())
                for k, v in values.items():
                    ratios[k][j].append(v / mean)
    raw = {j: {k: _geomean(r[j]) for k, r in ratios.items() if r[j]} for j in (0, 1)}
    norm = {j: _geomean(raw[j].values()) if raw[j] else 1.0 for j in (0, 1)}
    return {k: (raw[0].get(k, norm[0]) / norm[0], raw[1].get(k, norm[1]) / norm[1]) for k in kinds}


def _geomean(values) -> float:
    values = list(values)
    return float(np.exp(np.mean(np.log(values))))


def predict(link: Link, m: CommMeasurement, factors: Factors | None = None) -> float:
    """The model's seconds for one measurement's kind, group size and bytes."""
    x, _ = _design([m], factors)
    return float(x[0] @ np.array([link.alpha, link.beta]))


def relative_errors(link: Link, measurements: Iterable[CommMeasurement], factors: Factors | None = None) -> list[float]:
    """|predicted - measured| / measured for each measurement."""
    return [abs(predict(link, m, factors) - m.seconds) / m.seconds for m in measurements]


@dataclasses.dataclass(frozen=True)
class CommProfile:
    """The result of profiling a live mesh: the fitted cluster, its raw measurements, the backend,
    the mesh shape and the collective kinds that had to be emulated."""

    cluster: ClusterSpec
    measurements: tuple[CommMeasurement, ...]
    backend: str
    mesh_shape: tuple[int, ...]
    emulated: tuple[str, ...] = ()

    @property
    def factors(self) -> dict[str, tuple[float, float]]:
        """The cluster's per-kind (alpha, beta) factors."""
        return {k: (a, b) for k, a, b in self.cluster.collective_factors}

    def axis_measurements(self, axis: int, min_bytes: int = 0) -> list[CommMeasurement]:
        return [m for m in self.measurements if m.axis == axis and m.nbytes >= min_bytes]

    def fit_error(self, axis: int, min_bytes: int = 0) -> float:
        """Median relative error of the fitted link of ``axis`` over its own measurements of at
        least ``min_bytes``."""
        errs = relative_errors(self.cluster.links_for(self.mesh_shape)[axis],
                               self.axis_measurements(axis, max(min_bytes, SCALAR_BYTES + 1)), self.factors)
        return statistics.median(errs) if errs else 0.0

    def to_dict(self) -> dict:
        return {
            "version": PROFILE_VERSION,
            "backend": self.backend,
            "mesh_shape": list(self.mesh_shape),
            "emulated": list(self.emulated),
            "cluster": self.cluster.to_dict(),
            "measurements": [dataclasses.asdict(m) for m in self.measurements],
        }

    @staticmethod
    def from_dict(d: dict) -> "CommProfile":
        return CommProfile(
            cluster=ClusterSpec.from_dict(d["cluster"]),
            measurements=tuple(CommMeasurement(**m) for m in d["measurements"]),
            backend=d["backend"],
            mesh_shape=tuple(d["mesh_shape"]),
            emulated=tuple(d.get("emulated", ())),
        )


def profile_path(mesh_shape: Sequence[int], backend: str, directory=None) -> Path:
    """``cache_dir()/comm-<backend>-<2x2>.json``."""
    return cache_dir(directory) / f"comm-{backend}-{'x'.join(map(str, mesh_shape))}.json"


def profile_mesh(mesh, groups, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS, **kwargs) -> ClusterSpec:
    """The ClusterSpec of ``measure_mesh`` (same arguments): ``base_cluster`` with one fitted
    Link per mesh axis as ``axis_links`` and the per-kind ``collective_factors``."""
    return measure_mesh(mesh, groups, sizes, repeats, **kwargs).cluster


def measure_mesh(
    mesh,
    groups,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    *,
    kinds: Sequence[str] = COLLECTIVES,
    base_cluster="cpu-gloo",
    cache: bool = True,
    refresh: bool = False,
    directory=None,
    per_kind: bool = True,
) -> CommProfile:
    """Measure and fit every mesh axis (see the module docstring); call on every rank.
    ``groups``: ``autopar.runtime.process_groups.MeshGroups(mesh)``. ``cache``: read a cached
    profile for this mesh shape and backend (unless ``refresh``) and write the new one
    (``directory`` overrides the cache dir). ``per_kind``: also fit per-kind (alpha, beta)
    factors; without it each axis gets one Link for every kind."""
    import torch.distributed as dist

    if repeats < 1 or not sizes:
        raise ValueError(f"need repeats >= 1 and at least one size, got repeats={repeats}, sizes={sizes}")
    unknown = [k for k in kinds if k not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown collectives {unknown}; expected some of {COLLECTIVES}")
    base = resolve_cluster(base_cluster)
    backend = str(dist.get_backend())
    path = profile_path(mesh.shape, backend, directory)

    box: list = [None]
    if dist.get_rank() == 0 and cache and not refresh:
        box[0] = _cached(path, mesh.shape)
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        return _with_base(CommProfile.from_dict(box[0]), base)

    points, emulated = _measure(mesh, groups, sizes, repeats, kinds)
    import torch

    medians = torch.tensor([p[-1] for p in points], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank sets each point
    flags = torch.tensor([k in emulated for k in COLLECTIVES], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)

    if dist.get_rank() == 0:
        measurements = tuple(CommMeasurement(kind, axis, n, nbytes, float(t))
                             for (kind, axis, n, nbytes, _), t in zip(points, medians.tolist()))
        cluster = fit_cluster(measurements, mesh.shape, base, per_kind=per_kind)
        emulated_kinds = tuple(k for k, f in zip(COLLECTIVES, flags.tolist()) if f)
        box[0] = CommProfile(cluster, measurements, backend, tuple(mesh.shape), emulated_kinds).to_dict()
        if cache:
            write_json(path, box[0])
    dist.broadcast_object_list(box, src=0)
    return CommProfile.from_dict(box[0])


def fit_cluster(measurements: Sequence[CommMeasurement], mesh_shape: Sequence[int], base_cluster="cpu-gloo",
                *, per_kind: bool = True) -> ClusterSpec:
    """``base_cluster`` with a fitted Link per mesh axis (``axis_links``) and, with ``per_kind``,
    the fitted per-kind (alpha, beta) factors (``collective_factors``). A pure function of the
    measurements; axes of size 1 keep the base cluster's link."""
    base = resolve_cluster(base_cluster)
    shape = tuple(mesh_shape)
    if base.axis_links is not None and len(base.axis_links) == len(shape):
        default = base.axis_links
    else:
        default = dataclasses.replace(base, axis_links=None).links_for(shape)
    scalars = [m for m in measurements if m.nbytes <= SCALAR_BYTES]
    measurements = [m for m in measurements if m.nbytes > SCALAR_BYTES]
    factors = fit_collective_factors(measurements) if per_kind else {}
    links = []
    for axis, size in enumerate(shape):
        points = [m for m in measurements if m.axis == axis]
        links.append(fit_alpha_beta(points, factors=factors) if size > 1 and points else default[axis])
    scalar_alphas = _scalar_alphas(scalars, links, factors.get("all_reduce", (1.0, 1.0))[0])
    text = "; ".join(f"axis {a}: alpha={l.alpha:.3g} s, beta={l.beta:.3g} s/B" for a, l in enumerate(links))
    if factors:
        text += "; (alpha, beta) x " + ", ".join(f"{k} ({a:.2f}, {b:.2f})" for k, (a, b) in factors.items())
    if scalar_alphas is not None:
        text += f"; an all_reduce of one value {scalar_alphas:.2f} alphas"
    return dataclasses.replace(
        base,
        name=f"{base.name}+profiled",
        axis_links=tuple(links),
        collective_factors=tuple((k, a, b) for k, (a, b) in factors.items()),
        scalar_all_reduce_alphas=scalar_alphas,
        source=f"profiled on a live mesh {'x'.join(map(str, shape))}: {text}; other fields from {base.name}",
    )


def _scalar_alphas(scalars: Sequence[CommMeasurement], links: Sequence[Link], factor: float) -> float | None:
    """The one-value all_reduces' seconds in alphas of their axis (all_reduce's ``factor``
    applied), the median over axes, at most the ring's 2n - 1; None without such a point."""
    ratios = [min(m.seconds / (links[m.axis].alpha * factor), latency_hops("all_reduce", m.n))
              for m in scalars if m.kind == "all_reduce" and m.n > 1 and links[m.axis].alpha > 0]
    return max(float(statistics.median(ratios)), 1e-3) if ratios else None


def load_profile(mesh_shape: Sequence[int], backend: str = "gloo", directory=None) -> CommProfile | None:
    """The cached profile of a mesh shape and backend, without processes (None if there is none)."""
    data = _cached(profile_path(mesh_shape, backend, directory), mesh_shape)
    return None if data is None else CommProfile.from_dict(data)


def _cached(path: Path, mesh_shape) -> dict | None:
    """The cached profile's JSON if it is readable, current and for this mesh shape."""
    data = read_json(path)
    if data is None or data.get("version") != PROFILE_VERSION or tuple(data.get("mesh_shape", ())) != tuple(mesh_shape):
        return None
    try:
        CommProfile.from_dict(data)
    except (AutoparError, KeyError, TypeError, ValueError):
        return None
    return data


def _with_base(profile: CommProfile, base: ClusterSpec) -> CommProfile:
    """A cached profile's fitted links and factors on top of the caller's base cluster."""
    fitted = profile.cluster
    cluster = dataclasses.replace(base, name=f"{base.name}+profiled", axis_links=fitted.axis_links,
                                  collective_factors=fitted.collective_factors,
                                  scalar_all_reduce_alphas=fitted.scalar_all_reduce_alphas, source=fitted.source)
    return dataclasses.replace(profile, cluster=cluster)


# ---- measuring ------------------------------------------------------------------------------------
def _measure(mesh, groups, sizes, repeats, kinds) -> tuple[list[tuple], set[str]]:
    """(kind, axis, n, nbytes, this rank's median seconds) per point, and the emulated kinds.

    Rounds are interleaved: each round times every point once, so a burst of load from other
    processes spreads over many points instead of spoiling one. Each timed call is preceded by a
    barrier on its group, so a call's time does not include waiting for a peer still busy with the
    previous point. Points of at most ``SMALL_BYTES`` are timed ``SMALL_REPEATS`` times as often:
    they cost little, and their time is mostly the peers' scheduling (4 gloo ranks on 2 cores: a
    4 KiB call's median of 5 ranged 0.3-4.4 ms between runs, and the latencies fitted to them, per
    kind, 3x), where a large one's is its bytes."""
    import torch
    import torch.distributed as dist

    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    plan, emulated = [], set()
    buffers: dict = {"device": device}
    for axis, n in enumerate(mesh.shape):
        if n == 1:
            continue
        pg = groups.group((axis,))
        for kind in kinds:
            for size in sizes:
                elems = max(n, (int(size) // 4) // n * n)  # float32, divisible by the group size
                run, is_emulated = _collective(kind, elems, n, pg, buffers)
                if is_emulated:
                    emulated.add(kind)
                run()  # warm-up
                plan.append(((kind, axis, n, elems * 4), pg, run))
            if kind == "all_reduce":  # one value (see the module docstring)
                run, _ = _collective(kind, 1, n, pg, buffers)
                run()
                plan.append(((kind, axis, n, 4), pg, run))
    times: list[list[float]] = [[] for _ in plan]
    for r in range(repeats * SMALL_REPEATS):
        for i, ((_, _, _, nbytes), pg, run) in enumerate(plan):
            if r >= repeats and nbytes > SMALL_BYTES:
                continue
            dist.barrier(group=pg)
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            times[i].append(time.perf_counter() - t0)
    dist.barrier()
    return [(*key, statistics.median(t)) for (key, _, _), t in zip(plan, times)], emulated


def _collective(kind: str, elems: int, n: int, pg, buffers: dict):
    """A no-argument callable running ``kind`` on ``pg`` with B = 4 * elems bytes, and whether it
    is emulated. The native form is tried once; a backend that rejects it gets the emulation.
    ``buffers`` caches the tensors per (elems, n), shared by every kind, on ``buffers["device"]``."""
    import torch
    import torch.distributed as dist

    bufs = buffers.setdefault((elems, n), {})
    device = buffers.get("device", "cpu")
    # Zeros: repeated in-place sums of them never overflow or turn denormal.
    full = bufs.setdefault("full", torch.zeros(elems, device=device))
    part = bufs.setdefault("part", torch.zeros(elems // n, device=device))
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full, group=pg)), False
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        native = lambda: gather(full, part, group=pg)  # noqa: E731
        parts = list(full.chunk(n))
        emulated = lambda: dist.all_gather(parts, part, group=pg)  # noqa: E731
    elif kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        native = lambda: scatter(part, full, group=pg)  # noqa: E731
        emulated = lambda: dist.all_reduce(full, group=pg)  # noqa: E731
    elif kind == "all_to_all":
        out = bufs.setdefault("out", torch.empty_like(full))
        native = lambda: dist.all_to_all_single(out, full, group=pg)  # noqa: E731
        parts = [torch.empty_like(full) for _ in range(n)]
        emulated = lambda: dist.all_gather(parts, full, group=pg)  # noqa: E731
    else:
        raise ValueError(f"unknown collective {kind!r}")
    try:
        native()
        return native, False
    except (RuntimeError, NotImplementedError, ValueError) as err:
        if "support" not in str(err).lower() and "implement" not in str(err).lower():
            raise
        return emulated, True
