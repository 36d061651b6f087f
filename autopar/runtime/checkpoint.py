"""Checkpoints: save a ParallelModule (and its optimizer) where each rank writes only its shards,
load it back into any plan, mesh or number of ranks, or into one process; export one safetensors file.

    autopar.save(path, pmodel, optimizer=None, extra=None)     # on every rank
    extra = autopar.load(path, pmodel, optimizer=None)         # on every rank, any plan / mesh
    extra = autopar.load(path, model, optimizer=None)          # a plain nn.Module, one process
    state = autopar.load_full(path)                            # full tensors, original keys
    autopar.export(path, pmodel)                               # one safetensors file (rank 0 writes)

The tensors go through ``torch.distributed.checkpoint`` (DCP): the model's state dict holds DTensors
over the plan's own groups (``ParallelModule.state_dict``), the optimizer's states DTensors laid out
like their parameters (a ZeRO-2 parameter's states as its dim-0 chunk), so DCP writes each shard
once (replicas deduplicated) and reads, for another layout, the slices each rank needs. Keys:
``model.<original key>``, ``optim.<parameter name>.<state>`` (scalars such as AdamW's ``step``
as plain tensors). ``extra`` (step counters, data-loader positions, RNG states: anything
``torch.save`` takes) is rank 0's, and every rank gets it back.

Crash safety. ``path`` is a directory of versions:

    path/v000003/      DCP's files, autopar.json (what was saved), extra.pt, COMMITTED
    path/LATEST        the committed version's name, replaced atomically (write, fsync, rename)

A save writes a new version; only when every rank has written (a barrier) does rank 0 write
``COMMITTED`` and then point ``LATEST`` at it, and then remove all but the newest ``keep``
committed versions (and any uncommitted ones). A save killed part-way leaves ``LATEST`` on the
previous version, which stays whole. Loading reads the version ``LATEST`` names (or a version
directory given directly); one without ``COMMITTED``, a directory that is not a checkpoint, or a
checkpoint that lacks a key the module needs raises ``CheckpointError`` saying what is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.errors import CheckpointError, ConfigError

LATEST = "LATEST"
COMMITTED = "COMMITTED"
META = "autopar.json"
EXTRA = "extra.pt"
FORMAT = 1
_VERSION = re.compile(r"^v(\d{6})$")


# ---- saving --------------------------------------------------------------------------------------
def save(path, pmodel, optimizer=None, extra=None, *, keep: int = 2) -> Path:
    """Write a new checkpoint version under directory ``path``; returns its directory. A
    collective: call it on every rank with the same arguments. ``keep``: committed versions kept."""
    import torch.distributed.checkpoint as dcp

    _check_module(pmodel)
    if keep < 1:
        raise ConfigError(f"keep={keep}: at least the new version must be kept")
    root = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    version = _on_rank0(lambda: _next_version(root), rank)
    target = root / version
    state = {"model": pmodel.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer_state(pmodel, optimizer)
    dcp.save(state, checkpoint_id=str(target))
    if dist.is_initialized():
        dist.barrier()  # every rank's part is written
    if rank == 0:
        meta = {"format": FORMAT, "model": pmodel._ap.graph.model_name, "keys": list(state["model"]),
                "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                "param_groups": _param_groups(pmodel, optimizer) if optimizer is not None else None}
        (target / META).write_text(json.dumps(meta, indent=1))
        torch.save(extra, target / EXTRA)
        _write_atomic(target / COMMITTED, version)
        _write_atomic(root / LATEST, version)
        _prune(root, keep)
    if dist.is_initialized():
        dist.barrier()  # nobody reads or saves again before the commit
    return target


def optimizer_state(pmodel, optimizer) -> dict:
    """The optimizer's per-parameter states by parameter name, as DTensors laid out like their
    parameters (scalars as plain tensors); nested dicts of the kind DCP saves."""
    names = {id(p): n for n, p in pmodel.named_parameters()}
    layouts = pmodel.param_layouts()
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError("the optimizer holds a parameter that is not the module's; save each module's optimizer with it")
            st = optimizer.state.get(p)
            if not st:
                continue
            fqn = names[id(p)]
            out[fqn] = {k: (layouts[fqn].wrap(v) if _like(v, p) else v) for k, v in st.items()
                        if isinstance(v, torch.Tensor)}
    return out


def _like(v, p) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(p.shape)


def _param_groups(pmodel, optimizer) -> list[dict]:
    names = {id(p): n for n, p in pmodel.named_parameters()}
    out = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None), tuple, list))}
        out.append(dict(hyper, params=[names[id(p)] for p in g["params"]]))
    return out


# ---- loading -------------------------------------------------------------------------------------
def load(path, module, optimizer=None):
    """Load the committed checkpoint under ``path`` into ``module`` (a ParallelModule, on every
    rank, under any plan and mesh; or a plain ``nn.Module`` in one process) and ``optimizer``;
    returns the saved ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    version = committed_version(path)
    metadata = FileSystemReader(str(version)).read_metadata()
    saved = metadata.state_dict_metadata
    parallel = hasattr(module, "_ap")
    model_sd = module.state_dict() if parallel else {k: v.detach() for k, v in module.state_dict().items()}
    missing = [k for k in model_sd if f"model.{k}" not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {version} has no {missing[:5]}{'...' if len(missing) > 5 else ''}: it was saved "
                              "from another model")
    state = {"model": model_sd}
    if optimizer is not None:
        if not any(k.startswith("optim.") for k in saved):
            raise CheckpointError(f"checkpoint {version} holds no optimizer state; load it without optimizer=")
        state["optim"] = _optimizer_template(module, optimizer, saved, parallel)
    try:
        dcp.load(state, checkpoint_id=str(version), no_dist=not (parallel and dist.is_initialized()))
    except Exception as err:  # DCP's own errors name the key; say which checkpoint it was
        raise CheckpointError(f"loading {version} failed: {type(err).__name__}: {err}") from err
    if parallel:
        module.load_state_dict(state["model"])
    else:
        with torch.no_grad():
            own = module.state_dict(keep_vars=True)
            for k, v in state["model"].items():
                own[k].copy_(v)
    if optimizer is not None:
        _restore_optimizer(module, optimizer, state["optim"], version, parallel)
    return torch.load(version / EXTRA, weights_only=False)


