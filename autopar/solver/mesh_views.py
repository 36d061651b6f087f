"""Views of a mesh's devices with other axis shapes, each axis keeping the hardware it spans.

A hand-written configuration names a (pipeline x data rows, tensor) shape whatever the mesh's own
(``config_mesh``); the planner tries the same views of a stage's sub-mesh (``narrower_views``), so
the tensor-parallel widths a configuration can name are widths the search reaches too.
"""
from __future__ import annotations

from autopar.cost_model.comm import group_link
from autopar.sharding_spec.mesh import Mesh


def config_mesh(mesh, rows: int, tp: int):
    """The devices of ``mesh`` viewed as (pipeline x data rows, tensor) - the shape a hand-written
    configuration names - unless ``mesh`` has that shape already. The view keeps the hardware: the
    tensor axis takes the innermost ``tp`` devices (the slowest link among the axes it spans), the
    rows axis the rest (the slowest link among the axes it spans)."""
    want = tuple(d for d in (rows, tp) if d > 1) or (1,)
    active = tuple(s for s in mesh.shape if s > 1) or (1,)
    if active == want:
        return mesh
    cluster = mesh.resolved_cluster()
    if cluster.axis_links is None:  # the cluster's node rule places the view's axes itself
        return Mesh(want, cluster=mesh.cluster)
    links = mesh.links()
    inner, p = [], 1
    for a in reversed(range(mesh.ndim)):
        if p >= tp:
            break
        inner.append(a)
        p *= mesh.shape[a]
    outer = [a for a in range(mesh.ndim) if a not in inner or p > tp]
    tp_link = group_link([links[a] for a in inner]) if inner else links[-1]
    rows_link = group_link([links[a] for a in outer if mesh.shape[a] > 1] or [links[0]])
    view_links = [link for d, link in ((rows, rows_link), (tp, tp_link)) if d > 1] or [links[0]]
    return Mesh(want, cluster=mesh.resolved_cluster().with_axis_links(view_links))


def narrower_views(mesh: Mesh) -> list[Mesh]:
    """The views (devices / k, k) of ``mesh`` for each divisor k of its innermost axes' devices
    below them: a (r, 8) sub-mesh of nodes of 8 offers (2r, 4), (4r, 2) and (8r,), whose inner axis
    keeps the node's link and whose outer axis the slowest link it spans. None for a one-axis mesh."""
    if len([s for s in mesh.shape if s > 1]) < 2:
        return []
    inner = mesh.shape[-1]
    rows = mesh.size // inner
    return [config_mesh(mesh, rows * (inner // k), k) for k in range(inner - 1, 0, -1) if inner % k == 0]
