"""Resharding steps on real gloo groups: forward equals the simulator on every rank, backward
follows the dual layout convention (the reshard is the identity on the global tensor, so the input
gradient, read in the dual of the source layout, is the output gradient). Each test spawns its ranks
once and runs every case inside them."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import random
import traceback

import pytest
import torch
import torch.distributed as dist

from autopar.codegen import collectives
from autopar.codegen.collectives import run_reshard
from autopar.cluster import PRESETS
from autopar.errors import MeshError
from autopar.runtime.launch import spawn
from autopar.runtime.process_groups import MeshGroups
from autopar.sharding_spec import Mesh, ShardingSpec
from autopar.sharding_spec.simulator import apply_plan
from autopar.solver.reshard_search import plan_reshard
from dual_layouts import from_locals, to_locals

pytestmark = pytest.mark.multirank

# Plans priced by the plain ring model, under which every step kind wins somewhere (on the cpu-gloo
# preset gloo's slow reduce_scatter never does: an all_reduce and a slice beat it).
RING = dataclasses.replace(PRESETS["cpu-gloo"], name="cpu-gloo ring model", collective_factors=())


def ring(shape) -> Mesh:
    return Mesh(shape, cluster=RING)


# ---- cases (pure, so every rank builds the same list) --------------------------------------------
def all_specs(shape, mesh) -> list[ShardingSpec]:
    """Every even spec of ``shape`` on ``mesh``: per mesh axis R, P or a dim, every order of the
    axes that split one dim."""
    out = []
    for choice in itertools.product(["R", "P", *range(len(shape))], repeat=mesh.ndim):
        per_dim = [[a for a, c in enumerate(choice) if c == d] for d in range(len(shape))]
        partial = [a for a, c in enumerate(choice) if c == "P"]
        for orders in itertools.product(*(itertools.permutations(ax) for ax in per_dim)):
            spec = ShardingSpec(shape, orders, partial, mesh.ndim)
            if spec.is_even(mesh.shape):
                out.append(spec)
    return out


def cases_2x2():
    mesh = ring((2, 2))
    specs_2d = all_specs((4, 8), mesh)  # 18 specs, all of them
    specs_3d = random.Random(0).sample(all_specs((4, 8, 4), mesh), 16)  # of 28
    return [(a, b) for specs in (specs_2d, specs_3d) for a in specs for b in specs]


def cases_2x2x2():
    mesh = ring((2, 2, 2))
    p = lambda text: ShardingSpec.parse(text, (8, 4, 8), 3)  # noqa: E731
    picked = [
        ("[S012, R, R]", "[R, R, S210]"),
        ("[S0, S1, S2]", "[S2, S0, S1]"),
        ("[R, R, R | P012]", "[S1, R, S20]"),
        ("[S01, R, R | P2]", "[R, S2, S10]"),
        ("[S2, R, S10]", "[R, R, R | P012]"),
        ("[R, S12, R | P0]", "[S021, R, R]"),
        ("[S0, R, R | P12]", "[S0, R, R]"),
        ("[R, S2, R | P01]", "[R, S2, R | P1]"),
    ]
    cases = [(p(a), p(b)) for a, b in picked]
    specs = all_specs((8, 4, 8), mesh)
    rng = random.Random(1)
    cases += [(rng.choice(specs), rng.choice(specs)) for _ in range(3)]
    return cases


def cases_2():
    mesh = ring((2,))
    specs = all_specs((4, 6, 2), mesh)  # R, P, S0, S1, S2
    return [(a, b) for a in specs for b in specs]


# ---- inside each rank ---------------------------------------------------------------------------
def run_cases(groups: MeshGroups, cases, tag: str = "") -> tuple[list[str], collections.Counter]:
    """Forward vs the simulator and the backward identity, for every (src, dst) pair. Every rank's
    outputs and input gradients are gathered once, at the end, to check them globally."""
    mesh, rank = groups.mesh, groups.rank
    failures, kinds = [], collections.Counter()
    checks, flat = [], []  # per case: (name, dst, src, value, grad); flat outputs, then flat grads
    for i, (src, dst) in enumerate(cases):
        name = f"{tag}case {i} {src} -> {dst}"
        gen = torch.Generator().manual_seed(1000 + i)
        value = torch.randint(-9, 10, src.shape, generator=gen).float()
        grad = torch.randint(-9, 10, src.shape, generator=gen).float()
        out_local = torch.zeros(dst.local_shape(mesh))
        grad_local = torch.zeros(src.local_shape(mesh))
        try:
            plan = plan_reshard(src, dst, mesh)
            kinds.update(s.kind for s in plan.steps if groups.size(s.axes) > 1)
            locals_in = to_locals(value, src, mesh, "value", split="random", seed=i)
            x = locals_in[rank].clone().requires_grad_(True)
            out = run_reshard(x, plan, groups)
            want = apply_plan(locals_in, plan, mesh)[rank]
            if tuple(out.shape) != tuple(want.shape) or not torch.equal(out.detach(), want):
                failures.append(f"rank {rank} {name}: forward differs from the simulator ({plan})")
            out.backward(to_locals(grad, dst, mesh, "grad", split="random", seed=i)[rank])
            out_local, grad_local = out.detach(), x.grad
        except Exception:
            failures.append(f"rank {rank} {name}: raised\n{traceback.format_exc()}")
        checks.append((name, src, dst, value, grad))
        flat.append((out_local.reshape(-1), grad_local.reshape(-1)))
    everything = _gather_world(torch.cat([o for o, _ in flat] + [g for _, g in flat]))
    offset = 0
    pieces = {r: [] for r in everything}
    for part in [o for o, _ in flat] + [g for _, g in flat]:
        for r, t in everything.items():
            pieces[r].append(t[offset: offset + part.numel()])
        offset += part.numel()
    n = len(checks)
    for j, (name, src, dst, value, grad) in enumerate(checks):
        outs = {r: pieces[r][j].view(dst.local_shape(mesh)) for r in pieces}
        grads = {r: pieces[r][n + j].view(src.local_shape(mesh)) for r in pieces}
        try:
            if not torch.equal(from_locals(outs, dst, mesh, "value"), value):
                failures.append(f"rank {rank} {name}: the output shards do not stand for the input tensor")
            if not torch.equal(from_locals(grads, src, mesh, "grad"), grad):
                failures.append(f"rank {rank} {name}: backward is not the identity on the gradient")
        except AssertionError as err:
            failures.append(f"rank {rank} {name}: {err}")
    return failures, kinds


def _gather_world(t: torch.Tensor) -> dict[int, torch.Tensor]:
    bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t.contiguous())
    return dict(enumerate(bufs))


def _check_handles(groups: MeshGroups) -> list[str]:
    """ranks/index/group agree with the Mesh for every ordered axis subset."""
    mesh, rank, bad = groups.mesh, groups.rank, []
    for k in range(1, mesh.ndim + 1):
        for axes in itertools.permutations(range(mesh.ndim), k):
            ranks = groups.ranks(axes)
            if ranks != mesh.group_of(rank, axes) or groups.index(axes) != mesh.index_in(rank, axes):
                bad.append(f"rank {rank}: group over {axes} is {ranks}, index {groups.index(axes)}")
            if sorted(dist.get_process_group_ranks(groups.group(axes))) != sorted(ranks):
                bad.append(f"rank {rank}: torch group over {axes} holds the wrong ranks")
    return bad


def rank_2x2(rank, world_size):
    groups = MeshGroups(ring((2, 2)))
    failures = _check_handles(groups)
    cases = cases_2x2()
    f, kinds = run_cases(groups, cases)
    failures += f
    # The emulated all_gather / reduce_scatter / all_to_all, on every 4th pair that uses one.
    collectives.EMULATE.update({"all_gather", "reduce_scatter", "all_to_all"})
    comm = [c for c in cases if {s.kind for s in plan_reshard(*c, groups.mesh).steps} & collectives.EMULATE]
    f, _ = run_cases(groups, comm[::4], tag="emulated ")
    collectives.EMULATE.clear()
    return failures + f, dict(kinds), len(cases)


def rank_2x2x2(rank, world_size):
    groups = MeshGroups(ring((2, 2, 2)))
    failures = _check_handles(groups)
    cases = cases_2x2x2()
    f, kinds = run_cases(groups, cases)
    return failures + f, dict(kinds), len(cases)


def rank_2(rank, world_size):
    failures = []
    try:
        MeshGroups(ring((2, 2)))
        failures.append(f"rank {rank}: MeshGroups of a (2, 2) mesh on 2 ranks did not raise")
    except MeshError as err:
        if "needs 4 ranks" not in str(err):
            failures.append(f"rank {rank}: unhelpful MeshError: {err}")
    groups = MeshGroups(ring((2,)))
    failures += _check_handles(groups)
    cases = cases_2()
    f, kinds = run_cases(groups, cases)
    failures += f
    collectives.EMULATE.update({"all_gather", "reduce_scatter", "all_to_all"})
    f, _ = run_cases(groups, cases, tag="emulated ")
    collectives.EMULATE.clear()
    failures += f
    # Size-1 axes: the groups over them are single ranks and their steps do nothing.
    for shape in ((2, 1), (1, 2)):
        groups = MeshGroups(ring(shape))
        failures += _check_handles(groups)
        mesh = groups.mesh
        specs = all_specs((4, 2), mesh)
        f, _ = run_cases(groups, [(a, b) for a in specs for b in specs], tag=f"mesh {shape} ")
        failures += f
    return failures, dict(kinds), len(cases)


# ---- the tests --------------------------------------------------------------------------------------
def _assert_clean(results, want_kinds=()):
    failures = [f for fs, _, _ in results for f in fs]
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:8])
    kinds = collections.Counter()
    for _, k, _ in results:
        kinds.update(k)
    missing = set(want_kinds) - set(kinds)
    assert not missing, f"no case exercised {sorted(missing)}; ran {dict(kinds)}"


ALL_KINDS = ("all_gather", "slice", "all_reduce", "reduce_scatter", "all_to_all", "to_partial")


def test_reshard_4_ranks_mesh_2x2():
    results = spawn(rank_2x2, 4, timeout_s=300)
    assert results[0][2] == 18 * 18 + 16 * 16
    _assert_clean(results, ALL_KINDS)


def test_reshard_8_ranks_mesh_2x2x2():
    results = spawn(rank_2x2x2, 8, timeout_s=300)
    _assert_clean(results, ALL_KINDS)


def test_reshard_2_ranks_1d_mesh_and_size_1_axes():
    results = spawn(rank_2, 2, timeout_s=180)
    _assert_clean(results, ALL_KINDS)