def load_full(path) -> dict[str, torch.Tensor]:
    """The checkpoint's model state dict as full tensors (original keys), in this process, with
    no process group needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    version = committed_version(path)
    saved = FileSystemReader(str(version)).read_metadata().state_dict_metadata
    out = {k[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
           for k, m in saved.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    state = {"model": out}
    dcp.load(state, checkpoint_id=str(version), no_dist=True)
    return state["model"]


def committed_version(path) -> Path:
    """The committed version directory ``path`` stands for (see the module docstring)."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"no checkpoint at {root}")
    is_version = _VERSION.match(root.name) and (root.parent / LATEST).exists()
    if is_version or (root / ".metadata").exists() or (root / COMMITTED).exists() or any(root.glob("*.distcp")):
        version = root
    elif (root / LATEST).exists():
        version = root / (root / LATEST).read_text().strip()
    else:
        raise CheckpointError(f"{root} is not an autopar checkpoint (no {LATEST} file and no version in it)")
    if not (version / COMMITTED).exists():
        raise CheckpointError(f"checkpoint version {version} is incomplete (no {COMMITTED} marker: its save did not finish)")
    for name in (".metadata", EXTRA):
        if not (version / name).exists():
            raise CheckpointError(f"checkpoint version {version} lacks {name}")
    return version


def _optimizer_template(module, optimizer, saved, parallel: bool) -> dict:
    """Where the optimizer's saved states land: this layout's DTensors (zeros where the optimizer
    has no state yet), keyed like ``optimizer_state``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names = {id(p): n for n, p in module.named_parameters()}
    layouts = module.param_layouts() if parallel else {}
    by_param: dict[str, dict] = {}  # "optim.<parameter>.<state>" -> parameter -> state -> metadata
    for key, m in saved.items():
        if key.startswith("optim."):
            fqn, state_key = key[len("optim."):].rsplit(".", 1)
            by_param.setdefault(fqn, {})[state_key] = m
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = names.get(id(p))
            keys = by_param.get(fqn)
            if not keys:
                continue
            st = {}
            for k, m in keys.items():
                if not isinstance(m, TensorStorageMetadata):
                    continue
                if tuple(m.size) == tuple(layouts[fqn].global_shape if parallel else p.shape) and len(m.size):
                    local = torch.zeros_like(p, dtype=m.properties.dtype)
                    st[k] = layouts[fqn].wrap(local) if parallel else local
                else:
                    st[k] = torch.zeros(tuple(m.size), dtype=m.properties.dtype, device=p.device if len(m.size) else "cpu")
            out[fqn] = st
    return out


def _restore_optimizer(module, optimizer, loaded: dict, version, parallel: bool) -> None:
    from torch.distributed.tensor import DTensor

    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = names.get(id(p))
            if fqn not in loaded:
                continue
            optimizer.state[p] = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in loaded[fqn].items()}
    meta = json.loads((Path(version) / META).read_text())
    groups = meta.get("param_groups") or []
    if len(groups) == len(optimizer.param_groups):
        for g, saved in zip(optimizer.param_groups, groups):
            for k, v in saved.items():
                if k != "params" and k in g:
                    g[k] = tuple(v) if isinstance(g[k], tuple) else v


# ---- export --------------------------------------------------------------------------------------
def export(path, pmodel, dtype: torch.dtype | None = None) -> None:
    """One safetensors file of the full model under the original keys (tied aliases as copies),
    written by rank 0 (a collective: every rank gathers). ``model.load_state_dict`` of the original
    model takes it, and so does transformers' ``from_pretrained`` beside the model's config.
    Floating tensors are written in ``dtype``; by default in the dtype the model computes in (a
    mixed-precision module's working dtype, not its masters')."""
    from safetensors.torch import save_file

    _check_module(pmodel)
    full = pmodel.full_state_dict()
    if dtype is None and pmodel._ap.precision is not None:
        dtype = pmodel._ap.precision.param_dtype
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        seen, tensors = set(), {}
        for k, v in full.items():  # safetensors refuses shared storage: tied names become copies
            t = v.detach().cpu().contiguous()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[k] = t.clone() if t.untyped_storage().data_ptr() in seen else t
            seen.add(t.untyped_storage().data_ptr())
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, target)
    if dist.is_initialized():
        dist.barrier()


# ---- helpers -------------------------------------------------------------------------------------
def _check_module(pmodel) -> None:
    if not hasattr(pmodel, "_ap"):
        raise ConfigError(f"expected a ParallelModule from autopar.parallelize, got {type(pmodel).__name__}; a plain module "
                          "saves with torch.save(model.state_dict())")


def _on_rank0(fn, rank: int):
    """``fn()`` on rank 0, its value (or its CheckpointError) on every rank: the others must not
    wait for a rank that failed."""
    box = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except CheckpointError as err:
            box[0] = ("error", str(err))
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status != "ok":
        raise CheckpointError(value)
    return value


def _versions(root: Path) -> list[str]:
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _VERSION.match(p.name))


def _next_version(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    if not (root / LATEST).exists() and any(root.iterdir()) and not _versions(root):
        raise CheckpointError(f"{root} holds files that are not an autopar checkpoint; save into a new or empty directory")
    existing = _versions(root)
    n = int(_VERSION.match(existing[-1]).group(1)) + 1 if existing else 1
    return f"v{n:06d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` committed versions, and every uncommitted one (a save
    that did not finish; saves are collective, so none is being written now)."""
    committed = [v for v in _versions(root) if (root / v / COMMITTED).exists()]
    doomed = committed[:-keep] + [v for v in _versions(root) if v not in committed]
    for v in doomed:
        shutil.rmtree(root / v, ignore_errors=True)

